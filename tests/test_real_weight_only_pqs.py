"""A weight-only Linear whose disabled input quantizer keeps a pre_quant_scale (AWQ's scale where no norm could take
it, e.g. a decoder's o_proj) becomes a real module that multiplies its input by the scale, as the fake one does."""

from __future__ import annotations

import json

import pytest
import torch
from fast_real_helpers import assert_within, fake_mlp, inputs, int4_cfg
from state_files import save_crafted_real

import modelopt_lite as mtl
from modelopt_lite.real import fake2real, load_real


def _awq_like(dtype=torch.float32, seed=0):
    fq = fake_mlp(int4_cfg(32), dtype, dims=(64, 128, 32), seed=seed)
    g = torch.Generator().manual_seed(3)
    for i in (0, 2):
        k = fq[i].weight.shape[1]
        fq[i].input_quantizer.pre_quant_scale = (torch.rand(k, generator=g) + 0.5).to(dtype)
    assert not fq[0].input_quantizer.is_enabled
    return fq


@pytest.mark.parametrize("backend", ["auto", "int4pack"])
def test_weight_only_pre_quant_scale_is_kept(backend):
    fq = _awq_like()
    real = fake2real(fq, inplace=False, backend=backend)
    x = inputs(64, torch.float32)
    for i in (0, 2):
        assert real[i].spec["input"] is None and real[i].spec["pre_quant_scale"] is True
        assert torch.equal(real[i].pre_quant_scale, fq[i].input_quantizer.pre_quant_scale.float())
    with torch.no_grad():
        want, got = fq(x), real(x)
    if backend == "auto":  # the float32 dequant path computes what the fake model computes
        assert torch.equal(got, want)
    else:  # torch's int4 GEMM: within the computed bound of the fake layer
        with torch.no_grad():
            assert_within(fq[0](x), real[0](x), real[0].error_bound(x), "int4pack with pre_quant_scale")


def test_weight_only_pre_quant_scale_round_trips_a_checkpoint(tmp_path):
    fq = _awq_like()
    real = fake2real(fq, inplace=False, save_dir=tmp_path / "real")
    cfg = json.loads((tmp_path / "real" / "model_int8.json").read_text())
    assert cfg["modules"]["0"]["pre_quant_scale"] is True and cfg["modules"]["0"]["input"] is None
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    loaded = load_real(fresh, tmp_path / "real")
    x = inputs(64, torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(x), real(x))


def test_a_bad_weight_only_pre_quant_scale_in_a_checkpoint_is_refused(tmp_path):
    from safetensors import safe_open

    fake2real(_awq_like(), inplace=False, save_dir=tmp_path)
    path = tmp_path / "model_int8.safetensors"
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["0.pre_quant_scale"] = -tensors["0.pre_quant_scale"]
    save_crafted_real(path, tensors, meta)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    with pytest.raises(ValueError, match=r"0\.pre_quant_scale: pre_quant_scale must be finite and > 0, got -"):
        load_real(fresh, tmp_path)


def test_a_spec_with_both_pre_quant_scales_is_refused():
    from modelopt_lite.real.spec_checks import check_spec

    spec = {
        "type": "QuantizedLinear",
        "weight_shape": [4, 32],
        "weight": {
            "num_bits": 8,
            "unsigned": False,
            "narrow_range": True,
            "layout": "channel",
            "axis": [0],
            "block_sizes": None,
            "storage": "int8",
            "dtype": "float32",
        },
        "input": {"num_bits": 8, "unsigned": False, "narrow_range": True, "num_steps": 1, "pre_quant_scale": True},
        "bias": None,
        "pre_quant_scale": True,
    }
    with pytest.raises(ValueError, match=r"modules\['m'\]\.pre_quant_scale: is for weight-only modules"):
        check_spec("f.json", "m", spec)
    spec["pre_quant_scale"] = "yes"
    with pytest.raises(ValueError, match=r"pre_quant_scale"):
        check_spec("f.json", "m", spec)


def test_a_conv_with_a_pre_quant_scale_is_still_refused():
    conv = mtl.quantize(
        torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)),
        mtl.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
        lambda m: m(torch.randn(2, 3, 8, 8)),
    )
    conv[0].input_quantizer.pre_quant_scale = torch.ones(3)
    with pytest.raises(ValueError, match=r"module '0'.*pre_quant_scale.*only on a Linear input"):
        fake2real(conv)
