"""The real W8A8 CUDA kernels (csrc/real_kernels.cu) run on the CPU, for tests: ``HostOps`` calls their extern "C"
launchers, built for the host (MODELOPT_LITE_EMULATE_ON_HOST) into a plain shared library, through ctypes, with the
same signatures as the dispatcher ops ``csrc/real_cuda_binding.cpp`` registers; ``binding_ops`` builds that binding
itself for the host (torch.ops.modelopt_lite_emulated, ~1 min of compilation, opt-in)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "modelopt_lite" / "csrc"
HOST_SOURCES = [HERE / "cuda_host" / "real_host_kernels.cpp"] + [
    CSRC / n for n in ("real_kernels.cu", "real_kernels_api.h", "quant_math.cuh", "quant_kernels_api.h")
]
BINDING_SOURCES = [HERE / "cuda_host" / "emulated_real_binding.cpp", CSRC / "real_cuda_binding.cpp", *HOST_SOURCES]
DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_F = ctypes.c_float
_I64 = ctypes.c_int64
_P = ctypes.c_void_p


def cuda_include() -> Path | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", "/opt/cuda"):
        if root and (Path(root) / "include" / "cuda_fp8.h").exists():
            return Path(root) / "include"
    return None


def _digest(files) -> str:
    return hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()[:12]


def build_host_library() -> Path | None:
    """The launchers as a host shared library (None without nvcc); cached in the temp folder by source digest."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    lib = Path(tempfile.gettempdir()) / f"modelopt_lite_real_host_{os.getuid()}_{_digest(HOST_SOURCES)}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc, "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off", str(HOST_SOURCES[0])]
        proc = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr
        tmp.replace(lib)
    return lib


def _ptr(t: torch.Tensor | None):
    return None if t is None else _P(t.data_ptr())


class HostOps:
    """The kernels' launchers behind the binding's op signatures (CPU tensors in, fresh tensors out)."""

    def __init__(self, lib: Path):
        self.lib = ctypes.CDLL(str(lib))
        self.lib.mlr_fp8_dynamic_partials.restype = _I64
        self.lib.mlr_fp8_dynamic_partials.argtypes = [_I64]
        self.lib.mlr_fp8_static.argtypes = [ctypes.c_int, _P, _P, _I64, _P, _P]
        self.lib.mlr_fp8_dynamic.argtypes = [ctypes.c_int, ctypes.c_int, _P, _P, _P, _I64, _I64, _P, _P]
        self.lib.mlr_int8_codes.argtypes = [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P, _F, _F, _F, _P]
        self.lib.mlr_int_mm_epilogue.argtypes = [ctypes.c_int, _P, _P, _P, _P, _I64, _I64, _P]

    @staticmethod
    def _ok(status: int, what: str):
        assert status == 0, f"{what}: launcher status {status}"

    def real_fp8_static(self, x, divisor):
        x = x.contiguous()
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        self._ok(self.lib.mlr_fp8_static(DT[x.dtype], _ptr(x), _ptr(codes), x.numel(), _ptr(divisor), None), "fp8")
        return codes

    def real_fp8_dynamic(self, x, per_row):
        x = x.contiguous()
        rows, cols = x.shape
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty((rows if per_row else 1, 1), dtype=torch.float32)
        partials = torch.empty(self.lib.mlr_fp8_dynamic_partials(x.numel()), dtype=torch.float32)
        st = self.lib.mlr_fp8_dynamic(
            DT[x.dtype], int(per_row), _ptr(x), _ptr(codes), _ptr(scales), rows, cols, _ptr(partials), None
        )
        self._ok(st, "fp8 dynamic")
        return codes, scales

    def real_int8_codes(self, x, divisor, qmin, qmax, shift, rows_out):
        x = x.contiguous()
        codes = torch.empty((rows_out, x.shape[1]), dtype=torch.int8)
        st = self.lib.mlr_int8_codes(
            DT[x.dtype], _ptr(x), _ptr(codes), x.shape[0], rows_out, x.shape[1], _ptr(divisor), qmin, qmax, shift, None
        )
        self._ok(st, "int8")
        return codes

    def real_int_mm_epilogue(self, acc, scale_row, bias, rows, dtype):
        acc = acc.contiguous()
        y = torch.empty((rows, acc.shape[1]), dtype=dtype)
        st = self.lib.mlr_int_mm_epilogue(
            DT[dtype], _ptr(acc), _ptr(scale_row.contiguous()), _ptr(bias), _ptr(y), rows, acc.shape[1], None
        )
        self._ok(st, "epilogue")
        return y


def binding_ops():
    """torch.ops.modelopt_lite_emulated: csrc/real_cuda_binding.cpp built for the host (None without CUDA headers)."""
    inc = cuda_include()
    if inc is None:
        return None
    from torch.utils import cpp_extension

    from modelopt_lite.functional.native_build import cache_root

    name = f"modelopt_lite_real_emulated_{_digest(BINDING_SOURCES)}"
    build = cache_root() / f"torch{torch.__version__.replace('+', '_')}" / name
    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(BINDING_SOURCES[0])],
        build_directory=str(build),
        extra_cflags=["-O2", "-std=c++17", "-ffp-contract=off", f"-I{inc}"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.modelopt_lite_emulated


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def same(got: torch.Tensor, want: torch.Tensor, what: str, any_nan: bool = False):
    """Same dtype, shape and bits (the sign of zero included; NaN payloads too unless ``any_nan``: then a NaN
    matches any NaN, as for a NaN row's scale, whose bits torch's amax chain leaves to the CPU)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} {want.shape}"
    diff = bits(got) != bits(want)
    if any_nan:
        diff &= ~(got.isnan() & want.isnan())
    bad = diff.nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} differences, first at {bad[0].tolist()}"


def special_rows(shape, dtype, seed, special=True):
    """Rows across magnitudes; with ``special``: a zero row, a tiny (dead) row, ties and saturation, NaN and Inf rows."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows).view(rows, 1)
    if special and rows >= 6:
        x[1] = 0.0
        x[2] *= 1e-30
        x[3, : min(cols, 4)] = torch.tensor([-0.0, 0.5, -1.5, 1e30])[: min(cols, 4)]
        x[4, 0] = float("nan")
        x[5, -1] = float("-inf")
    return x.to(dtype)
