"""The CUDA kernels' math and dispatch, run on the CPU, bit for bit against the pure-torch reference.

``tests/cuda_host/host_harness.cpp`` includes ``modelopt_lite/csrc/quant_kernels.cu`` built with
``MODELOPT_LITE_EMULATE_ON_HOST``: the extern "C" launchers then execute the exact kernel bodies (16-byte vectors,
scalar tails, the per-tensor / per-channel / general index cursors, dtype conversions) in a host loop. What this
cannot check is listed in tests/gpu/README.md (device intrinsics, the launches themselves). Skipped when nvcc is absent.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from modelopt_lite.formats import int_range
from modelopt_lite.functional import reference as ref

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "modelopt_lite" / "csrc"
SOURCES = [
    HERE / "cuda_host" / "host_harness.cpp",
    CSRC / "quant_kernels.cu",
    CSRC / "quant_kernels.cuh",
    CSRC / "quant_index.cuh",
    CSRC / "quant_math.cuh",
    CSRC / "quant_kernels_api.h",
]
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
BITS_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
FWD = {"fake_int": 0, "quantize_int": 1, "fake_e4m3": 2, "fake_affine": 3, "quantize_affine": 4}
BWD = {"int": 0, "e4m3": 1, "affine": 2}
CONFIGS = [(b, u, nr) for b in (2, 3, 4, 5, 7, 8, 11, 16) for u, nr in ((False, False), (False, True), (True, False))]


class Harness:
    def __init__(self, exe: Path, work: Path):
        self.exe, self.work, self.n = exe, work, 0

    def file(self, data=None) -> str:
        self.n += 1
        path = self.work / f"a{self.n}.bin"
        if data is not None:
            if isinstance(data, torch.Tensor):
                data = data.contiguous()
                data = data.view(BITS_VIEW.get(data.dtype, data.dtype)).numpy()
            np.ascontiguousarray(data).tofile(path)
        return str(path)

    def run(self, lines: list[str]) -> list[str]:
        proc = subprocess.run(
            [str(self.exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120, check=True
        )
        out = proc.stdout.splitlines()
        assert len(out) == len(lines), out
        return out


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA host-math harness needs it")
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    exe = Path(tempfile.gettempdir()) / f"modelopt_lite_host_harness_{os.getuid()}_{digest}"
    if not exe.exists():
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run(
            [nvcc, "-std=c++17", "-O2", str(SOURCES[0]), "-o", str(tmp)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "warning" not in proc.stderr.lower(), proc.stderr
        os.replace(tmp, exe)
    return Harness(exe, tmp_path_factory.mktemp("host_math"))


def read(path: str, dtype: torch.dtype, shape) -> torch.Tensor:
    view = BITS_VIEW.get(dtype, dtype)
    np_dtype = {
        torch.int32: np.int32,
        torch.int16: np.int16,
        torch.float32: np.float32,
        torch.int64: np.int64,
        torch.uint64: np.uint64,
    }[view]
    t = torch.from_numpy(np.fromfile(path, dtype=np_dtype).copy()).reshape(shape)
    return t.view(dtype) if view != dtype else t


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape, NaN positions and bit pattern everywhere else (the sign of zero included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(gn, wn), f"{what}: NaN positions differ"
    view = BITS_VIEW[want.dtype]
    bad = (got.contiguous().view(view) != want.contiguous().view(view)) & ~wn
    if bad.any():
        i = bad.flatten().nonzero()[0].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements differ, first at {i}: "
            f"got {got.flatten()[i].item()!r} want {want.flatten()[i].item()!r}"
        )


# --- element math ---------------------------------------------------------------------------------------------------
def edge_inputs(qmin: int, qmax: int, bound: int, seed: int):
    """x, scale, zero point and grad per element: ties, range ends, beyond range, dead/tiny scales, NaN, Inf."""
    g = torch.Generator().manual_seed(seed)
    n = 4096
    pow2 = torch.pow(2.0, torch.randint(-30, 10, (n,), generator=g).float())
    regular = (torch.rand(n, generator=g) * 10 + 1e-3) / bound
    s = torch.where(torch.rand(n, generator=g) < 0.5, pow2, regular).float()
    k = torch.randint(qmin - 3, qmax + 3, (n,), generator=g).float()
    x = torch.empty(n)
    kind = torch.randint(0, 6, (n,), generator=g)
    x = torch.where(kind == 0, (k + 0.5) * s, x)  # exact ties for power-of-two scales
    x = torch.where(kind == 1, k * s, x)  # grid points and range ends
    x = torch.where(kind == 2, torch.randn(n, generator=g) * s * (qmax - qmin), x)
    x = torch.where(kind == 3, torch.nextafter(k * s, torch.full_like(s, math.inf)), x)
    x = torch.where(kind == 4, (torch.randint(-1000, 1000, (n,), generator=g) + 0.5) / 8 * s, x)  # E4M3 ties
    x = torch.where(kind == 5, torch.randn(n, generator=g) * 1e4 * s, x)  # far beyond the range
    s[:64] = 0.0  # dead slices
    s[64:80] = 2.0**-24 / bound * 1.0000001  # smallest live scales
    s[80:96] = float(np.float32(1e30))
    x[96:112] = torch.tensor(
        [
            math.nan,
            -math.nan,
            math.inf,
            -math.inf,
            -0.0,
            0.0,
            1e-45,
            -1e-45,
            3.4e38,
            -3.4e38,
            1e-38,
            -1e-38,
            65504.0,
            65520.0,
            -65520.0,
            0.5,
        ]
    )
    x[0:8] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 1e30])
    zp = torch.randint(qmin, qmax + 1, (n,), generator=g).float()
    grad = torch.randn(n, generator=g)
    grad[200:210] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, 3e38, -3e38, 1.0, -1.0])
    return x.float(), s, zp, grad


@pytest.mark.parametrize("bits,unsigned,narrow", CONFIGS)
def test_element_math_matches_reference(harness, bits, unsigned, narrow):
    bound, qmin, qmax = int_range(bits, unsigned, narrow)
    x, s, zp, g = edge_inputs(qmin, qmax, bound, seed=bits * 4 + 2 * unsigned + narrow)
    out = harness.file()
    cmd = (
        f"elem {x.numel()} {qmin} {qmax} {harness.file(x)} {harness.file(s)} {harness.file(zp)} {harness.file(g)} {out}"
    )
    (res,) = harness.run([cmd])
    assert res == "ok 0"
    cols = read(out, torch.float32, (x.numel(), 12))
    ones = torch.ones_like(x)
    assert_bits(cols[:, 0], ref.fake_quant_int(x, s, qmin, qmax), "fake_quant_int")
    assert_bits(cols[:, 1], ref.quantize_int(x, s, qmin, qmax), "quantize_int")
    assert_bits(cols[:, 2], ref.fake_e4m3(x, s), "fake_e4m3")
    assert_bits(cols[:, 3], ref.fake_affine(x, s, zp, qmin, qmax), "fake_affine")
    assert_bits(cols[:, 4], ref.quantize_affine(x, s, zp, qmin, qmax), "quantize_affine")
    assert_bits(cols[:, 5], ref.int_backward(ones, x, s, qmin, qmax, False)[0], "int STE mask")
    assert_bits(cols[:, 6], ref.int_backward(g, x, s, qmin, qmax, True)[1], "int scale term")
    assert_bits(cols[:, 7], ref.e4m3_backward(ones, x, s, False)[0], "e4m3 STE mask")
    assert_bits(cols[:, 8], ref.e4m3_backward(g, x, s, True)[1], "e4m3 scale term")
    assert_bits(cols[:, 9], ref.affine_backward(ones, x, s, zp, qmin, qmax), "affine STE mask")
    assert_bits(cols[:, 10].view(torch.int32).to(torch.int16).view(torch.float16), x.to(torch.float16), "to fp16")
    assert_bits(cols[:, 11].view(torch.int32).to(torch.int16).view(torch.bfloat16), x.to(torch.bfloat16), "to bf16")


def test_e4m3_every_code_and_every_midpoint(harness):
    """All 256 E4M3 codes, the midpoints between neighbours (ties to even) and the saturation region."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:].double() + finite[:-1].double()) / 2
    near = torch.cat(
        [
            mids.float(),
            torch.nextafter(mids.float(), torch.tensor(math.inf)),
            torch.nextafter(mids.float(), torch.tensor(-math.inf)),
        ]
    )
    sat = torch.tensor([448.0, 449.0, 463.99, 464.0, 464.01, 480.0, 1e6, math.inf, -464.0, -1e6, -math.inf])
    x = torch.cat([finite, near, sat, -near]).float()
    s = torch.ones_like(x)
    out = harness.file()
    cmd = (
        f"elem {x.numel()} -128 127 {harness.file(x)} {harness.file(s)} {harness.file(torch.zeros_like(x))} "
        f"{harness.file(torch.ones_like(x))} {out}"
    )
    assert harness.run([cmd]) == ["ok 0"]
    cols = read(out, torch.float32, (x.numel(), 12))
    assert_bits(cols[:, 2], ref.fake_e4m3(x, s), "fake_e4m3 codes/midpoints")
    assert_bits(cols[:, 8], ref.e4m3_backward(torch.ones_like(x), x, s, True)[1], "e4m3 term")
    assert cols[:, 2].abs().max().item() == 448.0  # saturating: never NaN from overflow
    assert torch.equal(cols[: finite.numel(), 2], finite)  # every code is a fixed point


