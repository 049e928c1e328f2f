"""requant="integer": quantized Linear/Conv layers compute their quantized outputs as ONNX Runtime's fused int8
kernels (QLinearConv, QGemm) do, so torch and the target="onnxruntime" export agree bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.conversion import QuantConfigError
from modelopt_lite.functional import requant as R
from modelopt_lite.nn.modules._integer_requant import unfit_reason

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from modelopt_lite.onnx_export import export_onnx
from modelopt_lite.onnx_export.ort_layout import host_has_vnni
from modelopt_lite.onnx_export.ort_runner import ort_session

# 8-bit weights are stored as uint8 (ORT's u8 x u8 kernels), 7-bit ones as int8 (u8 x s8): both exact on every CPU
CONFIGS = {"uint8": mtq.INT8_ORT_CFG, "int8": mtq.INT8_ORT_REDUCED_RANGE_CFG}


def _calibrated(model, x, config=None):
    q = copy.deepcopy(model)
    mtq.quantize(q, config or mtq.INT8_ORT_CFG, lambda m: [m(b) for b in x.split(16)])
    return q.eval()


def _weight_dtypes(rep) -> set[str]:
    return {k.split()[1] for k in rep.qdq_counts if k.startswith("DequantizeLinear") and "per-channel" in k} - {"INT32"}


def _ort(q, x, path, **kw):
    rep = export_onnx(
        q,
        x[:2],
        path,
        target="onnxruntime",
        input_names=["input"],
        dynamic_axes={"input": {0: "batch"}},
        **kw,
    )
    sess = ort_session(path, optimized_model_path=str(path) + ".opt")
    ops = [n.op_type for n in onnx.load(str(path) + ".opt").graph.node]
    return torch.from_numpy(sess.run(None, {"input": x.numpy()})[0]), rep, ops


def test_reference_formula_by_hand():
    sx, sw, sy = torch.tensor(0.5), torch.tensor([0.25, 1.0]), torch.tensor(2.0)
    assert torch.equal(R.bias_scale(sx, sw), torch.tensor([0.125, 0.5]))
    assert torch.equal(
        R.bias_codes(torch.tensor([0.1875, -0.75]), R.bias_scale(sx, sw)),  # 1.5 -> 2, -1.5 -> -2
        torch.tensor([2.0, -2.0], dtype=torch.float64),
    )
    m = R.multiplier(sx, sw, sy)
    assert torch.equal(m, torch.tensor([0.0625, 0.25]))
    acc = torch.tensor([[40.0, 10.0], [-24.0, 1000.0]], dtype=torch.float64)  # 2.5 -> 2, 2.5 -> 2, -1.5 -> -2, 250
    assert torch.equal(R.requantize(acc, m, 0, -128, 127), torch.tensor([[2.0, 2.0], [-2.0, 127.0]]))
    assert torch.equal(R.requantize(acc, m, 128, 0, 255), torch.tensor([[130.0, 130.0], [126.0, 255.0]]))
    assert R.bias_codes(torch.tensor([1e30]), torch.tensor([1e-10])).item() == 2**31 - 1  # saturates to int32


@pytest.mark.parametrize("weights", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(4))
def test_random_linear_layers_match_onnxruntime_bit_for_bit(tmp_path, seed, weights):
    g = torch.Generator().manual_seed(seed)
    k, n = [(7, 3), (64, 33), (300, 17), (129, 128)][seed]
    model = nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 if p.dim() == 1 else 0.3))  # large biases too
    x = torch.randn(96, k, generator=g) * 2
    q = _calibrated(model, x, CONFIGS[weights])
    got, rep, ops = _ort(q, x, tmp_path / "l.onnx")
    assert ops.count("QGemm") == 2 and _weight_dtypes(rep) == {weights.upper()}
    with torch.no_grad():
        want = q(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "conv_kw",
    [
        {"kernel_size": 3, "padding": 1},
        {"kernel_size": 3, "stride": 2, "padding": 1},
        {"kernel_size": 1},
        {"kernel_size": 3, "padding": 1, "groups": 2},
    ],
)
@pytest.mark.parametrize("weights", sorted(CONFIGS))
def test_random_conv_layers_match_onnxruntime_bit_for_bit(tmp_path, conv_kw, weights):
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(4, 8, **conv_kw), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.LazyLinear(5)
    )
    x = torch.randn(48, 4, 9, 7)
    model(x)  # materialize the lazy head
    q = _calibrated(model, x, CONFIGS[weights])
    got, rep, ops = _ort(q, x, tmp_path / "c.onnx")
    assert ops.count("QLinearConv") == 2 and ops.count("QGemm") == 1 and _weight_dtypes(rep) == {weights.upper()}
    with torch.no_grad():
        want = q(x)
    assert torch.equal(got, want)
    if weights == "int8":  # ORT's NHWC int8 conv: no transpose back in front of the channels-last Flatten
        assert any("flatten in channels-last order" in n for n in rep.notes), rep.notes
        second = ops.index("QLinearConv", ops.index("QLinearConv") + 1)
        assert "Transpose" not in ops[second : ops.index("QGemm")], ops


def test_flatten_rewrite_keeps_float_flatten_models_exact_and_shared_grids_clip(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(32, 1, 6, 6)
    q = _calibrated(model, x)
    mtq.share_relu_grids(q, lambda m: m(x))
    assert q[0].output_quantizer.amax.item() == q[3].input_quantizer.amax.item()
    got, _, ops = _ort(q, x, tmp_path / "f.onnx")
    assert "Relu" not in ops and "Clip" in ops  # DQ -> Relu -> Flatten -> Q became Clip -> Flatten on codes
    with torch.no_grad():
        assert torch.equal(got, q(x))


def test_auto_mixes_int8_and_uint8_weights_per_layer_and_stays_exact(tmp_path):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 6))
    x = torch.randn(64, 40)
    cfg = copy.deepcopy(mtq.INT8_ORT_CFG)
    cfg["quant_cfg"]["*0.weight_quantizer"] = {"num_bits": 7}  # the first layer 7-bit, the head 8-bit
    q = _calibrated(model, x, cfg)
    assert q[0].weight_quantizer.num_bits == 7 and q[2].weight_quantizer.num_bits == 8
    got, rep, ops = _ort(q, x, tmp_path / "m.onnx")
    assert _weight_dtypes(rep) == {"INT8", "UINT8"} and ops.count("QGemm") == 2
    assert any("(ort_weights='auto'): 1 int8 weight(s)" in n for n in rep.notes), rep.notes
    assert any("(ort_weights='auto'): 1 uint8 weight(s) (codes beyond +-64)" in n for n in rep.notes), rep.notes
    with torch.no_grad():
        assert torch.equal(got, q(x))


def test_full_range_int8_weights_are_a_vnni_only_layout(tmp_path, monkeypatch):
    """ort_weights="int8" with 8-bit weights: the same file whatever the exporting CPU, a warning, and both sessions
    ort_session can choose run on every CPU (the host's VNNI forced each way): the unfused one (Q/DQ as written) is
    exact everywhere; the fused u8 x s8 kernels (kept only on CPUs with VNNI/AMX) match torch bit for bit where the
    real CPU has VNNI/AMX, and elsewhere still give codes on the output grid."""
    from modelopt_lite.onnx_export import ort_layout, ort_runner

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 5))
    x = torch.randn(64, 48)
    q = _calibrated(model, x)
    files = []
    for vnni in (False, True):
        monkeypatch.setattr(ort_layout, "host_has_vnni", lambda vnni=vnni: vnni)
        path = tmp_path / f"v{vnni}.onnx"
        with pytest.warns(UserWarning, match=r"2 int8 weight\(s\) with codes beyond \+-64 .* only on CPUs with VNNI"):
            rep = export_onnx(
                q,
                x[:2],
                path,
                target="onnxruntime",
                ort_weights="int8",
                input_names=["input"],
                dynamic_axes={"input": {0: "batch"}},
            )
        assert _weight_dtypes(rep) == {"INT8"}
        assert any("exact only on CPUs with VNNI or AMX" in n for n in rep.notes), rep.notes
        files.append(path.read_bytes())
    assert files[0] == files[1]
    monkeypatch.undo()
    path = tmp_path / "vTrue.onnx"
    assert len(ort_layout.wide_int8_weights(onnx.load(path))) == 2
    with torch.no_grad():
        want = q(x)
    step = q[2].output_quantizer.amax.float().reshape(()) / torch.tensor(127.0)  # the head's output grid
    for vnni in (False, True):  # ort_session's two choices, each run on every CPU
        monkeypatch.setattr(ort_runner, "host_has_vnni", lambda vnni=vnni: vnni)
        sess = ort_runner.ort_session(path, optimized_model_path=str(path) + f".{vnni}.opt")
        ops = [n.op_type for n in onnx.load(str(path) + f".{vnni}.opt").graph.node]
        got = torch.from_numpy(sess.run(None, {"input": x.numpy()})[0])
        assert got.dtype == torch.float32 and got.shape == (64, 5) and bool(torch.isfinite(got).all())
        codes = torch.round(got / step)  # on the grid: DequantizeLinear wrote float32(code * step)
        assert torch.equal(codes * step, got) and -128 <= codes.min() and codes.max() <= 127, vnni
        if not vnni:  # Q/DQ run as written (float Gemm between them): exact on every CPU up to float rounding
            assert ops.count("QGemm") == 0, ops
            assert bool(((got - want).abs() <= step * 1.0001).all())
            assert (got == want).float().mean() >= 0.99
        else:  # fused: u8 x s8 kernels, exact only with VNNI/AMX (vpmaddubsw saturates int16 pair sums elsewhere)
            assert ops.count("QGemm") == 2, ops
            if host_has_vnni():
                assert torch.equal(got, want)


def test_set_requant_reports_layers_that_keep_the_float_path():
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 4), nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), nn.Linear(4, 4)
    )
    q = copy.deepcopy(model)
    mtq.quantize(q, mtq.INT8_ORT_CFG)
    q[1].output_quantizer.disable()
    q[3].output_quantizer.set_from_attribute_config({"narrow_range": True})
    assert all(m.requant == "integer" for m in (q[0], q[1], q[2], q[3]))
    assert mtq.set_requant(q, "integer") == {
        "0": None,
        "1": "output_quantizer is disabled",
        "2": "padding_mode='reflect' (only 'zeros')",
        "3": "output_quantizer is narrow-range (the int8 kernels saturate to the full range)",
    }
    assert mtq.set_requant(q, "float") == {} and q[0].requant == "float"
    with pytest.raises(ValueError, match=r"requant must be one of \('float', 'integer'\), got 'int'"):
        mtq.set_requant(q, "int")
    with pytest.raises(QuantConfigError, match=r"config\['requant'\] must be one of"):
        mtq.quantize(copy.deepcopy(model), {**mtq.INT8_DEFAULT_CFG, "requant": "exact"})
    assert "requant" not in mtq.INT8_DEFAULT_CFG and mtq.INT8_ORT_CFG["requant"] == "integer"


def _pair():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(256, 64))
    x = torch.randn(128, 256)
    q = _calibrated(model, x)
    f = copy.deepcopy(q)
    mtq.set_requant(f, "float")
    return q, f, x


def test_float_path_runs_where_the_integer_kernel_would_not():
    q, f, x = _pair()
    with torch.no_grad():
        assert not torch.equal(q(x), f(x))  # the two paths differ somewhere on this data
        x3 = x.reshape(4, 32, 256)
        assert torch.equal(q(x3), f(x3))  # a 3-D input exports as MatMul (no fused Gemm): float path
        q[0].output_quantizer.enable_calib()  # calibrating: float path, the output quantizer sees float sums
        assert torch.equal(q(x), f(x))


def test_training_uses_the_integer_value_and_the_float_gradients():
    q, f, x = _pair()
    with torch.no_grad():
        want = q(x)
    q.train(), f.train()
    xq, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    yq, yf = q(xq), f(xf)
    assert torch.equal(yq.detach(), want)
    (yq * torch.arange(64.0)).sum().backward()
    (yf * torch.arange(64.0)).sum().backward()
    assert torch.equal(xq.grad, xf.grad) and torch.equal(q[0].weight.grad, f[0].weight.grad)


def test_training_runs_the_input_quantizer_once_per_forward():
    q, _, x = _pair()
    calls = []
    q[0].input_quantizer.register_forward_hook(lambda *_: calls.append(1))
    q.train()
    q(x.clone().requires_grad_()).sum().backward()
    with torch.no_grad():
        q(x)
    assert len(calls) == 2


def test_requant_survives_save_and_restore(tmp_path):
    q, _, x = _pair()
    mtq.save(q, tmp_path / "s", include_weights=True)
    r = mtq.restore(nn.Sequential(nn.Linear(256, 64)), tmp_path / "s")
    assert r[0].requant == "integer"
    with torch.no_grad():
        assert torch.equal(r(x), q(x))


def test_unfit_reason_for_fp8_and_dynamic():
    lin = mtq.quant_nn.QuantLinear(4, 4)
    lin.output_quantizer.enable()
    assert unfit_reason(lin) is None
    lin.weight_quantizer.set_from_attribute_config({"num_bits": (4, 3)})
    assert unfit_reason(lin).startswith("weight_quantizer is not signed integer")
    lin.input_quantizer.set_from_attribute_config({"dynamic": True})
    assert unfit_reason(lin) == "input_quantizer is dynamic or not fake-quantizing"
