"""The fast real paths' contract: exact aten op lists per forward (no host sync), backend refusals naming the
module, checkpoints round-tripping every new layout, the validate opt-in."""

import pytest
import torch
from fast_real_helpers import OpCounter, fake_mlp, fp8_cfg, inputs, int4_cfg, int8_weight_only_cfg
from state_files import save_crafted_real

import modelopt_lite as mtl
from modelopt_lite.real import fake2real, load_real, read_checkpoint
from modelopt_lite.real.convert import set_validate

#: aten ops of one Linear forward per path (views excluded), bf16 input with a bias
EXPECTED = {
    "fp8 static": ["div", "clamp_", "_to_copy", "_scaled_mm"],
    "fp8 static, channel weights": ["div", "clamp_", "_to_copy", "_scaled_mm"],
    "fp8 dynamic row": ["linalg_vector_norm", "threshold", "div", "div", "nan_to_num", "_to_copy", "_scaled_mm"],
    "int_mm": ["div", "round_", "clamp_", "_to_copy", "_int_mm", "empty", "addcmul"],
    "int4pack": ["_weight_int4pack_mm_for_cpu", "add"],
    "int8pack": ["_weight_int8pack_mm", "add"],
}


def _model(case):
    if case.startswith("fp8"):
        cfg = fp8_cfg(0 if "channel" in case else None, "row" if "dynamic" in case else None)
        return fake_mlp(cfg), "scaled_mm", 64
    if case == "int_mm":
        return fake_mlp(mtl.INT8_DEFAULT_CFG), "int_mm", 64
    if case == "int4pack":
        return fake_mlp(int4_cfg(32), dims=(256, 128, 32)), "int4pack", 256
    return fake_mlp(int8_weight_only_cfg()), "int8pack", 64


@pytest.mark.parametrize("case", list(EXPECTED))
def test_forward_op_list_and_no_host_sync(case):
    fq, backend, k = _model(case)
    lin = fake2real(fq, inplace=False, backend=backend)[0]
    x = inputs(k, torch.bfloat16)
    with torch.no_grad():
        lin(x)  # first call prepares (packs, folds scales) once
        with OpCounter() as c:
            y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], lin.out_features)
    assert c.ops == EXPECTED[case]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_first_forward_makes_no_host_sync(case):
    """The first call prepares the weight side (packing, scale products, a dead static scale's +Inf divisor) on the
    device: no value is read back to the host either (the FP8 dead-scale check used to read one per device/dtype)."""
    fq, backend, k = _model(case)
    lin = fake2real(fq, inplace=False, backend=backend)[0]
    x = inputs(k, torch.bfloat16)
    with torch.no_grad(), OpCounter() as c:
        y = lin(x)
    assert y.shape == (x.shape[0], lin.out_features) and EXPECTED[case][0] in c.ops


def test_fp8_dead_static_scale_without_host_read():
    """A static input scale of 0 (an input calibrated on zeros): codes +-0, output the bias, no host read."""
    fq, backend, k = _model("fp8 static")
    lin = fake2real(fq, inplace=False, backend=backend)[0]
    with torch.no_grad():
        lin.input_scale.zero_()
        x = inputs(k, torch.bfloat16)
        with OpCounter():
            y = lin(x)
    assert torch.equal(y, lin.bias.to(torch.bfloat16).expand_as(y))


def test_op_counter_fails_on_a_host_sync():
    with pytest.raises(AssertionError, match="host synchronization"), OpCounter():
        bool(torch.ones(2).sum() > 0)