def test_zero_has_the_sign_onnxruntime_gives(harness):
    """Integer code 0 is +0.0 (a negative x that rounds to 0, -0.0 itself), as ORT's DequantizeLinear of code 0;
    E4M3 keeps -0.0 (ORT's FP8 QuantizeLinear gives the -0 code and its DequantizeLinear -0.0); affine q - zp is
    +0.0. Checked on bit patterns, in the element math and through the fp16/bf16 launchers."""
    x = torch.tensor([-0.0, -1e-45, -1e-30, -0.25, -0.5, -0.4999, 0.0, 0.25, -1.5, -2.5, -300.0, float("nan")])
    s = torch.ones_like(x)
    zp = torch.zeros_like(x)
    out = harness.file()
    cmd = f"elem {x.numel()} -128 127 {harness.file(x)} {harness.file(s)} {harness.file(zp)} {harness.file(s)} {out}"
    assert harness.run([cmd]) == ["ok 0"]
    cols = read(out, torch.float32, (x.numel(), 12))
    want_int = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, -2.0, -128.0, float("nan")])
    assert_bits(cols[:, 0], want_int, "fake_int: code 0 is +0.0")
    assert_bits(cols[:, 1], want_int, "quantize_int: code 0 is +0.0")
    assert_bits(cols[:, 3], want_int, "fake_affine: q - zp is +0.0")
    want_e4m3 = torch.tensor([-0.0, -0.0, -0.0, -0.25, -0.5, -0.5, 0.0, 0.25, -1.5, -2.5, -288.0, float("nan")])
    assert_bits(cols[:, 2], want_e4m3, "fake_e4m3 keeps -0.0")
    for dtype, code in DTYPES.items():
        xd = x.repeat(3).to(dtype)  # 36 elements: 16-byte vectors and scalar tails
        sd = torch.ones(1)
        out = harness.file()
        line = f"fwd 0 {code} -128 127 0 {bcast(xd.shape, (1,))} {harness.file(xd)} {harness.file(sd)} "
        assert harness.run([line + f"{harness.file(torch.zeros(1))} {out}"]) == ["ok 0"]
        assert_bits(read(out, dtype, xd.shape), want_int.repeat(3).to(dtype), f"fake_int launcher {dtype}")


