"""fake2real of NVFP4 / OCP MX models: packed E2M1 codes (two per byte) with E4M3 / E8M0 block scales, outputs
bit-identical to the fake-quant model, checkpoints that round-trip bit for bit and reject corrupted values."""

from __future__ import annotations

import json

import pytest
import torch
from state_files import save_crafted_real
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.real import fake2real, load_real, save_real

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, "axis": None}


def _mx(num_bits) -> dict:
    return {"num_bits": num_bits, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}, "axis": None}


FORMATS = {
    "nvfp4": NVFP4,
    "mxfp8": _mx((4, 3)),
    "mxfp8_e5m2": _mx((5, 2)),
    "mxfp4": _mx((2, 1)),
    "mxint8": _mx(8),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40)).eval()


def _quantized(fmt: str, activations: bool) -> tuple[nn.Module, torch.Tensor]:
    model = _model()
    x = torch.randn(8, 64) * torch.logspace(-2, 1, 64)
    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            "*weight_quantizer": dict(FORMATS[fmt], enable=True),
            "*input_quantizer": dict(FORMATS[fmt], enable=activations),
        },
        "algorithm": "max",
    }
    return mtq.quantize(model, cfg, lambda m: m(x)), x


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("activations", [False, True], ids=["weight_only", "w_and_a"])
def test_fake2real_is_bit_identical(fmt, activations):
    q, x = _quantized(fmt, activations)
    with torch.no_grad():
        ref = q(x)
        real = fake2real(q)
        y = real(x)
    assert y.dtype == torch.float32 and torch.equal(y, ref)
    lin = real[0]
    assert lin.compute == "dequant"
    assert lin.spec["weight"]["scheme"] == fmt and (lin.spec["input"] is not None) == activations
    bufs = dict(lin.named_buffers())
    if fmt in ("nvfp4", "mxfp4"):
        assert bufs["weight_packed"].dtype == torch.uint8 and tuple(bufs["weight_packed"].shape) == (48, 32)
    else:
        assert tuple(bufs["weight_codes"].shape) == (48, 64)
    block = 16 if fmt == "nvfp4" else 32
    assert bufs["weight_block_scale"].dtype == torch.uint8
    assert tuple(bufs["weight_block_scale"].shape) == (48, 64 // block)


def test_nvfp4_storage_is_about_0_14x_fp32():
    q, _ = _quantized("nvfp4", False)
    real = fake2real(q)
    w = real[0]
    stored = sum(t.numel() * t.element_size() for n, t in w.named_buffers() if n.startswith("weight"))
    ratio = stored / (48 * 64 * 4)
    assert 0.14 <= ratio < 0.145, ratio  # 4 bits + one E4M3 byte per 16 elements (+ 4 bytes) = 4.5 / 32


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxint8"])
def test_checkpoint_round_trip(tmp_path, fmt):
    q, x = _quantized(fmt, True)
    with torch.no_grad():
        ref = q(x)
    real = fake2real(q)
    save_real(real, tmp_path / "ckpt")
    loaded = load_real(_model(), tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)
    for (n, a), (_, b) in zip(real.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), n


def _corrupt(tmp_path, fmt: str, edit_config=None, edit_tensors=None):
    """A saved checkpoint with its config (kept in the safetensors metadata) or tensors edited."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    q, _ = _quantized(fmt, False)
    path = save_real(fake2real(q), tmp_path / "ckpt")
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    if edit_config is not None:
        cfg = json.loads(meta["modelopt_lite"])
        edit_config(cfg["modules"]["0"])
        meta["modelopt_lite"] = json.dumps(cfg)
    if edit_tensors is not None:
        edit_tensors(tensors)
    save_crafted_real(path, tensors, meta)
    return path


def test_load_rejects_bad_spec(tmp_path):
    path = _corrupt(tmp_path, "nvfp4", edit_config=lambda s: s["weight"].update(block=8))
    with pytest.raises(ValueError, match=r"modules\['0'\]\.weight: block must be one of \(16, 32\) for nvfp4, got 8"):
        load_real(_model(), path)


def test_load_rejects_nan_block_scale(tmp_path):
    def nan_scale(t):
        t["0.weight_block_scale"][0, 0] = 0x7F  # E4M3 NaN

    path = _corrupt(tmp_path, "nvfp4", edit_tensors=nan_scale)
    with pytest.raises(ValueError, match=r"0\.weight_block_scale: E4M3 block scales must be finite and >= 0, got nan"):
        load_real(_model(), path)


def test_load_rejects_e8m0_nan(tmp_path):
    def nan_scale(t):
        t["0.weight_block_scale"][1, 1] = 255

    path = _corrupt(tmp_path, "mxfp4", edit_tensors=nan_scale)
    with pytest.raises(ValueError, match=r"0\.weight_block_scale: E8M0 scales must not be 255 \(NaN\), got 255"):
        load_real(_model(), path)