@pytest.mark.parametrize(
    "cfg,backend,match",
    [
        (mtl.INT8_DEFAULT_CFG, "scaled_mm", r"module '0' \(INT8 weights, INT8 activations\): backend 'scaled_mm'.*FP8"),
        (fp8_cfg(), "int4pack", r"module '0' \(FP8 E4M3 weights, E4M3 activations\): backend 'int4pack'"),
        (fp8_cfg(), "onednn", r"FP8 E4M3 weights have no integer GEMM"),
        (mtl.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "int4pack", r"in_features=64 is not a multiple of its block size 128"),
        (mtl.W4A8_CFG, "int8pack", r"'int8pack' needs a Linear with INT8 .* no input quantizer"),
    ],
)
def test_forced_backend_refuses_modules_it_cannot_compute(cfg, backend, match):
    fq = fake_mlp(cfg)
    with pytest.raises(ValueError, match=match):
        fake2real(fq, backend=backend)
    assert type(fq[0]).__name__ == "QuantLinear"  # nothing converted


@pytest.mark.parametrize(
    "case", ["fp8 static", "fp8 static, channel weights", "fp8 dynamic row", "int4pack", "int8pack", "int_mm"]
)
def test_checkpoint_round_trip_of_every_layout(case, tmp_path):
    fq, backend, k = _model(case)
    real = fake2real(fq, tmp_path, backend=backend)
    _, tensors = read_checkpoint(tmp_path)
    if case.startswith("fp8"):
        assert tensors["0.weight"].dtype == torch.float8_e4m3fn
        assert ("0.input_scale" in tensors) == ("dynamic" not in case)
    base = torch.nn.Sequential(
        torch.nn.Linear(k, real[0].out_features), torch.nn.ReLU(), torch.nn.Linear(real[0].out_features, 32)
    ).to(torch.bfloat16)
    loaded = load_real(base, tmp_path, backend=backend)
    assert loaded[0].spec == real[0].spec and loaded[0].label == "0"
    for key, t in real.state_dict().items():
        u = loaded.state_dict()[key]
        bits = (lambda v: v.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (lambda v: v)
        assert u.dtype == t.dtype and torch.equal(bits(u), bits(t)), key
    x = inputs(k, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(real(x), loaded(x))


def test_corrupt_fp8_checkpoint_values_are_named(tmp_path):
    from safetensors.torch import load_file

    fake2real(fake_mlp(fp8_cfg()), tmp_path, backend="scaled_mm")
    f = tmp_path / "model_int8.safetensors"
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata()
    t = load_file(str(f))
    t["0.weight"].view(torch.uint8)[3, 5] = 0x7F  # E4M3 NaN
    save_crafted_real(f, t, meta)
    base = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    with pytest.raises(ValueError, match=r"0\.weight: E4M3 weight codes must be finite"):
        load_real(base.to(torch.bfloat16), tmp_path)
    t["0.weight"].view(torch.uint8)[3, 5] = 0
    t["0.input_scale"][0] = -1.0
    save_crafted_real(f, t, meta)
    with pytest.raises(ValueError, match=r"0\.input_scale: input scales must be finite and >= 0"):
        load_real(base, tmp_path)


def test_load_real_refuses_a_backend_by_name(tmp_path):
    fake2real(fake_mlp(mtl.INT8_DEFAULT_CFG), tmp_path)
    base = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    with pytest.raises(ValueError, match=r"load_real: module '0' \(INT8 weights, INT8 activations\).*scaled_mm"):
        load_real(base.to(torch.bfloat16), tmp_path, backend="scaled_mm")


def test_validate_is_an_opt_in_nan_scan():
    real = fake2real(fake_mlp(fp8_cfg()), inplace=False, backend="scaled_mm")
    x = inputs(64, torch.bfloat16)
    x[0, 0] = float("nan")
    with torch.no_grad():
        assert bool(torch.isnan(real(x)[0]).all())  # static FP8: NaN codes propagate, no scan
        set_validate(real)
        with pytest.raises(ValueError, match=r"QuantizedLinear '0': the input contains NaN or Inf"):
            real(x)
    checked = fake2real(fake_mlp(fp8_cfg()), inplace=False, validate=True)
    assert checked[0].validate and checked[2].validate
    with pytest.raises(ValueError, match=r"expected a last dim of 64"):
        checked[0](torch.ones(2, 63, dtype=torch.bfloat16))
