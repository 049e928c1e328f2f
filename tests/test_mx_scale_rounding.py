"""``block_sizes["scale_rounding"]``: the E8M0 scale rule of an MX quantizer ("floor", OCP MX v1.0, or "rceil") as a
config option, end to end: descriptor, fake quant (reference and both native CPU paths), ONNX export (bit exact in
onnx's ReferenceEvaluator), fake2real and its checkpoint, save/restore, summary/repr; and its errors."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator
from onnx_helpers import gemm_weight
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.formats import BLOCK_SCHEMES, block_scheme
from modelopt_lite.functional import backend
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.real import fake2real, load_real, save_real

#: name -> (num_bits, element)
SCHEMES = {"mxfp8": ((4, 3), "e4m3"), "mxfp4": ((2, 1), "e2m1"), "mxint8": (8, "int8")}
ROUNDINGS = ("floor", "rceil")


def _cfg(num_bits, rounding: str | None) -> dict:
    bs = {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}
    if rounding is not None:
        bs["scale_rounding"] = rounding
    return {"num_bits": num_bits, "block_sizes": bs, "axis": None}


def _data(rows: int = 6, cols: int = 96, seed: int = 0) -> torch.Tensor:
    """Random blocks whose amax significand is 1.995 (above every element's "rceil" threshold, 1.5 .. 127/64), so
    the two rules give different scales in every block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 0.5
    x[:, ::32] = 1.995 * 4.0 * torch.where(torch.rand(rows, cols // 32, generator=g) < 0.5, -1.0, 1.0)
    return x * (2.0 ** (torch.arange(rows, dtype=torch.float32) % 6 - 3)).unsqueeze(1)


# --- descriptor and scheme ------------------------------------------------------------------------------------------
def test_default_is_the_schemes_rule_and_the_key_overrides_it():
    assert {s.name: s.rounding for s in BLOCK_SCHEMES.values() if s.kind == "mx"} == {
        "mxfp8": "rceil", "mxfp8_e5m2": "rceil", "mxfp4": "rceil", "mxint8": "floor"
    }  # fmt: skip
    for name, (nb, _) in SCHEMES.items():
        default = BLOCK_SCHEMES[(nb, (8, 0))]
        assert QuantDescriptor(**_cfg(nb, None)).block_scheme is default
        for r in ROUNDINGS:
            s = QuantDescriptor(**_cfg(nb, r)).block_scheme
            assert (s.name, s.kind, s.elem, s.rounding) == (name, "mx", default.elem, r)
            assert block_scheme(nb, _cfg(nb, r)["block_sizes"]) == s


def test_descriptor_equality_hash_and_round_trips():
    a = QuantDescriptor(**_cfg((4, 3), "floor"))
    b = QuantDescriptor(**_cfg((4, 3), "floor"))
    c = QuantDescriptor(**_cfg((4, 3), "rceil"))
    assert a == b and hash(a) == hash(b) and a != c
    assert a.block_sizes["scale_rounding"] == "floor"
    assert QuantDescriptor(**a.dict()) == a
    assert a.dict()["block_sizes"]["scale_rounding"] == "floor"
    pytest.importorskip("yaml")
    assert QuantDescriptor.from_yaml(c.to_yaml()) == c


@pytest.mark.parametrize(
    "cfg, match",
    [
        (_cfg((4, 3), "ceil"), r"scale_rounding'\] must be one of \('floor', 'rceil'\), got 'ceil'"),
        (_cfg(8, "RCEIL"), r"must be one of \('floor', 'rceil'\), got 'RCEIL'"),
        (_cfg((2, 1), 1), r"must be one of \('floor', 'rceil'\), got 1"),
        (
            {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3),
                                                 "scale_rounding": "rceil"}},
            r"scale_rounding'\]='rceil' applies to MX .* NVFP4 has E4M3 block scales",
        ),
        ({"num_bits": 4, "block_sizes": {-1: 32, "scale_rounding": "floor"}}, r"applies to MX blocks only.*num_bits=4"),
        (
            {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_rounding": "floor"}},
            r"applies to MX blocks only.*scale_bits=None",
        ),
    ],
    ids=["unknown", "case", "not_a_string", "nvfp4", "int_blocks", "e4m3_float32_blocks"],
)  # fmt: skip
def test_bad_scale_rounding_raises(cfg, match):
    with pytest.raises(ValueError, match=match):
        QuantDescriptor(**cfg)


def test_bad_scale_rounding_through_quantize_names_the_value():
    model = nn.Sequential(nn.Linear(32, 8))
    cfg = {"quant_cfg": {"*weight_quantizer": _cfg((4, 3), "nearest")}, "algorithm": None}
    with pytest.raises(ValueError, match="got 'nearest'"):
        mtq.quantize(model, cfg)


# --- fake quantization: reference and native kernels ---------------------------------------------------------------
def _expected(x: torch.Tensor, elem: str, rounding: str) -> torch.Tensor:
    return mx.fake_mx(x, elem, 32, rounding)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_quantizer_follows_the_rule_on_the_reference(name, rounding):
    nb, elem = SCHEMES[name]
    x = _data()
    ref = _expected(x, elem, rounding)
    other = _expected(x, elem, "rceil" if rounding == "floor" else "floor")
    assert not torch.equal(ref, other)  # the data tells the rules apart
    q = TensorQuantizer(QuantDescriptor(**_cfg(nb, rounding)))
    with backend.use_backend("reference"):
        y = q(x)
    assert y.dtype == torch.float32 and torch.equal(y, ref)
    k = mx.mx_scale_exponents(x, elem, 32, rounding)
    k_other = mx.mx_scale_exponents(x, elem, 32, "rceil" if rounding == "floor" else "floor")
    assert torch.equal(k - k_other, torch.full_like(k, -1 if rounding == "floor" else 1))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_quantizer_follows_the_rule_on_native_kernels(name, rounding, native, impl):
    nb, elem = SCHEMES[name]
    x = _data(rows=5, cols=160, seed=1)
    ref = _expected(x, elem, rounding)
    q = TensorQuantizer(QuantDescriptor(**_cfg(nb, rounding)))
    with backend.use_backend("native"):
        y = q(x)
        assert torch.equal(native.fake_mx(x, elem, 32, rounding), ref)
    assert torch.equal(y, ref), f"{impl}: {int((y != ref).sum())} elements differ"


def test_gradient_follows_the_rule():
    """A value the "floor" rule saturates (E4M3 significand 1.9 > 1.75) is outside the range: zero gradient; "rceil"
    holds it."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1.9 * 2**8
    grads = {}
    for r in ROUNDINGS:
        xr = x.clone().requires_grad_(True)
        TensorQuantizer(QuantDescriptor(**_cfg((4, 3), r)))(xr).sum().backward()
        grads[r] = float(xr.grad[0, 0])
    assert grads == {"floor": 0.0, "rceil": 1.0}


# --- model level: export, fake2real, save/restore, summary ---------------------------------------------------------
def _quantized(nb, rounding) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40)).eval()
    with torch.no_grad():  # weights whose blocks tell the rules apart
        model[0].weight.copy_(_data(48, 64, seed=2) * 2.0**-4)
    x = _data(8, 64, seed=3)
    fmt = dict(_cfg(nb, rounding), enable=True)
    cfg = {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": fmt, "*input_quantizer": fmt},
           "algorithm": None}  # fmt: skip
    return mtq.quantize(model, cfg), x


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_export_follows_the_rule_bit_exact(tmp_path, name, rounding):
    """The exported weight codes/scales and the in-graph activation quantization equal the quantizers bit for bit
    (onnx ReferenceEvaluator: ORT 1.32 has no FLOAT8E8M0/FLOAT4E2M1 kernels)."""
    nb, elem = SCHEMES[name]
    q, x = _quantized(nb, rounding)
    lin = q[0]
    path = tmp_path / f"{name}_{rounding}.onnx"
    rep = mtq.export_onnx(lin, x, path)
    assert [w["scales"]["rounding"] for w in rep.weights] == [rounding]
    assert [a["scales"]["rounding"] for a in rep.activations] == [rounding]
    m = onnx.load(path)
    gemm, w_name, _ = gemm_weight(m)
    a, w = ReferenceEvaluator(m).run([gemm.input[0], w_name], {m.graph.input[0].name: x.numpy()})
    a, w = torch.from_numpy(a), torch.from_numpy(w)
    with torch.no_grad():
        ref_a, ref_w = lin.input_quantizer(x), lin.weight_quantizer(lin.weight)
    w = w if tuple(w.shape) == tuple(ref_w.shape) else w.T
    assert torch.equal(ref_a, _expected(x, elem, rounding))
    assert torch.equal(ref_w, _expected(lin.weight.detach(), elem, rounding))
    assert torch.equal(a, ref_a) and torch.equal(w, ref_w)
    assert not torch.equal(ref_w, _expected(lin.weight.detach(), elem, "rceil" if rounding == "floor" else "floor"))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_fake2real_and_checkpoint_keep_the_rule(tmp_path, name, rounding):
    nb, _ = SCHEMES[name]
    q, x = _quantized(nb, rounding)
    with torch.no_grad():
        ref = q(x)
        real = fake2real(copy.deepcopy(q))
        assert torch.equal(real(x), ref)
    assert real[0].spec["weight"]["rounding"] == rounding and real[0].spec["input"]["rounding"] == rounding
    path = save_real(real, tmp_path / "ckpt")
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40)).eval()
    loaded = load_real(fresh, path)
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)


def test_real_checkpoint_rejects_a_rounding_on_nvfp4_and_unknown_rules():
    from modelopt_lite.real import microscaling as RM

    base = {"format": "nvfp4", "scheme": "nvfp4", "elem": "e2m1", "block": 16, "rounding": "floor", "num_steps": 1}
    assert RM.check_entry(base, weight=False) is None
    assert "must be 'floor' for nvfp4" in RM.check_entry(dict(base, rounding="rceil"), weight=False)
    mxe = dict(base, format="mx", scheme="mxfp8", elem="e4m3", block=32, rounding="rceil")
    assert RM.check_entry(mxe, weight=False) is None
    assert "rounding must be one of ('floor', 'rceil'), got 'up'" == RM.check_entry(dict(mxe, rounding="up"), False)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_save_restore_keeps_the_rule(tmp_path, rounding):
    q, x = _quantized(8, rounding)  # MXINT8: default "floor"
    mtq.save(q, str(tmp_path / "q.pt"))
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40)).eval()
    other.load_state_dict(q.state_dict(), strict=False)
    mtq.restore(other, str(tmp_path / "q.pt"))
    d = other[0].weight_quantizer.quant_desc
    assert d.block_sizes["scale_rounding"] == rounding and d.block_scheme.rounding == rounding
    with torch.no_grad():
        assert torch.equal(other(x), q(x))


def test_export_info_and_block_helpers_accept_the_key():
    q = TensorQuantizer(QuantDescriptor(**_cfg((2, 1), "floor")))
    q(_data())
    info = q.export_info()
    assert info["kind"] == "mxfp4" and info["block_sizes"] == {1: 32, "type": "dynamic", "scale_bits": (8, 0),
                                                                 "scale_rounding": "floor"}  # fmt: skip


def test_summary_and_repr_show_the_rule_in_effect():
    q, _ = _quantized((4, 3), "floor")
    rows = {r["name"]: r for r in mtq.summary(q)}
    assert rows["0.weight_quantizer"]["granularity"] == "blocks{-1:32} scale=e8m0/floor dynamic"
    assert "mxfp8/floor" in repr(q[0].weight_quantizer)
    default = TensorQuantizer(QuantDescriptor(**_cfg((4, 3), None)))
    assert "mxfp8/rceil" in repr(default)  # the scheme's own rule when the key is absent
