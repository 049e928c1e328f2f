"""The CUDA bindings (modelopt_lite/csrc/quant_cuda_binding.cpp, mx_cuda_binding.cpp) built for the CPU, against
the reference.

With ``MODELOPT_LITE_EMULATE_ON_HOST`` the bindings take CPU tensors and the launchers of quant_kernels.cu and
mx_kernels.cu run the kernel bodies on the host, so their validation, error raising (binding_errors.h), broadcast
description, dtype handling and dispatch run here exactly as on a GPU, over the whole matrices of
tests/gpu/cuda_cases.py and tests/gpu/mx_cases.py (forward, backward through the public autograd ops, errors). The
build (torch/extension.h, ~1 min on 2 idle cores) is opt-in: set ``MODELOPT_LITE_TEST_EMULATED=1``. Needs the CUDA
headers (cuda_fp8.h), not a GPU. The same switch also parses the real (non-emulated) bindings with ``g++
-fsyntax-only`` against the CPU wheel's c10/cuda headers.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
from emulated_build import CSRC, HERE, OPT_IN, cuda_include

pytestmark = OPT_IN
_cuda_include = cuda_include


def _load(name: str):
    """A module of tests/gpu under its own name (mx_cases imports cuda_cases), loaded once per session."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "gpu" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def emulated():
    import emulated_build

    return emulated_build.build()


cases = _load("cuda_cases")
mx_cases = _load("mx_cases")
mx_error_cases = _load("mx_error_cases")
variant_cases = _load("variant_cases")
block_cases = _load("block_cases")
GROUPS = {
    "int": cases.int_checks,
    "e4m3": cases.e4m3_checks,
    "affine": cases.affine_checks,
    "edge": cases.edge_checks,
    "binding": cases.binding_checks,
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_matrix_equals_reference(emulated, group):
    failures = []
    for check in GROUPS[group]():
        try:
            cases.run_check(emulated, "cpu", check)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_errors(emulated):
    """Every bad-argument case raises its ValueError / TypeError with its message (no crash, no RuntimeError)."""
    lists = (
        cases.error_cases("cpu"),
        cases.device_error_cases("cpu"),
        mx_error_cases.error_cases("cpu"),
        mx_error_cases.value_error_cases("cpu"),
    )
    n = 0
    for call, exc, msg in (case for lst in lists for case in lst):
        with pytest.raises(exc, match=msg) as info:
            call(emulated)
        assert type(info.value) is exc  # not a subclass: the exact builtin type
        assert "Exception raised from" not in str(info.value)  # the message without the C++ backtrace
        n += 1
    assert n == 8 + 3 + 14 + 42


def test_histograms_equal_calibrator_grid(emulated):
    grid = pytest.importorskip("modelopt_lite.calib.grid")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3001, generator=g).abs() * torch.tensor([[1.0], [1e-20], [1e20], [0.0], [7.0]])
    for cap in (2, 2048, 3000):
        exps = grid.needed_exp(a.amax(dim=1), cap)
        assert torch.equal(emulated.histogram_rows(a, exps, cap), grid.histogram_rows(a, exps, cap))
        h = a[[0, 3, 4]].half()
        he = grid.needed_exp(h.float().amax(dim=1), cap)
        assert torch.equal(emulated.histogram_rows(h, he, cap), grid.histogram_rows(h.float(), he, cap))
        m = float(a[0].max())
        want = grid.histogram_rows(a[:1], grid.needed_exp(torch.tensor([m]), cap), cap)[0]
        assert torch.equal(emulated.histogram(a[0], cap, m), want)
    none = torch.full((2, 4099), math.nan)  # values with no bin (NaN, negative, past the top): every count 0
    none[1] = -(torch.arange(4099) % 7) - 0.5
    none[1, ::2] = 1e30
    assert torch.equal(
        emulated.histogram_rows(none, torch.zeros(2, dtype=torch.int64), 2048), torch.zeros(2, 2048).long()
    )


@pytest.mark.parametrize("group", list(mx_cases.GROUPS))
def test_mx_matrix_equals_reference(emulated, group):
    failures = []
    for check in mx_cases.GROUPS[group]():
        try:
            mx_cases.run_check(emulated, "cpu", check)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_unsigned_flagged_bindings_flag_negative_inputs(emulated):
    failures = cases.unsigned_flag_failures(emulated, "cpu")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_mx_flagged_bindings_return_the_flag_unread(emulated):
    failures = mx_error_cases.flagged_failures(emulated, "cpu")
    assert not failures, "\n".join(failures)