# --- launchers: layouts, dtypes, alignment --------------------------------------------------------------------------
def bcast(x_shape, s_shape):
    s_shape = (1,) * (len(x_shape) - len(s_shape)) + tuple(s_shape)
    strides, acc = [], 1
    for n in reversed(s_shape):
        strides.append(0 if n == 1 else acc)
        acc *= n
    strides = strides[::-1]
    return f"{len(x_shape)} " + " ".join(map(str, x_shape)) + " " + " ".join(map(str, strides))


LAYOUTS = [  # (x shape, scale shape, expected layout kind)
    ((37,), (1,), 0),
    ((3, 5, 7), (), 0),
    ((8, 33), (8, 1), 1),  # axis 0
    ((6, 5, 9), (1, 1, 9), 1),  # last axis: inner = 1
    ((4, 6, 10), (1, 6, 1), 1),  # middle axis
    ((4, 6, 10), (4, 6, 1), 1),  # contiguous tuple (0, 1)
    ((4, 6, 10), (4, 1, 10), 2),  # tuple (0, 2): general
    ((5, 3, 16), (5, 3, 1), 1),  # 1-D blocks of 16 on the last axis (blocks.to_blocks view)
    ((3, 4, 2, 8), (3, 1, 2, 1), 2),  # 2-D blocks 4 x 8
    ((2, 3, 4, 5, 6), (2, 1, 4, 1, 6), 2),
    ((1, 7, 1, 13), (1, 7, 1, 1), 1),
]


