"""Ahead-of-time kernels (setup.py, ``MODELOPT_LITE_BUILD_EXT=1``) and the loader that prefers them.

The loader is tested on a stand-in library (a file under the prebuilt name, its import replaced by a stub) beside
a build record; the real compiled module is built, installed and tested without a compiler by ``.ci/run``.
A plain build is checked to stay pure Python: setup.py runs with an importable-but-poisoned torch.
"""

from __future__ import annotations

import importlib.machinery
import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import setuptools
import torch

from modelopt_lite.functional import backend, native_build, native_prebuilt

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "setup.py"
LOGGER = "modelopt_lite.functional.native_prebuilt"


# --- setup.py -------------------------------------------------------------------------------------------------------
def _poisoned_torch(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``import torch`` raises (a folder named torch first on the path)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('raise ImportError("torch is hidden by the test")\n')
    env = {k: v for k, v in os.environ.items() if k != "MODELOPT_LITE_BUILD_EXT"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


_PLAN = """
import json, runpy, sys, setuptools
seen = {}
setuptools.setup = lambda **kw: seen.update(kw)
runpy.run_path("setup.py", run_name="__main__")
print(json.dumps({"keys": sorted(seen), "torch": "torch" in sys.modules}))
"""


def test_plain_build_is_pure_python_and_never_imports_torch(tmp_path):
    env = _poisoned_torch(tmp_path)
    plan = subprocess.run([sys.executable, "-c", _PLAN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout.splitlines()[-1]) == {"keys": [], "torch": False}  # no ext_modules, no cmdclass
    version = subprocess.run(
        [sys.executable, str(SETUP), "--version"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip().splitlines()[-1] == __import__("modelopt_lite").__version__


def test_build_ext_without_torch_says_how_to_install(tmp_path):
    env = _poisoned_torch(tmp_path) | {"MODELOPT_LITE_BUILD_EXT": "1"}
    r = subprocess.run([sys.executable, "-c", _PLAN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "torch cannot be imported here (torch is hidden by the test)" in r.stderr
    assert "MODELOPT_LITE_BUILD_EXT=1 pip install --no-build-isolation ." in r.stderr


def test_build_ext_flag_must_be_a_boolean(tmp_path):
    env = _poisoned_torch(tmp_path) | {"MODELOPT_LITE_BUILD_EXT": "cuda"}
    r = subprocess.run([sys.executable, "-c", _PLAN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "MODELOPT_LITE_BUILD_EXT must be 1" in r.stderr and "'cuda'" in r.stderr


def _plan(monkeypatch) -> dict:
    """The keyword arguments setup.py passes to setuptools.setup with MODELOPT_LITE_BUILD_EXT=1 (nothing built)."""
    seen: dict = {}
    monkeypatch.setenv("MODELOPT_LITE_BUILD_EXT", "1")
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(SETUP), run_name="__main__")
    return seen


def test_build_ext_compiles_the_jit_sources_with_the_jit_flags(monkeypatch):
    from torch.utils import cpp_extension

    plan = _plan(monkeypatch)
    kinds = ["cpu"] + (["cuda"] if torch.version.cuda and cpp_extension.CUDA_HOME else [])
    exts = plan["ext_modules"]
    assert [e.name for e in exts] == [f"modelopt_lite.{native_build.PREBUILT[k]}" for k in kinds]
    for kind, ext in zip(kinds, exts):
        assert ext.sources == [f"modelopt_lite/csrc/{s}" for s in native_build.SOURCES[kind]]
        assert ext.extra_compile_args["cxx"] == native_build.CFLAGS + native_build.PREBUILT_CFLAGS
        assert ext.extra_link_args == native_build.LDFLAGS
        if kind == "cuda":
            assert ext.extra_compile_args["nvcc"] == native_build.CUDA_CFLAGS
    assert issubclass(plan["cmdclass"]["build_ext"], cpp_extension.BuildExtension)


def test_build_ext_writes_the_record_the_loader_expects(monkeypatch, tmp_path):
    from setuptools import Distribution
    from torch.utils import cpp_extension

    plan = _plan(monkeypatch)
    monkeypatch.setattr(cpp_extension.BuildExtension, "build_extension", lambda self, ext: None)  # no compiling
    cmd = plan["cmdclass"]["build_ext"](Distribution({"name": "modelopt_lite", "ext_modules": plan["ext_modules"]}))
    lib = tmp_path / "modelopt_lite" / f"_native_cpu{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    lib.parent.mkdir()
    monkeypatch.setattr(cmd, "get_ext_fullpath", lambda name: str(lib))
    cmd.build_extension(plan["ext_modules"][0])
    record = json.loads((lib.parent / "_native_cpu.json").read_text())
    assert record == native_build.prebuilt_info("cpu")
    assert record["torch"] == str(torch.__version__) and record["digest"] == native_build.source_digest("cpu")
    assert native_prebuilt.incompatibility("cpu", record) is None


# --- the loader -----------------------------------------------------------------------------------------------------
@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package folder holding a stand-in ``_native_cpu`` library; imports and JIT builds are recorded."""
    calls: dict[str, list] = {"import": [], "jit": []}
    lib = tmp_path / f"_native_cpu{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    lib.write_bytes(b"not a shared library")
    stub = SimpleNamespace(__name__="modelopt_lite._native_cpu", __file__=str(lib))
    jit = SimpleNamespace(__name__="modelopt_lite_cpu_jit")

    def fake_import(name, path):
        calls["import"].append((name, Path(path)))
        return stub

    def fake_jit(kind):
        calls["jit"].append(kind)
        return jit

    monkeypatch.setattr(native_prebuilt, "PACKAGE_DIR", tmp_path)
    monkeypatch.setattr(native_build, "import_extension", fake_import)
    monkeypatch.setattr(native_build, "load", fake_jit)
    monkeypatch.delenv("MODELOPT_LITE_NATIVE", raising=False)

    def write_record(**changes):
        record = native_build.prebuilt_info("cpu") | changes
        (tmp_path / "_native_cpu.json").write_text(json.dumps(record))

    return SimpleNamespace(lib=lib, stub=stub, jit=jit, calls=calls, write_record=write_record)


def test_a_compatible_prebuilt_module_is_used_without_jit(package, caplog):
    package.write_record()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert native_prebuilt.load("cpu") is package.stub
    assert package.calls == {"import": [("modelopt_lite._native_cpu", package.lib)], "jit": []}
    assert "prebuilt" in caplog.text and package.lib.name in caplog.text


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"torch": "1.13.0"}, "built for torch '1.13.0', this installation has " + repr(str(torch.__version__))),
        ({"digest": "0123456789ab"}, "built for kernel sources digest '0123456789ab', this installation has "),
        ({"python": "2.7"}, "built for Python '2.7'"),
        ({"module": "_native_cuda"}, "built for module '_native_cuda'"),
    ],
)
def test_an_incompatible_prebuilt_module_is_refused_with_its_reason(package, caplog, changes, reason):
    package.write_record(**changes)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert native_prebuilt.load("cpu") is package.jit
    assert package.calls == {"import": [], "jit": ["cpu"]}  # never even loaded: refused from its record
    (rec,) = [r for r in caplog.records if r.name == LOGGER]
    assert rec.levelno == logging.WARNING and reason in rec.getMessage() and package.lib.name in rec.getMessage()
    assert "building them just in time" in rec.getMessage()


def test_a_missing_or_broken_record_is_refused(package, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert native_prebuilt.load("cpu") is package.jit
        (package.lib.parent / "_native_cpu.json").write_text("{not json")
        assert native_prebuilt.load("cpu") is package.jit
        (package.lib.parent / "_native_cpu.json").write_text("[1, 2]")
        assert native_prebuilt.load("cpu") is package.jit
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "has no build record _native_cpu.json" in messages[0]
    assert "unreadable build record" in messages[1] and "is not a JSON object" in messages[2]
    assert package.calls["import"] == [] and package.calls["jit"] == ["cpu"] * 3


def test_a_library_that_fails_to_load_falls_back_to_jit(package, monkeypatch, caplog):
    package.write_record()
    monkeypatch.undo()  # the real import of the stand-in file (not an ELF library) ...
    monkeypatch.setattr(native_prebuilt, "PACKAGE_DIR", package.lib.parent)
    monkeypatch.setattr(native_build, "load", lambda kind: package.jit)
    mod, why = native_prebuilt.find("cpu")
    assert mod is None and why.startswith(f"{package.lib.name} failed to import: ")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert native_prebuilt.load("cpu") is package.jit  # ... is refused, then JIT
    assert "failed to import" in caplog.text


def test_no_prebuilt_module_is_the_quiet_usual_case(package, caplog):
    package.lib.unlink()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert native_prebuilt.load("cpu") is package.jit
    (rec,) = [r for r in caplog.records if r.name == LOGGER]
    assert rec.levelno == logging.DEBUG and "no prebuilt module in the package" in rec.getMessage()


def test_native_mode_jit_and_prebuilt(package, monkeypatch):
    package.write_record()
    monkeypatch.setenv("MODELOPT_LITE_NATIVE", "jit")
    assert native_prebuilt.load("cpu") is package.jit and package.calls["import"] == []
    monkeypatch.setenv("MODELOPT_LITE_NATIVE", "prebuilt")
    assert native_prebuilt.load("cpu") is package.stub
    package.write_record(torch="1.13.0")
    with pytest.raises(
        RuntimeError, match=r"MODELOPT_LITE_NATIVE=prebuilt but no compatible prebuilt cpu .*'1\.13\.0'"
    ):
        native_prebuilt.load("cpu")
    assert package.calls["jit"] == ["cpu"]  # only the MODELOPT_LITE_NATIVE=jit load
    monkeypatch.setenv("MODELOPT_LITE_NATIVE", "sometimes")
    with pytest.raises(
        ValueError, match=r"MODELOPT_LITE_NATIVE must be one of \('auto', 'jit', 'prebuilt'\), got 'sometimes'"
    ):
        native_prebuilt.mode()


def test_backend_loads_through_the_prebuilt_loader(package, monkeypatch):
    package.write_record()
    monkeypatch.setattr(backend, "_loaded", {})
    monkeypatch.setattr(backend, "_errors", {})
    assert backend._load("cpu") is package.stub
    monkeypatch.setattr(backend, "_loaded", {})
    monkeypatch.setenv("MODELOPT_LITE_NATIVE", "bogus")
    with pytest.raises(ValueError, match="MODELOPT_LITE_NATIVE"):  # the caller's mistake: raised, not a fallback
        backend._load("cpu")
    assert backend._loaded == {}


def test_loading_leaves_the_environment_alone(package):
    package.write_record()
    before = dict(os.environ)
    native_prebuilt.load("cpu")
    assert dict(os.environ) == before


# --- CUDA: the GPU codes a prebuilt module was compiled for -----------------------------------------------------------
@pytest.mark.parametrize(
    "archs, cap, ok",
    [
        (["sm_80"], (8, 0), True),
        (["sm_80"], (8, 6), True),  # a cubin runs on a later minor of its major
        (["sm_86"], (8, 0), False),
        (["sm_80"], (9, 0), False),  # ... never on another major
        (["sm_80", "compute_80"], (9, 0), True),  # PTX JITs forward
        (["compute_90"], (8, 9), False),
        (["sm_90a"], (9, 0), True),
        (["sm_90a"], (10, 0), False),
        (["sm_100a", "sm_90"], (10, 0), True),
        ([], (9, 0), False),
    ],
)
def test_cuda_arch_support(archs, cap, ok):
    assert native_prebuilt.arch_supported(archs, cap) is ok


def test_cuda_record_is_checked_against_every_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(8, 0), (9, 0)][i])
    record = native_build.prebuilt_info("cuda", ["sm_80"])
    assert record["cuda"] == torch.version.cuda and record["archs"] == ["sm_80"]
    assert native_prebuilt.incompatibility("cuda", record) == "compiled for GPU codes ['sm_80'], GPU 1 is sm_90"
    assert native_prebuilt.incompatibility("cuda", native_build.prebuilt_info("cuda", ["sm_90", "sm_80"])) is None