def test_scale_from_amax_equals_reference(emulated):
    failures = block_cases.scale_failures(emulated, "cpu")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_mx_every_variant_equals_reference(emulated):
    assert emulated.mx_set_variant(-1) == variant_cases.DEFAULT_VARIANT
    failures = variant_cases.variant_failures(emulated, "cpu")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_mx_gradients_equal_reference(emulated, monkeypatch):
    """The public autograd ops with their forward in the emulated binding (routed as the CUDA kernels, argument
    checks of functional/cuda_args.py included) against the reference backend."""
    from modelopt_lite.functional import backend, library_minifloat, library_mx

    def native(check):
        with monkeypatch.context() as m:
            m.setitem(backend._loaded, "cuda", emulated)
            for lib in (library_mx, library_minifloat):
                m.setattr(lib, "kernels_for", lambda device_type: emulated)
            return check.run("cpu")

    failures = mx_cases.grad_failures(native)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_fused_block_variants_equal_reference(emulated):
    failures = block_cases.variant_failures(emulated, "cpu")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("group", list(block_cases.GROUPS))
def test_fused_block_matrix_equals_reference(emulated, group):
    failures = []
    checks = block_cases.GROUPS[group]()
    for check in checks:
        try:
            block_cases.run_check(emulated, "cpu", check)
        except AssertionError as e:
            failures.append(str(e))
    assert len(checks) > 100
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_fused_block_flags_nonfinite(emulated):
    failures = block_cases.flag_failures(emulated, "cpu")
    assert not failures, "\n".join(failures)


@pytest.fixture
def fused_on_cpu(emulated, monkeypatch):
    """The public API routed to the emulated fused kernel for CPU tensors, as it routes CUDA tensors on a GPU."""
    from modelopt_lite.functional import library_block_cuda

    monkeypatch.setattr(library_block_cuda, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(library_block_cuda, "kernels_for", lambda device_type: emulated)
    monkeypatch.setattr(library_block_cuda, "is_native_cuda", lambda mod: mod is emulated)
    return library_block_cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_sizes", "num_bits", "narrow"),
    [
        ({-1: 128}, 4, False),
        ({-1: 16, "type": "dynamic"}, 8, True),
        ({"-1": 32}, (4, 3), False),
        ({2: 64}, 4, False),
        ({-1: 16, "scale_bits": 8}, 4, False),  # double quantization: unsigned 8-bit scale codes
        ({-1: 32, "type": "dynamic", "scale_bits": (4, 3)}, (4, 3), False),  # E4M3 scale codes
    ],
)
def test_public_fake_block_quant_fused_equals_unfused(fused_on_cpu, monkeypatch, dtype, block_sizes, num_bits, narrow):
    """tensor_quant.fake_block_quant (dynamic amax): routed to the fused op, output and x's gradient equal the
    unfused composition (block_amax, scale_from_amax, the integer / E4M3 op) bit for bit."""

    x0 = block_cases._data((3, 2, 200), dtype, 1)
    assert fused_on_cpu.fused_dynamic_args(x0, block_sizes, None, num_bits, False, narrow) is not None
    calls = _fused_equals_unfused(
        fused_on_cpu, monkeypatch, "fake_block_dynamic", x0, block_sizes, None, num_bits, narrow
    )
    assert len(calls) == 1


def _fused_equals_unfused(fused_on_cpu, monkeypatch, op: str, x0, block_sizes, amax, num_bits, narrow) -> list:
    """fake_block_quant(x0, ...) and x0's gradient on the fused path (the calls of op, returned) against the reference
    backend's unfused composition, bit for bit."""
    from modelopt_lite import tensor_quant as tq
    from modelopt_lite.functional import backend

    calls: list = []
    real = getattr(fused_on_cpu, op)
    monkeypatch.setattr(fused_on_cpu, op, lambda *a: calls.append(a) or real(*a))

    def run(x):
        x = x.clone().requires_grad_()
        y = tq.fake_block_quant(x, block_sizes, amax, num_bits, False, narrow)
        y.backward(block_cases._grad(y.detach()))
        return y.detach(), x.grad

    got = run(x0)
    n = len(calls)
    with backend.use_backend("reference"), monkeypatch.context() as m:
        m.setattr(fused_on_cpu, "FUSED_DEVICE_TYPES", ("cuda",))
        want = run(x0)
    assert len(calls) == n  # the unfused run made no call
    cases.assert_same(got, want, f"fused public fake_block_quant {block_sizes} {num_bits} {x0.dtype} {op}")
    return calls