def _ref_forward(op, x, s, zp, qmin, qmax):
    return {
        "fake_int": lambda: ref.fake_quant_int(x, s, qmin, qmax),
        "quantize_int": lambda: ref.quantize_int(x, s, qmin, qmax),
        "fake_e4m3": lambda: ref.fake_e4m3(x, s),
        "fake_affine": lambda: ref.fake_affine(x, s, zp, qmin, qmax),
        "quantize_affine": lambda: ref.quantize_affine(x, s, zp, qmin, qmax),
    }[op]()


def _case_tensors(x_shape, s_shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(x_shape, generator=g) * 3).to(dtype)
    x.view(-1)[::11] = (torch.randint(-40, 40, x.view(-1)[::11].shape, generator=g) + 0.5).to(dtype) / 4
    if x.numel() > 3:
        x.view(-1)[3] = math.nan
    s = (torch.rand(s_shape, generator=g) * 0.05 + 0.01).float()
    s.view(-1)[::4] = 2.0 ** torch.randint(-4, 0, s.view(-1)[::4].shape, generator=g).float()
    if s.numel() > 2:
        s.view(-1)[1] = 0.0  # a dead slice
    zp = torch.randint(-8, 8, s_shape, generator=g).float()
    return x, s, zp


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("misalign", [0, 1])
def test_forward_launcher_layouts(harness, dtype, misalign):
    lines, checks = [], []
    for li, (xs, ss, _kind) in enumerate(LAYOUTS):
        x, s, zp = _case_tensors(xs, ss, dtype, seed=li)
        for op, op_code in FWD.items():
            qmin, qmax = (-128, 127) if "affine" in op else (-8, 7)
            out = harness.file()
            lines.append(
                f"fwd {op_code} {DTYPES[dtype]} {qmin} {qmax} {misalign} {bcast(xs, ss)} {harness.file(x)} "
                f"{harness.file(s)} {harness.file(zp)} {out}"
            )
            want = _ref_forward(op, x, s, zp, qmin, qmax)
            checks.append((out, want, f"{op} {xs} scale {ss} {dtype} misalign={misalign}"))
    for res, (out, want, what) in zip(harness.run(lines), checks):
        assert res == "ok 0", (res, what)
        assert_bits(read(out, want.dtype, want.shape), want, what)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("misalign", [0, 1])
def test_backward_launcher_layouts(harness, dtype, misalign):
    lines, checks = [], []
    for li, (xs, ss, _kind) in enumerate(LAYOUTS):
        x, s, zp = _case_tensors(xs, ss, dtype, seed=100 + li)
        grad = torch.randn(xs, generator=torch.Generator().manual_seed(li)).to(dtype)
        qmin, qmax = -8, 7
        for op, op_code in BWD.items():
            need = op != "affine"
            gx, term = harness.file(), harness.file()
            lines.append(
                f"bwd {op_code} {DTYPES[dtype]} {qmin} {qmax} {misalign} {int(need)} {bcast(xs, ss)} "
                f"{harness.file(grad)} {harness.file(x)} {harness.file(s)} {harness.file(zp)} {gx} {term}"
            )
            if op == "int":
                want = ref.int_backward(grad, x, s, qmin, qmax, True)
            elif op == "e4m3":
                want = ref.e4m3_backward(grad, x, s, True)
            else:
                want = (ref.affine_backward(grad, x, s, zp, qmin, qmax), None)
            checks.append((gx, term, want, f"{op} backward {xs} scale {ss} {dtype} misalign={misalign}"))
    for res, (gx, term, want, what) in zip(harness.run(lines), checks):
        assert res == "ok 0", (res, what)
        assert_bits(read(gx, dtype, want[0].shape), want[0], what + " grad_x")
        if want[1] is not None:
            assert_bits(read(term, torch.float32, want[1].shape), want[1], what + " scale term")


