"""The built-in end-to-end demos behind ``modelopt-lite demo`` (digits CNN, all-MiniLM-L6-v2 encoder).

:func:`run_demo` runs one and returns the finished report text; the per-model ``run`` functions return result
objects for tests and notebooks (:mod:`.digits`, :mod:`.minilm`); :mod:`.report` formats them.
"""

from __future__ import annotations

DEMOS = ("digits", "minilm")


def run_demo(model: str = "digits", **kwargs) -> str:
    """Run the demo for ``model`` (``"digits"`` or ``"minilm"``) and return its report (a table and the output
    folder). Keyword arguments go to the model's ``run`` (out, fast, plots, progress, threads, cache_dir)."""
    from . import report

    if model == "digits":
        from . import digits

        return report.format_digits(digits.run(**kwargs))
    if model == "minilm":
        from . import minilm

        kwargs.pop("cache_dir", None)
        return report.format_minilm(minilm.run(**kwargs))
    raise ValueError(f"run_demo: model must be one of {DEMOS}, got {model!r}")