def test_fused_routing_leaves_the_other_cases_alone(fused_on_cpu):
    """Per-tensor double quantization with integer or E4M3 scale codes is fused; static amax, grouped double
    quantization, E5M2 scale codes, unsigned, other blocked axes, E5M2/E2M1 and unsupported block sizes keep the
    unfused path."""
    x = torch.randn(4, 64)
    route = fused_on_cpu.fused_dynamic_args
    assert route(x, {-1: 16}, None, 4, False, False) == (16, 7.0, -8, 7, False, 0, 0.0, 0)
    assert route(x, {-1: 16}, None, (4, 3), False, False) == (16, 448.0, -448, 448, True, 0, 0.0, 0)
    assert route(x, {-1: 16, "scale_bits": 8}, None, 4, False, False) == (16, 7.0, -8, 7, False, 1, 255.0, 255)
    assert route(x, {-1: 16, "scale_bits": (4, 3)}, None, 4, False, True) == (16, 7.0, -7, 7, False, 2, 448.0, 0)
    assert route(x, {-1: 16, "scale_bits": 8, "scale_block_sizes": {-1: 2}}, None, 4, False, False) is None
    assert route(x, {-1: 16, "scale_bits": (5, 2)}, None, 4, False, False) is None
    assert route(x, {-1: 16}, torch.ones(4, 4), 4, False, False) is None
    assert route(x, {-1: 16}, None, 4, True, False) is None
    assert route(x, {0: 2, -1: 16}, None, 4, False, False) is None
    assert route(x, {-1: 16}, None, (5, 2), False, False) is None
    assert route(x, {-1: 12}, None, 4, False, False) is None  # 3 vectors per block: not a power of two
    assert route(x.half(), {-1: 4}, None, 4, False, False) is None  # half a 16-byte vector


def test_fused_dynamic_nonfinite_raises_the_reference_error(fused_on_cpu):
    from modelopt_lite.descriptor import QuantDescriptor
    from modelopt_lite.nn import TensorQuantizer

    q = TensorQuantizer(QuantDescriptor(num_bits=8, block_sizes={-1: 16, "type": "dynamic"}))
    x = torch.ones(2, 40)
    x[1, 33] = math.nan
    with pytest.raises(
        ValueError, match=r"TensorQuantizer.*NaN or Inf, so its block amax is not finite .block \(1, 2\)"
    ):
        q(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_sizes", "num_bits", "narrow"),
    [({-1: 128}, 4, False), ({-1: 16, "type": "dynamic"}, 8, True), ({"-1": 32}, (4, 3), False), ({2: 64}, 4, False)],
)
def test_public_fake_block_quant_static_fused_equals_unfused(
    fused_on_cpu, monkeypatch, dtype, block_sizes, num_bits, narrow
):
    """tensor_quant.fake_block_quant with a static block amax (float32 or not): routed to fake_block_static once,
    output and x's gradient equal the unfused composition (the amax check, scale_from_amax, the integer / E4M3 op)
    bit for bit, NaN / Inf of x passing through; the caller's amax is untouched."""
    x0 = block_cases._data((3, 2, 200), dtype, 1)
    amax = block_cases.static_amax(x0, block_sizes.get(-1) or block_sizes.get("-1") or block_sizes[2])
    x0 = block_cases._with_nonfinite(x0)
    amax_in = amax.clamp(max=torch.finfo(dtype).max).to(dtype)  # an amax in x's dtype is converted to float32
    keep = amax_in.clone()
    assert fused_on_cpu.fused_static_args(x0, block_sizes, amax_in, num_bits, False, narrow) is not None
    calls = _fused_equals_unfused(
        fused_on_cpu, monkeypatch, "fake_block_static", x0, block_sizes, amax_in, num_bits, narrow
    )
    assert len(calls) == 1 and calls[0][1].dtype == torch.float32
    assert torch.equal(amax_in, keep)


