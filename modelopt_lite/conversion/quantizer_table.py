"""What a quantized model contains: one row per quantizer (format, granularity, amax range, state).

``summary(model)`` returns the rows as dicts; ``print_quant_summary(model, file=None)`` writes them as a table to
``file`` (default ``sys.stdout``: it is an explicit, user-facing print function).
"""

from __future__ import annotations

import sys
from typing import TextIO

from torch import nn

from ..formats import element_format, is_float_format
from .utils import quantizer_sites

COLUMNS = ("name", "module", "format", "granularity", "amax", "calibrated", "state")


def format_name(desc) -> str:
    """A short name for a descriptor's number format: ``int8``, ``uint4``, ``int8n`` (narrow), ``fp8_e4m3``."""
    if desc.block_scheme is not None or is_float_format(desc.num_bits):
        name = desc.block_scheme.name if desc.block_scheme else f"fp8_{element_format(desc.num_bits).name}"
    else:
        name = f"{'u' if desc.unsigned else ''}int{desc.num_bits}{'n' if desc.narrow_range else ''}"
    return name if desc.fake_quant else f"{name} (real)"


def granularity_name(desc) -> str:
    """``per-tensor``, ``axis=(0,)`` or ``blocks{-1:128}`` (+ ``dynamic`` / scale bits)."""
    if desc.block_sizes:
        sizes = ",".join(f"{a}:{s}" for a, s in desc.block_sizes.items() if not isinstance(a, str))
        text = f"blocks{{{sizes}}}"
        if desc.block_sizes.get("scale_bits") is not None:
            sb = desc.block_sizes["scale_bits"]
            text += f" scale={element_format(sb).name if is_float_format(sb) else f'uint{sb}'}"
            if desc.block_scheme is not None and desc.block_scheme.kind == "mx":
                text += f"/{desc.block_scheme.rounding}"  # the E8M0 scale rule in effect
    elif desc.axis is not None:
        text = f"axis={desc.axis}"
    else:
        text = "per-tensor"
    return text + (" dynamic" if desc.dynamic else "")


def _step_amaxes(q) -> list:
    steps = int(getattr(q, "num_steps", 1) or 1)
    if steps == 1:
        return [q.amax] if q.has_amax else []
    saved = q.step
    out = []
    try:
        for t in range(steps):
            q.step = t
            if q.has_amax:
                out.append(q.amax)
    finally:
        q.step = saved
    return out


def summary(model: nn.Module) -> list[dict]:
    """One dict per quantizer: name, module (owner class), format, granularity, enabled/quant/calib flags, dynamic,
    calibrated, amax_min, amax_max (over channels, blocks and steps; None if uncalibrated), num_steps, learn_amax,
    calib_method."""
    rows = []
    for site in quantizer_sites(model):
        q, d = site.quantizer, site.quantizer.quant_desc
        amaxes = [] if d.dynamic else _step_amaxes(q)
        lo = min(float(a.min()) for a in amaxes) if amaxes else None
        hi = max(float(a.max()) for a in amaxes) if amaxes else None
        rows.append(
            {
                "name": site.name,
                "module": type(site.owner).__name__ if site.owner is not None else "",
                "format": format_name(d),
                "granularity": granularity_name(d),
                "enabled": bool(q.is_enabled),
                "quant": bool(q.is_quant_enabled),
                "calib": bool(q.is_calib_enabled),
                "dynamic": bool(d.dynamic),
                "calibrated": bool(amaxes),
                "amax_min": lo,
                "amax_max": hi,
                "num_steps": int(getattr(q, "num_steps", 1) or 1),
                "learn_amax": bool(d.learn_amax),
                "calib_method": d.calib_method,
            }
        )
    return rows


def _cells(row: dict) -> list[str]:
    if row["dynamic"]:
        amax = "dynamic"
    elif row["amax_min"] is None:
        amax = "-"
    elif row["amax_min"] == row["amax_max"]:
        amax = f"{row['amax_max']:.4g}"
    else:
        amax = f"{row['amax_min']:.4g}..{row['amax_max']:.4g}"
    if row["num_steps"] > 1:
        amax += f" ({row['num_steps']} steps)"
    if not row["enabled"]:
        state = "disabled"
    else:
        state = "+".join(s for s, on in (("quant", row["quant"]), ("calib", row["calib"])) if on) or "pass"
        if row["learn_amax"]:
            state += " learn"
    calibrated = "yes" if row["calibrated"] else ("n/a" if row["dynamic"] else "no")
    return [row["name"], row["module"], row["format"], row["granularity"], amax, calibrated, state]


def format_summary(rows: list[dict]) -> str:
    """The table text for ``rows`` (as returned by :func:`summary`), ending with a count line."""
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    enabled = sum(r["enabled"] for r in rows)
    calibrated = sum(r["calibrated"] for r in rows)
    lines.append(f"{len(rows)} quantizers: {enabled} enabled, {calibrated} calibrated")
    return "\n".join(lines) + "\n"


def print_quant_summary(model: nn.Module, file: TextIO | None = None) -> list[dict]:
    """Write the quantizer table of ``model`` to ``file`` (default ``sys.stdout``); returns the rows."""
    rows = summary(model)
    (file or sys.stdout).write(format_summary(rows))
    return rows
