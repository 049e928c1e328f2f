"""The algorithms/presets split: the weight algorithms register through the public API, the presets stay data."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BUILTIN = ["awq_clip", "awq_full", "awq_lite", "gptq", "sequence", "smoothquant", "svdquant"]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )


def test_public_quantize_registers_every_builtin_algorithm():
    r = _run(
        """
        import sys
        import modelopt_lite as mtq
        assert "modelopt_lite.algorithms" not in sys.modules
        mtq.quantize  # resolving a conversion name registers the algorithms
        from modelopt_lite.conversion.algorithm_registry import ALGORITHMS
        print(sorted(ALGORITHMS))
        """
    )
    assert r.returncode == 0, r.stderr
    names = eval(r.stdout.strip())  # noqa: S307 (our own child's repr of a list of str)
    assert set(BUILTIN) <= set(names)


def test_conversion_alone_names_the_package_that_registers():
    r = _run(
        """
        from modelopt_lite.conversion.config import normalize_algorithm, QuantConfigError
        try:
            normalize_algorithm("awq_lite")
        except QuantConfigError as e:
            print("ERR", e)
        import modelopt_lite.algorithms
        print("OK", normalize_algorithm("awq_lite")[0])
        """
    )
    assert r.returncode == 0, r.stderr
    err, ok = r.stdout.strip().splitlines()
    assert err.startswith("ERR unknown calibration method 'awq_lite'")
    assert "import modelopt_lite.algorithms" in err
    assert ok == "OK awq_lite"


def test_presets_package_is_the_one_owner_of_the_named_configs():
    import modelopt_lite as mtq
    from modelopt_lite import presets
    from modelopt_lite.conversion import config

    assert mtq.NVFP4_DEFAULT_CFG is presets.NVFP4_DEFAULT_CFG
    assert mtq.INT8_DEFAULT_CFG is presets.INT8_DEFAULT_CFG is config.INT8_DEFAULT_CFG
    assert config.PRESETS is presets.PRESETS
    families = [presets.basic.BASIC_PRESETS, presets.mx.MX_PRESETS, presets.attention.ATTENTION_PRESETS]
    families += [presets.kv.KV_PRESETS, presets.awq.AWQ_PRESETS, presets.svdquant.SVDQUANT_PRESETS]
    assert sum(len(f) for f in families) == len(presets.PRESETS)  # no family shadows another's name
    assert all(presets.PRESETS[k] is v for f in families for k, v in f.items())
    for name, cfg in presets.PRESETS.items():
        assert getattr(presets, name, cfg) is cfg, name  # every exported preset is the one in the table


def test_algorithm_modules_live_in_the_algorithms_package():
    import modelopt_lite.algorithms as alg

    for name in BUILTIN:
        run = alg.ALGORITHMS[name].run
        assert run.__module__.startswith("modelopt_lite.algorithms."), (name, run.__module__)