def test_fused_static_routing_leaves_the_other_cases_alone(fused_on_cpu, monkeypatch):
    """Only a block amax of the blocks' exact shape, on x's device, needing no gradient, with last-axis blocks,
    signed integer or E4M3 elements and no double quantization takes the fused static op."""
    x = torch.randn(4, 64)
    route = fused_on_cpu.fused_static_args
    a = torch.rand(4, 4)
    got = route(x, {-1: 16}, a, 4, False, False)
    assert got[0].data_ptr() == a.data_ptr() and got[1:] == (16, 7.0, -8, 7, False)  # float32: not copied
    assert route(x, {-1: 16}, a, (4, 3), False, True)[1:] == (16, 448.0, -448, 448, True)
    half = route(x, {-1: 16}, a.half(), 8, False, True)
    assert half[0].dtype == torch.float32 and half[1:] == (16, 127.0, -127, 127, False)
    assert route(x, {-1: 16}, None, 4, False, False) is None  # dynamic: fused_dynamic_args
    assert route(x, {-1: 16}, a, 4, True, False) is None  # unsigned: the input check
    assert route(x, {-1: 16}, a.requires_grad_(), 4, False, False) is None  # a learnable amax
    a = a.detach()
    with torch.no_grad():
        assert route(x, {-1: 16}, a.clone().requires_grad_(), 4, False, False) is not None  # no gradient asked
    assert route(x, {-1: 16}, a.reshape(16, 1), 4, False, False) is None  # ModelOpt's flat layout: unfused
    assert route(x, {-1: 16}, torch.tensor(3.0), 4, False, False) is None  # one amax for all blocks
    assert route(x, {-1: 16}, a.int(), 4, False, False) is None  # the unfused path's TypeError
    assert route(x, {-1: 16, "scale_bits": 8}, a, 4, False, False) is None
    assert route(x, {0: 2, -1: 16}, a, 4, False, False) is None
    assert route(x, {-1: 16}, a, (5, 2), False, False) is None
    assert route(x, {-1: 12}, torch.rand(4, 6), 4, False, False) is None  # 3 vectors per block
    with monkeypatch.context() as m:  # torch.export (the dynamo ONNX exporter): the unfused ops it translates
        m.setattr(torch.compiler, "is_exporting", lambda: True)
        assert route(x, {-1: 16}, a, 4, False, False) is None
    traced = []
    torch.jit.trace(lambda t: traced.append(route(t, {-1: 16}, a, 4, False, False)) or t * 2, (x,), check_trace=False)
    assert traced == [None]  # the TorchScript ONNX exporter likewise


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_fused_static_bad_amax_raises_the_unfused_error(fused_on_cpu, monkeypatch, bad):
    """A NaN, Inf or negative static block amax: the fused op raises the unfused path's ValueError (the kernel's
    flag, read at once on the CPU, then checks.check_amax_values' message with the first bad value)."""
    from modelopt_lite import tensor_quant as tq

    x = torch.randn(2, 70)
    amax = torch.rand(2, 3) + 0.5
    amax[1, 2] = bad
    calls = []
    real = fused_on_cpu.fake_block_static
    monkeypatch.setattr(fused_on_cpu, "fake_block_static", lambda *a: calls.append(a) or real(*a))
    msgs = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(fused_on_cpu, "FUSED_DEVICE_TYPES", ("cuda",))
            with pytest.raises(ValueError, match=r"block amax must be finite and >= 0, got") as e:
                tq.fake_block_quant(x, {-1: 32}, amax, 4)
            msgs.append(str(e.value))
    assert len(calls) == 1 and msgs[0] == msgs[1] and repr(bad) in msgs[0]


@pytest.mark.parametrize(
    "source", ["quant_cuda_binding.cpp", "mx_cuda_binding.cpp", "block_cuda_binding.cpp", "real_cuda_binding.cpp"]
)
def test_real_binding_parses(source, tmp_path):
    """The non-emulated binding (CUDAGuard, getCurrentCUDAStream, cudaGetErrorString) is valid C++ against this
    torch's headers: g++ -fsyntax-only (it is compiled and run only on a GPU host)."""
    inc = _cuda_include()
    gxx = shutil.which("g++") or shutil.which("c++")
    if inc is None or gxx is None:
        pytest.skip("needs g++ and the CUDA headers")
    from torch.utils import cpp_extension

    system = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(inc)]
    flags = [f for p in system for f in ("-isystem", p)]  # as cpp_extension does: warnings of ours only
    # the CPU wheel ships c10/cuda without its generated cuda_cmake_macros.h: a stand-in (the wheel's own wins)
    (tmp_path / "c10" / "cuda" / "impl").mkdir(parents=True)
    (tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    flags += ["-idirafter", str(tmp_path)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cmd = [gxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", abi, "-DTORCH_EXTENSION_NAME=parse_only", *flags]
    proc = subprocess.run([*cmd, str(CSRC / source)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr, proc.stderr[-3000:]  # -Wall, on our sources only (torch's: -isystem)