def test_long_vectors_and_tails(harness):
    """Lengths around the vector width, and channel runs that straddle vectors."""
    lines, checks = [], []
    for dtype, code in DTYPES.items():
        for n in (1, 3, 4, 7, 8, 9, 15, 16, 17, 1000, 4099):
            for c in (1, 3, 8, 9):
                if n % c:
                    continue
                xs, ss = (c, n // c), (c, 1)
                x, s, zp = _case_tensors(xs, ss, dtype, seed=n * 10 + c)
                out = harness.file()
                lines.append(
                    f"fwd 0 {code} -128 127 0 {bcast(xs, ss)} {harness.file(x)} {harness.file(s)} "
                    f"{harness.file(zp)} {out}"
                )
                checks.append((out, ref.fake_quant_int(x, s, -128, 127), f"n={n} c={c} {dtype}"))
                xs2, ss2 = (n // c, c), (1, c)
                x2, s2, zp2 = _case_tensors(xs2, ss2, dtype, seed=n * 10 + c + 1)
                out2 = harness.file()
                lines.append(
                    f"fwd 2 {code} -128 127 0 {bcast(xs2, ss2)} {harness.file(x2)} "
                    f"{harness.file(s2)} {harness.file(zp2)} {out2}"
                )
                checks.append((out2, ref.fake_e4m3(x2, s2), f"e4m3 n={n} last-axis c={c} {dtype}"))
    for res, (out, want, what) in zip(harness.run(lines), checks):
        assert res == "ok 0", (res, what)
        assert_bits(read(out, want.dtype, want.shape), want, what)


def test_launcher_rejects_bad_arguments(harness):
    x = harness.file(torch.zeros(4))
    s = harness.file(torch.ones(1))
    res = harness.run(
        [
            f"fwd 0 0 5 4 0 1 4 0 {x} {s} {s} {harness.file()}",  # qmin > qmax
            f"fwd 0 7 -8 7 0 1 4 0 {x} {s} {s} {harness.file()}",  # bad dtype
            f"fwd 3 0 -8 7 0 1 4 0 {x} {s} {harness.file()} {harness.file()}",  # affine without a zero point
            f"fwd 0 0 -8 7 0 1 0 0 {x} {s} {s} {harness.file()}",  # 0 elements: success, nothing written
            f"hist 0 1 4 0 0 {x} {harness.file()} {harness.file()}",  # no bins
            f"hist 5 1 4 8 0 {x} {harness.file()} {harness.file()}",  # bad dtype
        ]
    )
    assert res == ["ok 1", "ok 1", "ok 1", "ok 0", "ok 1", "ok 1"]  # 1 = cudaErrorInvalidValue


# --- layout planner, fast division, histogram -----------------------------------------------------------------------
def test_layout_planner(harness):
    res = harness.run(
        [f"plan {bcast(xs, ss)}" for xs, ss, _ in LAYOUTS]
        + [
            "plan 9 2 2 2 2 2 2 2 2 2 256 0 64 0 16 0 4 0 1",  # 9 alternating dims: too many for the general path
        ]
    )
    for (xs, ss, kind), line in zip(LAYOUTS, res):
        assert int(line.split()[1]) == kind, (xs, ss, line)
        assert int(line.split()[5]) == kind
    assert res[2].split()[3:5] == ["8", "33"]  # axis 0: C = 8, inner = 33
    assert res[3].split()[3:5] == ["9", "1"]  # last axis: inner = 1
    assert res[5].split()[3:5] == ["24", "10"]  # (0, 1) merged into one channel dim
    assert res[-1].split()[1] == "-1" and res[-1].split()[5] == "-1"


def test_fast_divmod(harness):
    g = np.random.default_rng(0)
    nums = np.concatenate(
        [
            g.integers(0, 2**63, 2000, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
            g.integers(0, 2**40, 2000, dtype=np.uint64),
            np.array([0, 1, 2, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64 - 2], dtype=np.uint64),
        ]
    )
    lines, checks = [], []
    for d in (1, 2, 3, 5, 7, 10, 33, 127, 1000, 2**31 - 1, 2**32, 2**32 + 1, 3**30, 2**63 - 25, 2**63, 2**64 - 1):
        cases = np.concatenate([nums, (np.arange(1, 50, dtype=np.uint64) * np.uint64(d % 2**57))])
        out = harness.file()
        lines.append(f"div {cases.size} {d} {harness.file(cases)} {out}")
        checks.append((out, cases, d))
    for res, (out, cases, d) in zip(harness.run(lines), checks):
        assert res == "ok 0"
        got = np.fromfile(out, dtype=np.uint64).reshape(-1, 2)
        want_q = [int(v) // d for v in cases]
        want_r = [int(v) % d for v in cases]
        assert [int(v) for v in got[:, 0]] == want_q, d
        assert [int(v) for v in got[:, 1]] == want_r, d


def hist_reference(x: torch.Tensor, exps: torch.Tensor, nbins: int) -> torch.Tensor:
    """floor(v * 2**-e) per row (exact in float64), values outside [0, nbins * 2**e) not counted."""
    rows = x.shape[0]
    v = x.double() * torch.pow(torch.tensor(2.0, dtype=torch.float64), -exps.double()).reshape(-1, 1)
    keep = (v >= 0) & (v < nbins)
    idx = v.clamp(0, nbins - 1).long() + torch.arange(rows).reshape(-1, 1) * nbins
    return torch.bincount(idx[keep], minlength=rows * nbins).reshape(rows, nbins)


HIST_DTYPES = {**DTYPES, torch.float64: 3}


@pytest.mark.parametrize("dtype", list(HIST_DTYPES))
def test_histogram_grid(harness, dtype):
    g = torch.Generator().manual_seed(1)
    rows, cols = 3, 3000
    x = (torch.randn(rows, cols, generator=g).abs() * torch.tensor([[1.0], [1e-3], [50.0]])).to(dtype)
    x[0, :6] = torch.tensor([0.0, math.nan, -1.0, 4.0, 3.99, math.inf]).to(dtype)
    x[1, 6:40] = (torch.arange(34) / 2.0**14).to(dtype)  # values on bin edges
    lines, checks = [], []
    for nbins in (1, 7, 2048, 20000):
        from_max = torch.tensor([4.0, 2.0**-6, 300.0], dtype=torch.float64)
        exps = torch.ceil(torch.log2(from_max / nbins)).long()  # nbins * 2**e >= max
        exps[1] = -160 if nbins == 7 else exps[1]  # very small widths (E_MIN)
        out = harness.file()
        lines.append(f"hist {HIST_DTYPES[dtype]} {rows} {cols} {nbins} 0 {harness.file(x)} {harness.file(exps)} {out}")
        checks.append((out, hist_reference(x, exps, nbins), nbins, exps))
        out1 = harness.file()  # one exponent for every row
        lines.append(
            f"hist {HIST_DTYPES[dtype]} {rows} {cols} {nbins} {int(exps[0])} {harness.file(x)} {harness.file()} {out1}"
        )
        checks.append((out1, hist_reference(x, exps[:1].expand(rows), nbins), nbins, exps[:1].expand(rows)))
    for res, (out, want, nbins, _exps) in zip(harness.run(lines), checks):
        assert res == "ok 0"
        got = read(out, torch.int64, (rows, nbins))
        assert torch.equal(got, want), nbins


@pytest.mark.parametrize("dtype", list(HIST_DTYPES))
def test_histogram_float32_bins_at_the_range_edges(harness, dtype):
    """The kernels bin float32/16-bit values in float32 when 2**-e is a normal float32 (|e| <= 126), else in float64:
    both sides of that branch, products that underflow below 2**-126 or overflow to +Inf, -0.0 and bin edges."""
    vals = [0.0, -0.0, 1.0, 2.0**-126, 2.0**-149, 1e-30, 3.0e38, 65504.0, 2.0**-14, 1.5, 2.0**100, 2.0**-100]
    x = torch.tensor([vals] * 8, dtype=torch.float64).to(dtype)
    exps = torch.tensor([126, 127, -126, -127, 120, -100, 0, -5], dtype=torch.int64)
    rows, cols = x.shape
    lines, checks = [], []
    for nbins in (1, 3, 2048):
        out = harness.file()
        lines.append(f"hist {HIST_DTYPES[dtype]} {rows} {cols} {nbins} 0 {harness.file(x)} {harness.file(exps)} {out}")
        checks.append((out, hist_reference(x, exps, nbins), nbins))
    for res, (out, want, nbins) in zip(harness.run(lines), checks):
        assert res == "ok 0"
        assert torch.equal(read(out, torch.int64, (rows, nbins)), want), nbins


def test_histogram_equals_calibrator_grid(harness):
    """Same counts as modelopt_lite.calib.grid.histogram_rows (the CPU calibrator's binning) on valid data."""
    grid = pytest.importorskip("modelopt_lite.calib.grid")
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 5000, generator=g).abs() * torch.tensor([[1.0], [1e-30], [3e4], [0.0]])
    for cap in (16, 2048, 3000):
        exps = grid.needed_exp(a.amax(dim=1), cap)
        out = harness.file()
        (res,) = harness.run([f"hist 0 4 5000 {cap} 0 {harness.file(a)} {harness.file(exps)} {out}"])
        assert res == "ok 0"
        assert torch.equal(read(out, torch.int64, (4, cap)), grid.histogram_rows(a, exps, cap)), cap
