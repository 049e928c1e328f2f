"""Unsigned integer quantization on the native CPU kernels checks the input inside the quantizing pass (issue 24).

The refusal of a negative or NaN input (``check_unsigned_input``: same ValueError, same quoted minimum) comes from
the minimum the kernel folds while it quantizes, on the AVX2 and the scalar side, so no separate ``aten.amin`` pass
reads the input again; the results stay bit-exact with the reference backend, with the unchanged backward. Under
tracing / compiling the plain ops and the separate check (or none) stay as before.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import modelopt_lite.tensor_quant as tq
from modelopt_lite.functional import backend, library
from modelopt_lite.functional.checks import check_unsigned_input

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NAN = float("nan")


class OpLog(TorchDispatchMode):
    """The names of the ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _views(dtype):
    """Non-negative inputs of 2 * 3 * 37 elements (AVX2 steps plus scalar tails): contiguous, transposed, strided."""
    g = torch.Generator().manual_seed(7)
    base = (torch.rand(2, 3, 74, generator=g) * 4).to(dtype)
    base[0, 0, :4] = torch.tensor([0.0, -0.0, 1.5, 3.0])  # signed zero passes; ties at amax / 2
    return {
        "contiguous": base[:, :, :37].contiguous(),
        "transposed": base[:, :, :37].transpose(0, 2),
        "strided": base[:, :, ::2],
    }


def _both(fn, *args):
    with backend.use_backend("reference"):
        ref = fn(*args)
    with backend.use_backend("native"):
        nat = fn(*args)
    return ref, nat


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_path_has_no_separate_min_pass(native, impl, dtype):
    x = _views(dtype)["contiguous"]
    amax_c0 = torch.full((2, 1, 1), 3.0)
    calls = {
        "per_tensor": lambda: tq.fake_tensor_quant(x, torch.tensor(3.0), 8, True),
        "per_channel": lambda: tq.fake_tensor_quant(x, amax_c0, 8, True),
        "real": lambda: tq.tensor_quant(x, torch.tensor(3.0), 8, True),
    }
    for name, call in calls.items():
        with backend.use_backend("native"), OpLog() as log:
            call()
        assert not {"aten.amin", "aten.min", "aten.aminmax"} & set(log.names), (name, log.names)
        want = "modelopt_lite.quantize_uint" if name == "real" else "modelopt_lite.fake_quant_uint"
        assert log.names.count(want) == 1, (name, log.names)
    with backend.use_backend("reference"), OpLog() as log:  # the reference backend keeps the separate check
        tq.fake_tensor_quant(x, 3.0, 8, True)
    assert "aten.amin" in log.names and "modelopt_lite.fake_quant_int" in log.names, log.names


@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_exact_with_reference(native, impl, dtype):
    amaxes = {"tensor": torch.tensor(3.0), "dead": torch.tensor(0.0), "small": torch.tensor(1e-26)}
    for view, x in _views(dtype).items():
        amaxes["axis0"] = torch.tensor([3.0, 0.0] if x.shape[0] == 2 else [1.0] * x.shape[0]).reshape(-1, 1, 1)
        amaxes["last"] = (torch.arange(x.shape[-1], dtype=torch.float32) % 5).reshape(1, 1, -1)  # 0: dead lanes
        for aname, amax in amaxes.items():
            for bits in (4, 8):
                ref, nat = _both(tq.fake_tensor_quant, x, amax, bits, True)
                assert nat.dtype == ref.dtype == dtype and torch.equal(nat, ref), (view, aname, bits)
                (rq, rs), (nq, ns) = _both(tq.tensor_quant, x, amax, bits, True)
                assert nq.dtype == torch.float32 and torch.equal(nq, rq) and torch.equal(ns, rs), (view, aname, bits)


