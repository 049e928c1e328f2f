"""Build hook beside ``pyproject.toml`` (which holds all the metadata): optional ahead-of-time kernels.

- ``pip install .`` / ``pip install -e .``: pure Python. Nothing is compiled and torch is not imported; the native
  kernels JIT-build on first use.
- ``MODELOPT_LITE_BUILD_EXT=1 pip install --no-build-isolation .``: compiles the C++ CPU kernels now, against the
  torch installed in this environment (hence ``--no-build-isolation``: pip's isolated build environment has no
  torch), into ``modelopt_lite/_native_cpu``, and the CUDA kernels into ``modelopt_lite/_native_cuda`` where torch
  is built with CUDA and nvcc is found (``CUDA_HOME``; ``TORCH_CUDA_ARCH_LIST`` picks the GPUs, else torch's
  default). Each module gets a build record ``_native_<kind>.json`` beside it; at run time
  ``modelopt_lite.functional.native_prebuilt`` uses a module only when its record matches (torch version, sources
  digest, GPU), and JIT-builds otherwise.

The sources and flags are those of the JIT build: ``modelopt_lite/functional/native_build.py`` is loaded by path
(never the package's ``__init__``), so there is one list.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
ENV = "MODELOPT_LITE_BUILD_EXT"


def _wanted() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise SystemExit(f"modelopt_lite setup.py: {ENV} must be 1 (build the native kernels) or 0, got {value!r}")


def _native_build():
    """``modelopt_lite/functional/native_build.py`` as a standalone module (stdlib imports only at its top)."""
    path = ROOT / "modelopt_lite" / "functional" / "native_build.py"
    spec = importlib.util.spec_from_file_location("_modelopt_lite_native_build", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"modelopt_lite setup.py: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_codes(cpp_extension) -> list[str]:
    """The GPU codes (``sm_90``, ``compute_90``) torch's build compiles for, read from its -gencode flags."""
    flags = cpp_extension._get_cuda_arch_flags()  # what BuildExtension passes to nvcc (TORCH_CUDA_ARCH_LIST)
    return sorted({code for flag in flags for code in re.findall(r"code=\[?((?:sm|compute)_\d+[af]?)", flag)})


def _extensions() -> dict:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        raise SystemExit(
            f"modelopt_lite setup.py: {ENV}=1 compiles the native kernels against the installed torch, but torch "
            f"cannot be imported here ({e}). Install torch first, then build without pip's isolated build "
            f"environment: {ENV}=1 pip install --no-build-isolation ."
        ) from None
    nb = _native_build()
    kinds = ["cpu"]
    if torch.version.cuda and cpp_extension.CUDA_HOME:
        kinds.append("cuda")
    else:
        why = "torch is built without CUDA" if not torch.version.cuda else "nvcc not found (set CUDA_HOME)"
        print(f"modelopt_lite setup.py: building the CPU kernels only ({why})", file=sys.stderr)
    csrc = nb.CSRC.relative_to(ROOT).as_posix()  # setuptools wants paths relative to setup.py
    exts = []
    for kind in kinds:
        args = {"cxx": nb.CFLAGS + nb.PREBUILT_CFLAGS}
        cls = cpp_extension.CppExtension
        if kind == "cuda":
            args["nvcc"] = list(nb.CUDA_CFLAGS)
            cls = cpp_extension.CUDAExtension
        exts.append(
            cls(
                name=f"modelopt_lite.{nb.PREBUILT[kind]}",
                sources=[f"{csrc}/{s}" for s in nb.SOURCES[kind]],
                extra_compile_args=args,
                extra_link_args=list(nb.LDFLAGS),
            )
        )
    kind_of = {f"modelopt_lite.{module}": kind for kind, module in nb.PREBUILT.items()}

    def record_name(ext) -> str:
        return nb.PREBUILT[kind_of[ext.name]] + ".json"

    class BuildExt(cpp_extension.BuildExtension):
        """torch's extension builder, plus the build record beside each module (in place too, for ``-e``)."""

        def build_extension(self, ext):
            super().build_extension(ext)
            kind = kind_of[ext.name]
            record = nb.prebuilt_info(kind, _cuda_codes(cpp_extension) if kind == "cuda" else None)
            path = Path(self.get_ext_fullpath(ext.name)).with_name(record_name(ext))
            path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")

        def copy_extensions_to_source(self):  # an editable install copies the modules into the source tree
            super().copy_extensions_to_source()
            package_dir = self.get_finalized_command("build_py").get_package_dir("modelopt_lite")
            for ext in self.extensions:
                built = os.path.join(self.build_lib, "modelopt_lite", record_name(ext))
                self.copy_file(built, os.path.join(package_dir, record_name(ext)))

        def get_outputs(self):
            records = [os.path.join(self.build_lib, "modelopt_lite", record_name(ext)) for ext in self.extensions]
            return super().get_outputs() + records

    return {"ext_modules": exts, "cmdclass": {"build_ext": BuildExt}}


setup(**(_extensions() if _wanted() else {}))
