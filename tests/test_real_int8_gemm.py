"""The exact integer GEMM backends of modelopt_lite.real.int8_gemm against float64 arithmetic."""

import pytest
import torch
import torch.nn.functional as F

from modelopt_lite.real import int8_gemm as g

# oneDNN's u8 x s8 products are exact with VNNI/AMX ("direct", one call) and saturate int16 pair sums on AVX2-only
# CPUs ("split": two calls on activation parts that cannot saturate). Both modes run on every CPU (forced); only
# whether "direct" must be exact depends on the real CPU (the probe's answer).
CPU_BACKENDS = ["reference", "float_exact", "int_mm"] + (
    ["onednn-direct", "onednn-split"] if g.onednn_available() else []
)
PROBED_MODE = g.onednn_mode()


def _force(backend: str, monkeypatch) -> tuple[str, bool]:
    """The backend name to pass, and whether its result must be exact on this CPU."""
    if not backend.startswith("onednn-"):
        return backend, True
    mode = backend.split("-", 1)[1]
    monkeypatch.setattr(g, "onednn_mode", lambda: mode)
    return "onednn", mode == "split" or PROBED_MODE == "direct"


def _codes(shape, unsigned, gen):
    lo, hi = (0, 256) if unsigned else (-128, 128)
    q = torch.randint(lo, hi, shape, generator=gen).float()
    q.view(-1)[: shape[-1]] = hi - 1  # extreme values present
    return q


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("unsigned", [False, True])
def test_linear_backends_match_exact_integer_product(backend, unsigned, seeded, monkeypatch):
    backend, exact = _force(backend, monkeypatch)
    m, k, n = 37, 300, 29
    q = _codes((m, k), unsigned, seeded)
    w = torch.randint(-128, 128, (n, k), generator=seeded, dtype=torch.int8)
    w[0] = -128  # worst case for saturating u8 x s8 kernels
    w[1] = 127
    sw = torch.rand(n, generator=seeded) * 1e-2 + 1e-4
    sx = torch.tensor(0.0371)
    bias = torch.randn(n, generator=seeded)
    exact_acc = q.double() @ w.double().T
    expected = exact_acc.float() * (sx * sw) + bias
    y = g.LinearKernel(w, sw, backend)(q, sx, bias, unsigned)
    assert y.dtype == torch.float32 and y.shape == (m, n) and bool(torch.isfinite(y).all())
    if not exact:  # "direct" forced on a CPU whose u8 x s8 kernels saturate: the call runs, its values are off
        return
    if backend == "onednn":  # oneDNN folds the scales itself: float rounding only, never an integer error
        bound = 4 * 2.0**-24 * ((q.abs().double() @ w.double().abs().T) * (sx * sw).double() + bias.abs().double())
        assert bool(((y.double() - expected.double()).abs() <= bound).all())
    else:  # same formula, exact accumulator: bit identical
        assert torch.equal(y, expected)


def test_float_exact_chunks_large_k_exactly(seeded):
    k = 5000  # 128 * 127 * 5000 > 2**24: one float32 GEMM could round
    q = torch.full((3, k), -128.0)
    w = torch.full((2, k), -127, dtype=torch.int8)
    w[1, ::2] = 127
    ker = g.LinearKernel(w, torch.ones(2), "float_exact")
    y = ker(q, torch.tensor(1.0), None)
    exact = (q.double() @ w.double().T).float()
    assert torch.equal(y, exact)
    assert len(ker._cache[("chunks", 128)]) == 5  # 128*127 per column -> 1032 columns per chunk


def test_chunks_exact_partition():
    cols = torch.tensor([100.0, 100.0, 100.0])
    assert g._chunks_exact(cols, 2**17) == [(0, 1), (1, 2), (2, 3)]
    assert g._chunks_exact(cols, 1) == [(0, 3)]


@pytest.mark.parametrize("unsigned", [False, True])
def test_split_codes_reconstruct(unsigned):
    q = torch.arange(0, 256).float() if unsigned else torch.arange(-128, 128).float()
    for direct in (True, False):
        parts = g.split_codes(q, unsigned, direct)
        back = sum(u.to(torch.int32) - zp for u, zp in parts)
        assert torch.equal(back, q.to(torch.int32))
        assert all(u.dtype == torch.uint8 for u, _ in parts)
        if not direct:
            assert all(int(u.max()) <= 128 for u, _ in parts)


def test_onednn_mode_is_probed():
    assert g.onednn_mode() in ("direct", "split", "unusable")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("unsigned,groups,stride,dilation", [(False, 1, 1, 1), (True, 2, 2, 1), (False, 4, 1, 2)])
def test_conv_backends_match_exact(backend, unsigned, groups, stride, dilation, seeded, monkeypatch):
    backend, exact = _force(backend, monkeypatch)
    q = _codes((2, 8, 9, 7), unsigned, seeded)
    q = F.pad(q, (1, 1, 1, 1))  # padding is applied by the module (code 0)
    w = torch.randint(-128, 128, (12, 8 // groups, 3, 3), generator=seeded, dtype=torch.int8)
    sw = torch.rand(12, generator=seeded) * 1e-2 + 1e-4
    sx = torch.tensor(0.02)
    bias = torch.randn(12, generator=seeded)
    ker = g.Conv2dKernel(w, sw, (stride, stride), (dilation, dilation), groups, backend)
    y = ker(q, sx, bias, unsigned)
    acc = F.conv2d(q.double(), w.double(), None, stride, 0, dilation, groups)
    expected = acc.float() * (sx * sw).view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)
    assert y.shape == expected.shape and y.is_contiguous() and bool(torch.isfinite(y).all())
    if not exact:
        return
    if backend == "onednn":
        s = F.conv2d(q.abs().double(), w.double().abs(), None, stride, 0, dilation, groups)
        bound = 4 * 2.0**-24 * (s * (sx * sw).double().view(1, -1, 1, 1) + bias.abs().double().view(1, -1, 1, 1))
        assert bool(((y.double() - expected.double()).abs() <= bound).all())
    else:
        assert torch.equal(y, expected)


def test_bad_backend_and_weight_dtype():
    with pytest.raises(ValueError, match="backend must be one of"):
        g.check_backend("fbgemm")
    with pytest.raises(TypeError, match="int8 weight codes"):
        g.LinearKernel(torch.zeros(2, 2), torch.ones(2))
