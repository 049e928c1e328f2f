"""SVDQuant (``"algorithm": {"method": "svdquant", "lowrank": r}``): the float low-rank branch, the quantized residual,
the registry and sequence runner, save/restore (ours and ModelOpt's ``mto``), the ONNX export under ONNX Runtime,
and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from state_files import edit_saved_tensors
from torch import nn

import modelopt_lite as mtq
import modelopt_lite.opt as mto
from modelopt_lite.algorithms import add_lowrank, svd_factors
from modelopt_lite.algorithms.svdquant import svdquant
from modelopt_lite.conversion import ALGORITHMS, QuantConfigError
from modelopt_lite.nn import TensorQuantizer

W4 = {"num_bits": 4, "block_sizes": {-1: 16, "type": "static"}, "enable": True}
A8 = {"num_bits": 8, "axis": None, "enable": True}


def cfg(algorithm, weight=W4, inp=None) -> dict:
    inp = inp or {"enable": False}
    return {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": dict(weight), "*input_quantizer": dict(inp)},
            "algorithm": algorithm}  # fmt: skip


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 48), nn.Linear(48, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def outlier_mlp(seed=0) -> MLP:
    """Small weights plus a few large outlier columns (what the low-rank branch is for)."""
    torch.manual_seed(seed)
    m = MLP()
    with torch.no_grad():
        for lin in (m.fc1, m.fc2):
            lin.weight[:, 3] *= 40.0
            lin.weight[:, 17] += 2.0
    return m.eval()


def data(seed=1, n=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 64, generator=g) for _ in range(n)]


def loop_of(batches):
    def loop(m):
        for b in batches:
            m(b)

    return loop


ALG = {"method": "svdquant", "lowrank": 4, "progress": False}


def test_registered_with_modelopt_defaults():
    alg = ALGORITHMS["svdquant"]
    assert {"lowrank", "skip_layers", "alpha_step"} <= alg.params
    assert mtq.NVFP4_SVDQUANT_DEFAULT_CFG["algorithm"] == {"method": "svdquant", "lowrank": 32}
    w = mtq.NVFP4_SVDQUANT_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"]
    assert w["num_bits"] == (2, 1) and w["block_sizes"] == {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}


def test_factors_shape_dtype_and_residual():
    m = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(None))
    w0 = m.fc1.weight.detach().clone()
    add_lowrank(m.fc1, 8, "fc1")
    wq = m.fc1.weight_quantizer
    a, b = wq.svdquant_lora_a, wq.svdquant_lora_b
    assert a.shape == (8, 64) and b.shape == (48, 8) and a.dtype == b.dtype == torch.float32
    # the buffers carry ModelOpt's names (state_dict keys) and the best rank-8 approximation
    assert {"fc1.weight_quantizer._svdquant_lora_a", "fc1.weight_quantizer._svdquant_lora_b"} <= set(m.state_dict())
    u, s, vt = torch.linalg.svd(w0.double(), full_matrices=False)
    assert torch.allclose((b.double() @ a.double()), (u[:, :8] * s[:8]) @ vt[:8], atol=1e-5)
    assert torch.equal(m.fc1.weight, (w0.double() - b.double() @ a.double()).float())
    assert wq.amax is None  # reset: calibrate again


def test_residual_quantized_as_the_reference_and_output_is_branch_plus_fake_quant_path():
    batches = data()
    m = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(ALG, inp=A8), loop_of(batches))
    for lin in (m.fc1, m.fc2):
        wq, iq = lin.weight_quantizer, lin.input_quantizer
        assert wq.has_lowrank and wq.svdquant_lora_a.shape[0] == 4
        # the residual is quantized as a fresh quantizer of the same descriptor max-calibrated on W - B A does
        ref = TensorQuantizer(wq.quant_desc)
        ref.amax = lin.weight.detach().reshape(lin.weight.shape[0], -1, 16).abs().amax(-1)
        assert torch.equal(ref.amax, wq.amax.reshape(ref.amax.shape))
        assert torch.equal(wq(lin.weight), ref(lin.weight))
    x = batches[0]
    h = m.fc1(x)
    iq = m.fc1.input_quantizer
    xs = x if iq.pre_quant_scale is None else x * iq.pre_quant_scale
    a, b = m.fc1.weight_quantizer.svdquant_lora_a, m.fc1.weight_quantizer.svdquant_lora_b
    want = F.linear(iq(x), m.fc1.weight_quantizer(m.fc1.weight), m.fc1.bias) + F.linear(F.linear(xs, a), b)
    assert torch.equal(h, want)


@pytest.mark.parametrize("weight", [W4, {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic",
                                                                               "scale_bits": (4, 3)}, "enable": True}])  # fmt: skip
def test_error_strictly_below_rtn_on_outlier_weights(weight):
    float_model, batches = outlier_mlp(), data()
    x = torch.cat(batches)
    ref = float_model(x).detach()
    rtn = mtq.quantize(copy.deepcopy(float_model), cfg("max", weight), loop_of(batches))
    svd = mtq.quantize(copy.deepcopy(float_model), cfg(ALG, weight), loop_of(batches))
    e_rtn = float((rtn(x).detach() - ref).pow(2).mean())
    e_svd = float((svd(x).detach() - ref).pow(2).mean())
    assert e_svd < 0.5 * e_rtn, (e_svd, e_rtn)


def test_sequence_with_awq_and_gptq():
    float_model, batches = outlier_mlp(), data()
    steps = [{"method": "awq_lite", "progress": False}, ALG, {"method": "gptq"}]
    q = mtq.quantize(copy.deepcopy(float_model), cfg(steps), loop_of(batches))
    alone = mtq.quantize(copy.deepcopy(float_model), cfg(ALG), loop_of(batches))
    assert q.fc1.weight_quantizer.has_lowrank and q.fc2.weight_quantizer.has_lowrank
    assert not torch.equal(q.fc1.weight, alone.fc1.weight)  # GPTQ refit the residual
    x = torch.cat(batches)
    ref = float_model(x).detach()
    rtn = mtq.quantize(copy.deepcopy(float_model), cfg("max"), loop_of(batches))
    assert float((q(x).detach() - ref).pow(2).mean()) < float((rtn(x).detach() - ref).pow(2).mean())


@pytest.mark.parametrize(
    "alg,err,msg",
    [
        ({"method": "svdquant", "lowrank": 0}, QuantConfigError, "lowrank must be an integer >= 1, got 0"),
        ({"method": "svdquant", "lowrank": True}, QuantConfigError, "lowrank must be an integer >= 1, got bool"),
        ({"method": "svdquant", "skip_layers": "fc1"}, QuantConfigError, "skip_layers must be a list"),
        ({"method": "svdquant", "rank": 4}, QuantConfigError, "unknown parameter(s) ['rank']"),
    ],
)
def test_config_errors(alg, err, msg):
    with pytest.raises(err) as e:
        mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(alg), loop_of(data()))
    assert msg in str(e.value)


def test_rank_errors_and_model_left_unchanged():
    float_model = outlier_mlp()
    model = copy.deepcopy(float_model)
    with pytest.raises(ValueError, match=r"fc2: lowrank=40 exceeds min\(out_features, in_features\) = 32"):
        mtq.quantize(model, cfg({"method": "svdquant", "lowrank": 40}), loop_of(data()))
    assert type(model.fc1) is nn.Linear and torch.equal(model.fc1.weight, float_model.fc1.weight)
    q = mtq.quantize(copy.deepcopy(float_model), cfg(None))
    with pytest.raises(ValueError, match=r"fc2.weight: lowrank=33 exceeds min\(out_features, in_features\) = 32"):
        add_lowrank(q.fc2, 33, "fc2")
    with pytest.raises(ValueError, match="lowrank must be an integer >= 1, got 0"):
        add_lowrank(q.fc2, 0, "fc2")
    assert not q.fc2.weight_quantizer.has_lowrank
    with pytest.raises(ValueError, match="must be 2-D"):
        svd_factors(torch.ones(4), 1)


def test_non_linear_modules_are_refused():
    conv = mtq.quantize(nn.Sequential(nn.Conv2d(3, 8, 3)), {"quant_cfg": {"*": {"num_bits": 8}}, "algorithm": None})
    with pytest.raises(TypeError, match="0 is a QuantConv2d; the low-rank branch applies to quantized nn.Linear"):
        add_lowrank(conv[0], 2, "0")
    with pytest.raises(TypeError, match="fc is a Linear; the low-rank branch applies to quantized nn.Linear"):
        add_lowrank(nn.Linear(8, 8), 2, "fc")
    # in a model, quantized non-Linear modules are max-calibrated as usual
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 16))
    q = mtq.quantize(
        model,
        {
            "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8}},
            "algorithm": ALG,
        },  # fmt: skip
        lambda m: m(torch.randn(4, 3, 6, 6)),
    )
    assert q[2].weight_quantizer.has_lowrank and not q[0].weight_quantizer.has_lowrank
    assert q[0].weight_quantizer.amax is not None


def test_skip_layers():
    q = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg({**ALG, "skip_layers": ["fc2"]}, inp=A8), loop_of(data()))
    assert q.fc1.weight_quantizer.has_lowrank and not q.fc2.weight_quantizer.has_lowrank
    assert q.fc2.input_quantizer.pre_quant_scale is None and q.fc2.input_quantizer.amax is not None
    assert q.fc2.weight_quantizer.is_enabled and q.fc2.weight_quantizer.amax is not None


def test_factor_setter_validates():
    q = TensorQuantizer()
    with pytest.raises(TypeError, match="svdquant_lora_a must be a floating-point tensor, got torch.int64"):
        q.svdquant_lora_a = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="svdquant_lora_b must be finite"):
        q.svdquant_lora_b = torch.tensor([[float("nan")]])
    q.svdquant_lora_a = torch.ones(2, 3, dtype=torch.float64)
    assert q.svdquant_lora_a.dtype == torch.float32 and not q.has_lowrank
    q.svdquant_lora_a = None
    assert "_svdquant_lora_a" not in q.state_dict()


def test_factors_are_stored_contiguous_so_the_branch_does_not_depend_on_the_callers_layout():
    model = mtq.quantize(outlier_mlp(), cfg("max"), loop_of(data()))
    x = data(seed=5, n=1)[0]
    u, s, vt = torch.linalg.svd(model.fc1.weight.detach().double(), full_matrices=False)
    a, b = vt[:4].float(), (u[:, :4] * s[:4]).float()
    assert not a.is_contiguous()  # LAPACK's V^T is column-major: a slice of it keeps that layout
    wq = model.fc1.weight_quantizer
    wq.svdquant_lora_a, wq.svdquant_lora_b = a, b
    assert wq.svdquant_lora_a.is_contiguous() and wq.svdquant_lora_a.stride() == (64, 1)
    with torch.no_grad():
        got = model.fc1(x)
        want = F.linear(x, wq(model.fc1.weight), model.fc1.bias) + F.linear(F.linear(x, a.contiguous()), b)
    assert torch.equal(got, want)


def test_save_restore_round_trip(tmp_path):
    float_model, batches = outlier_mlp(), data()
    q = mtq.quantize(copy.deepcopy(float_model), cfg(ALG, inp=A8), loop_of(batches))
    x = torch.cat(batches)
    with pytest.raises(ValueError, match="SVDQuant low-rank factors .* include_weights=True"):
        mtq.save(q, tmp_path / "s")
    mtq.save(q, tmp_path / "s", include_weights=True)
    r = mtq.restore(copy.deepcopy(float_model), tmp_path / "s")
    assert torch.equal(r.fc1.weight_quantizer.svdquant_lora_b, q.fc1.weight_quantizer.svdquant_lora_b)
    assert torch.equal(r(x), q(x))
    # ModelOpt's opt API: the factors travel in the state dict, the state lists them as buffers
    mto.save(q, tmp_path / "m.pth")
    r2 = mto.restore(copy.deepcopy(float_model), tmp_path / "m.pth")
    assert torch.equal(r2.fc2.weight_quantizer.svdquant_lora_a, q.fc2.weight_quantizer.svdquant_lora_a)
    assert torch.equal(r2(x), q(x))


def test_restore_refuses_a_factor_of_the_wrong_shape(tmp_path):
    q = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(ALG), loop_of(data()))
    mtq.save(q, tmp_path / "s", include_weights=True)
    edit_saved_tensors(
        tmp_path / "s.safetensors", lambda t: t.__setitem__("fc1.weight_quantizer._svdquant_lora_a", torch.zeros(4, 63))
    )
    with pytest.raises(ValueError, match=r"_svdquant_lora_a: has shape \(4, 63\), the layer's weight \(48, 64\)"):
        mtq.restore(copy.deepcopy(outlier_mlp()), tmp_path / "s")


def test_integer_requant_is_refused_with_a_branch():
    c = cfg(ALG, weight={"num_bits": 8, "axis": 0}, inp=A8)
    c["quant_cfg"]["*output_quantizer"] = dict(A8)
    q = mtq.quantize(copy.deepcopy(outlier_mlp()), c, loop_of(data()))
    reasons = mtq.set_requant(q, "integer")
    assert "SVDQuant low-rank factors" in reasons["fc1"]


@pytest.mark.onnx
def test_onnx_export_runs_in_ort_within_the_one_step_rule(tmp_path):
    from modelopt_lite.onnx_export import compare_with_onnxruntime, float_rounding_only
    from modelopt_lite.onnx_export.ort_runner import ort_session

    batches = data()
    q = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(ALG, inp=A8), loop_of(batches))
    x = batches[0]
    mtq.export_onnx(q, (x,), tmp_path / "s.onnx")
    import onnx

    g = onnx.load(tmp_path / "s.onnx").graph
    shapes = sorted(tuple(i.dims) for i in g.initializer if len(i.dims) == 2 and 4 in i.dims)
    assert {(4, 32), (4, 48), (48, 4), (64, 4)} <= set(shapes)  # the factors (transposed for MatMul)
    assert sum(n.op_type == "MatMul" for n in g.node) >= 4
    rep = compare_with_onnxruntime(q, tmp_path / "s.onnx", (x,))
    ok, why = float_rounding_only(rep)
    assert ok, why
    sess = ort_session(tmp_path / "s.onnx")
    y = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    assert torch.allclose(y, q(x).detach(), atol=1e-4, rtol=1e-5)


def test_direct_call_on_a_configured_model():
    batches = data()
    q = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(None, inp=A8))
    assert svdquant(q, loop_of(batches), lowrank=3, progress=False) == {"fc1": 3, "fc2": 3}
    assert q.fc1.weight_quantizer.svdquant_lora_b.shape == (48, 3) and q.fc1.input_quantizer.amax is not None


def test_model_calib_entry_point_equals_the_config_route():
    batches = data()
    by_cfg = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(ALG, inp=A8), loop_of(batches))
    q = mtq.quantize(copy.deepcopy(outlier_mlp()), cfg(None, inp=A8))
    out = mtq.model_calib.svdquant(q, loop_of(batches), lowrank=4, progress=False)
    assert out is q
    for name in ("fc1", "fc2"):
        a, b = getattr(by_cfg, name), getattr(q, name)
        assert torch.equal(a.weight, b.weight), name
        assert torch.equal(a.weight_quantizer.svdquant_lora_a, b.weight_quantizer.svdquant_lora_a), name
        assert torch.equal(a.weight_quantizer.amax, b.weight_quantizer.amax), name
    x = batches[0]
    assert torch.equal(by_cfg(x), q(x))
    with pytest.raises(ValueError, match="lowrank"):
        mtq.model_calib.svdquant(q, loop_of(batches), lowrank=0)
