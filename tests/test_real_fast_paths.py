"""The GPU-first real paths on the CPU: FP8 ``_scaled_mm``, INT8 ``_int_mm`` (16-bit), ``int4pack``, ``int8pack``.

Activation codes equal the fake-quant model's bit for bit; outputs agree within ``fast_gemm.lowp_error_bound``."""

import pytest
import torch
from fast_real_helpers import assert_within, fake_mlp, fp8_cfg, inputs, int4_cfg, int8_weight_only_cfg

import modelopt_lite as mtl
from modelopt_lite.formats import e4m3_codes
from modelopt_lite.functional import library
from modelopt_lite.functional.scales import scale_from_amax
from modelopt_lite.real import fake2real, fast_gemm, fp8, int4pack

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _layers(fq, real, x):
    """(fake layer, real layer, its input) for both Linear layers, inputs as the fake model sees them."""
    with torch.no_grad():
        h = torch.relu(fq[0](x))
    return [(fq[0], real[0], x), (fq[2], real[2], h)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_axis", [None, 0])
@pytest.mark.parametrize("dynamic", [None, "row", "tensor"])
def test_fp8_scaled_mm_codes_and_outputs(dtype, weight_axis, dynamic):
    fq = fake_mlp(fp8_cfg(weight_axis, dynamic), dtype)
    real = fake2real(fq, inplace=False, backend="scaled_mm")
    x = inputs(64, dtype)
    for f, r, xin in _layers(fq, real, x):
        assert r.weight.dtype == torch.float8_e4m3fn and r.weight_scale.dtype == torch.float32
        assert r.weight_scale.shape == (() if weight_axis is None else (r.out_features,))
        assert fast_gemm.route(r, xin) == "scaled_mm"
        # the codes: the fake quantizer's, bit for bit (true division by a float32 tensor, saturating cast)
        if dynamic is None:
            s = r.input_scale[0]
            codes = fp8.static_codes(xin, s.reshape(1))
            ref = e4m3_codes(xin, s)
        else:
            codes, s = fp8.dynamic_codes(xin, dynamic == "row")
            amax = xin.float().abs().amax(-1 if dynamic == "row" else (0, 1), keepdim=True)
            s_ref = scale_from_amax(amax, 448.0)
            assert torch.equal(s, s_ref)
            ref = e4m3_codes(xin, s_ref)
        assert codes.dtype == torch.float8_e4m3fn
        assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))
        with torch.no_grad():
            assert torch.equal((codes.float() * s).to(dtype), f.input_quantizer(xin))
            a, b = f(xin), r(xin)
        assert_within(a, b, r.error_bound(xin), f"{dtype} axis={weight_axis} dynamic={dynamic}")
    with torch.no_grad():  # end to end (a layer's input may differ by a rounding: loose check)
        a, b = fq(x), real(x)
    assert float((a.float() - b.float()).abs().max()) <= 0.05 * float(a.float().abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_auto_on_cpu_is_the_exact_dequant_path(dtype):
    fq = fake_mlp(fp8_cfg(), dtype)
    real = fake2real(fq, inplace=False)
    x = inputs(64, dtype)
    assert fast_gemm.route(real[0], x) is None and real[0].compute == "dequant"
    with torch.no_grad():
        assert torch.equal(fq(x), real(x))
    half = fake2real(fake_mlp(fp8_cfg(), torch.float32), inplace=False).to(torch.bfloat16)
    assert half[0].weight.dtype == torch.float8_e4m3fn and half[0].weight_scale.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unsigned", [False, True])
def test_int_mm_16bit_codes_and_outputs(dtype, unsigned):
    cfg = mtl.INT8_DEFAULT_CFG
    if unsigned:
        import copy

        cfg = copy.deepcopy(cfg)
        cfg["quant_cfg"]["2.input_quantizer"] = {"unsigned": True}
    fq = fake_mlp(cfg, dtype)
    real = fake2real(fq, inplace=False, backend="int_mm")
    x = inputs(64, dtype)
    for f, r, xin in _layers(fq, real, x):
        assert fast_gemm.route(r, xin) == "int_mm" and r.weight.dtype == torch.int8
        p = fast_gemm.prepared(r, "int_mm", xin)
        assert p["w_t"].stride() == (1, r.in_features)  # column-major second operand, no copy
        assert p["w_t"].data_ptr() == r.weight.data_ptr()
        codes = fast_gemm.int8_codes(xin, p["divisor"], p["qmin"], p["qmax"], p["shift"])
        ref = library.quantize_int(xin, r.current_input_scale(), r._qmin, r._qmax) - p["shift"]
        assert codes.dtype == torch.int8 and torch.equal(codes.float(), ref)
        with torch.no_grad():
            a, b = f(xin), r(xin)
        assert_within(a, b, r.error_bound(xin), f"{dtype} unsigned={unsigned}")


def test_int_mm_float32_keeps_the_exact_integer_path():
    fq = fake_mlp(mtl.INT8_DEFAULT_CFG, torch.float32)
    ref = fake2real(fq, inplace=False, backend="reference")
    real = fake2real(fq, inplace=False, backend="int_mm")
    x = inputs(64, torch.float32)
    assert fast_gemm.route(real[0], x) is None
    with torch.no_grad():
        assert torch.equal(ref(x), real(x))


def _identity_weights(r, dtype):
    """The weight a fast path really multiplies by: ``path(I_K)`` is ``W^T`` exactly (one product per output)."""
    eye = torch.eye(r.in_features, dtype=dtype)
    bias, r.bias = r.bias, None
    try:
        with torch.no_grad():
            return r(eye).t()
    finally:
        r.bias = bias
        r.__dict__.pop("_fast_cache", None)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4pack_layout_and_outputs(group, dtype):
    fq = fake_mlp(int4_cfg(group), dtype, dims=(256, 128, 32))
    real = fake2real(fq, inplace=False, backend="int4pack")
    x = inputs(256, dtype)
    for f, r, xin in _layers(fq, real, x):
        assert fast_gemm.route(r, xin) == "int4pack"
        w_real = _identity_weights(r, dtype)
        with torch.no_grad():
            w_fake = f.weight_quantizer(f.weight)
        if dtype == torch.float32:  # float32 scales: (u - 8) * s + 0 == q * s bit for bit
            assert torch.equal(w_real, w_fake)
        else:  # 16-bit scales: the scale rounds to the dtype first (documented in real/int4pack.py)
            u = torch.finfo(dtype).eps / 2
            assert bool(((w_real.double() - w_fake.double()).abs() <= 3 * u * w_fake.double().abs()).all())
        with torch.no_grad():
            a, b = f(xin), r(xin)
        assert_within(a, b, r.error_bound(xin), f"int4pack g={group} {dtype}")


def test_int4pack_block_256_awq_and_gptq_results():
    for algorithm in ({"method": "awq_lite", "alpha_step": 0.5}, {"method": "gptq"}):
        fq = fake_mlp(int4_cfg(256, algorithm), torch.float32, dims=(256, 256, 32))
        real = fake2real(fq, inplace=False, backend="int4pack")
        assert fast_gemm.route(real[0], inputs(256, torch.float32)) == "int4pack"
        assert torch.equal(_identity_weights(real[0], torch.float32), fq[0].weight_quantizer(fq[0].weight))
        x = inputs(256, torch.float32)
        with torch.no_grad():
            assert_within(fq[0](x), real[0](x), real[0].error_bound(x), str(algorithm))


def test_int4pack_cuda_packing_order_matches_our_codes():
    """The CUDA op takes u8 pairs with element 2j in the HIGH nibble: check the byte layout we hand it."""
    codes = torch.tensor([[-8, 7, 0, -1] * 8] * 16, dtype=torch.int8)
    u = codes.to(torch.int32) + 8
    u8 = u.to(torch.uint8)
    hi_first = (u8[:, ::2] << 4) | u8[:, 1::2]
    assert hi_first[0, 0] == (0 << 4 | 15) and hi_first[0, 1] == (8 << 4 | 7)
    assert int4pack.why_not((16, 32), 32) is None and "multiple of 16" in int4pack.why_not((24, 32), 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [None, 0])
def test_int8pack_weights_and_outputs(dtype, axis):
    fq = fake_mlp(int8_weight_only_cfg(axis), dtype)
    real = fake2real(fq, inplace=False, backend="int8pack")
    x = inputs(64, dtype)
    for f, r, xin in _layers(fq, real, x):
        assert fast_gemm.route(r, xin) == "int8pack"
        if dtype == torch.float32:
            with torch.no_grad():
                assert torch.equal(_identity_weights(r, dtype), f.weight_quantizer(f.weight))
        with torch.no_grad():
            a, b = f(xin), r(xin)
        assert_within(a, b, r.error_bound(xin), f"int8pack {dtype} axis={axis}")


def test_nvfp4_weight_only_dequantizes_into_the_input_dtype():
    fq = fake_mlp(mtl.W4A16_NVFP4_CFG, torch.bfloat16)
    real = fake2real(fq, inplace=False)
    x = inputs(64, torch.bfloat16)
    assert real[0].weight_packed.dtype == torch.uint8 and real[0].dequantized_weight().dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(fq(x), real(x))


def test_lowp_bound_is_a_few_roundings_of_the_dtype():
    t = torch.ones(3, dtype=torch.float64)
    b32 = float(fast_gemm.lowp_error_bound(t, 4096, torch.float32, torch.float32)[0])
    b16 = float(fast_gemm.lowp_error_bound(t, 4096, torch.bfloat16, torch.bfloat16)[0])
    gamma = 4104 * 2.0**-24 / (1 - 4104 * 2.0**-24)
    assert 2 * gamma < b32 < 2 * gamma + 7 * 2.0**-24  # K-term float32 accumulation on both sides
    assert 6 * 2.0**-8 < b16 < 6.2 * 2.0**-8 + 2 * gamma  # six bf16 roundings (operands, scales, outputs)