def test_backward_unchanged(native, impl):
    x0 = _views(torch.float32)["strided"] * 1.2  # some values beyond amax: zero gradient there
    g = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    out = []
    for name in ("reference", "native"):
        x = x0.clone().requires_grad_(True)
        amax = torch.tensor(3.0, requires_grad=True)
        with backend.use_backend(name):
            y = tq.fake_tensor_quant(x, amax, 8, True)
            y.backward(g)
        out.append((y.detach(), x.grad, amax.grad))
    for a, b in zip(*out):
        assert torch.equal(a, b)


def _expected_message(x):
    with pytest.raises(ValueError) as e:
        check_unsigned_input(x)
    return str(e.value)


def _bad_inputs(dtype):
    n = 9 * 4096 + 13  # above the 32768-element grain: several threads' ranges, kernel chunks, a scalar tail
    cases = {}
    for where in (5, 20000, n - 1):  # vector lanes of the first thread's range, the second's, the scalar tail
        x = torch.linspace(0, 4, n).to(dtype)
        x[where] = -2.5
        x[(where + 77) % n] = -0.5
        cases[f"negative@{where}"] = (x, "minimum -2.5")
        y = x.abs()
        y[where] = NAN
        cases[f"nan@{where}"] = (y, "contains NaN (minimum nan)")
        z = x.clone()
        z[(where + 31) % n] = NAN  # NaN and negative values: the NaN message, as torch.amin gives
        cases[f"nan_and_negative@{where}"] = (z, "contains NaN (minimum nan)")
    cases["minus_inf"] = (torch.tensor([1.0, -float("inf"), 2.0]).to(dtype), "minimum -inf")
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
def test_refusal_messages_match_the_separate_check(native, impl, dtype):
    for name, (x, quoted) in _bad_inputs(dtype).items():
        expected = _expected_message(x)
        assert quoted in expected
        before = x.clone()
        for amax in (torch.tensor(3.0), torch.tensor(0.0), torch.full((x.shape[0],), 2.0)):  # live, dead, per element
            for call in (tq.fake_tensor_quant, tq.tensor_quant):
                with backend.use_backend("native"), pytest.raises(ValueError) as e:
                    call(x, amax, 8, True)
                assert str(e.value) == expected, (name, call.__name__)
        for view in (x[1::2],):  # strided (staged): holding the bad value or not
            with backend.use_backend("reference"):
                try:
                    ref = tq.fake_tensor_quant(view, 3.0, 8, True)
                except ValueError as err:
                    ref = str(err)
            with backend.use_backend("native"):
                try:
                    nat = tq.fake_tensor_quant(view, 3.0, 8, True)
                except ValueError as err:
                    nat = str(err)
            assert type(nat) is type(ref) and (nat == ref if isinstance(ref, str) else torch.equal(nat, ref)), name
        assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())


def test_kernel_minimum(native, impl):
    g = torch.Generator().manual_seed(11)
    s = torch.tensor(0.25)
    for n in (0, 1, 7, 8, 9, 31, 1024, 1025, 70001):
        x = torch.randn(n, generator=g)
        for fn in (native.fake_quant_int_min, native.quantize_int_min):
            y, m = fn(x, s, 0, 255)
            plain = native.fake_quant_int if fn is native.fake_quant_int_min else native.quantize_int
            assert torch.equal(y, plain(x, s, 0, 255))
            assert m == (x.min().item() if n else float("inf")), (n, m)
        if n:
            x[n // 2] = NAN
            _, m = native.fake_quant_int_min(x, s, 0, 255)
            assert m != m, n


def test_traced_and_compiled_calls_keep_the_plain_op(native, monkeypatch):
    x = _views(torch.float32)["contiguous"]
    assert library.fuses_unsigned_check(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not library.fuses_unsigned_check(x)
    with backend.use_backend("native"), OpLog() as log:
        tq.fake_tensor_quant(x, 3.0, 8, True)
    assert "modelopt_lite.fake_quant_int" in log.names and "modelopt_lite.fake_quant_uint" not in log.names
    assert "aten.amin" not in log.names  # as before: no data-dependent check while compiling
    monkeypatch.undo()
    with backend.use_backend("reference"):
        assert not library.fuses_unsigned_check(x)
