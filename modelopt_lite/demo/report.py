"""Plain-text tables for the demos (this module formats; the CLI prints)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.4g}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """A GitHub-markdown-compatible table, columns padded to a common width.

    Args:
        headers: column titles.
        rows: one sequence of cells per row (strings are used as is; ``None`` -> ``"-"``; floats with 4 digits).
        align: one character per column, ``"l"`` or ``"r"`` (default: first column left, the others right).
    """
    ncol = len(headers)
    cells = [[_cell(c) for c in r] for r in rows]
    for i, r in enumerate(cells):
        if len(r) != ncol:
            raise ValueError(f"format_table: row {i} has {len(r)} cells, expected {ncol}")
    align = align or "l" + "r" * (ncol - 1)
    if len(align) != ncol or set(align) - {"l", "r"}:
        raise ValueError(f"format_table: align must be {ncol} characters of 'l'/'r', got {align!r}")
    widths = [max([len(h)] + [len(r[j]) for r in cells]) for j, h in enumerate(headers)]

    def line(items):
        out = [s.ljust(w) if a == "l" else s.rjust(w) for s, w, a in zip(items, widths, align)]
        return "| " + " | ".join(out) + " |"

    sep = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1)) for w, a in zip(widths, align))
        + "|"
    )
    return "\n".join([line(headers), sep] + [line(r) for r in cells])


def pct(v: float | None, digits: int = 2) -> str:
    """``98.44`` -> ``"98.44%"``; None -> ``"-"``."""
    return "-" if v is None else f"{v:.{digits}f}%"


def delta(v: float | None, ref: float | None, digits: int = 2) -> str:
    """A signed difference in points, e.g. ``"-0.22"``; ``"-"`` when either side is missing."""
    if v is None or ref is None:
        return "-"
    d = v - ref
    return f"{d:+.{digits}f}" if abs(d) >= 0.5 * 10**-digits else f"{0.0:.{digits}f}"


def size(nbytes: int | None) -> str:
    """Bytes in KiB/MiB with one decimal."""
    if nbytes is None:
        return "-"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def ms_vs(ms: float | None, ref_ms: float | None) -> str:
    """``"1.23 ms (0.85x)"``: latency and its ratio to the reference (speed-up >1 means faster)."""
    if ms is None:
        return "-"
    if not ref_ms:
        return f"{ms:.2f} ms"
    return f"{ms:.2f} ms ({ref_ms / ms:.2f}x)"


def format_digits(result) -> str:
    """The digits demo's table, its target checks and the output folder, as one block of text."""
    fp32 = result.fp32
    headers = [
        "format",
        "calibration",
        "torch acc",
        "drop",
        "ORT acc",
        "ORT max|diff|",
        "argmax agree",
        "ONNX size",
        "ORT latency (speed-up)",
    ]
    rows = []
    for r in result.rows:
        rows.append(
            [
                r.fmt,
                r.calib,
                pct(r.torch_acc),
                "-" if r is fp32 else delta(fp32.torch_acc, r.torch_acc),
                pct(r.ort_acc),
                "-" if r.max_diff is None else f"{r.max_diff:.2e}",
                pct(r.agree, 1),
                size(r.onnx_bytes),
                ms_vs(r.ort_ms, None if r is fp32 else fp32.ort_ms),
            ]
        )
    title = (
        f"modelopt-lite demo: digits CNN (8x8 scikit-learn digits, {len(result.rows) - 1} quantized variants, "
        "test set accuracy)"
    )
    lines = [title, "", format_table(headers, rows, "llrrrrrrr"), ""]
    checks = result.target_checks()
    missed = [c for c, ok in checks if not ok]
    if missed:
        lines.append(f"targets: {len(checks) - len(missed)}/{len(checks)} met; MISSED: " + "; ".join(missed))
    else:
        lines.append(
            f"targets: all {len(checks)} met (INT8/FP8 drop <= 0.5 points, INT4+QAT drop <= 1.0, "
            "ORT accuracy within 0.5 points of torch)"
        )
    lines += result.notes
    lines += [f"{r.fmt} {r.calib}: export/ORT failed: {r.error}" for r in result.rows if r.error]
    lines.append(
        "drop = FP32 accuracy - quantized accuracy (points). INT8: weights per channel, activations per "
        "tensor; FP8: per tensor; INT4: Linear weights in blocks of 128, Conv weights per channel, "
        "activations float. Latency: ORT CPU, batch 64, median; speed-up vs the FP32 export."
    )
    if result.plots:
        lines.append(f"plots: {', '.join(p.name for p in result.plots)}")
    lines.append(f"output folder: {result.out_dir}  ({result.seconds:.0f} s)")
    return "\n".join(lines)


def format_minilm(result) -> str:
    """The MiniLM demo's table, its target checks, any sensitivity findings and the output folder."""
    fp32 = result.rows[0]
    headers = [
        "format",
        "calibration",
        "cosine vs FP32 (mean/min)",
        "top-1 agree vs FP32",
        "top-1 acc",
        "ORT vs torch cosine (min)",
        "ORT top-1 == torch",
        "ONNX size",
        "ORT latency (speed-up)",
    ]
    rows = []
    for r in result.rows:
        rows.append(
            [
                r.fmt,
                r.calib,
                f"{r.cos_mean:.5f} / {r.cos_min:.4f}",
                pct(r.top1_agree, 1),
                pct(r.top1_acc, 1),
                "-" if r.ort_cos_min is None else f"{r.ort_cos_min:.5f}",
                pct(r.ort_top1_agree, 1),
                size(r.onnx_bytes),
                ms_vs(r.ort_ms, None if r is fp32 else fp32.ort_ms),
            ]
        )
    title = (
        f"modelopt-lite demo: all-MiniLM-L6-v2 sentence embeddings (mean pooling; {result.n_calib} "
        f"calibration sentences; {result.n_pairs} held-out query/passage pairs)"
    )
    lines = [title, "", format_table(headers, rows, "llrrrrrrr"), ""]
    checks = result.target_checks()
    missed = [c for c, ok in checks if not ok]
    if missed:
        lines.append(f"targets: {len(checks) - len(missed)}/{len(checks)} met; MISSED: " + "; ".join(missed))
    else:
        lines.append(
            f"targets: all {len(checks)} met (W8A8 cosine >= 0.99 and top-1 agreement >= 95%, FP8 cosine >= 0.995, "
            "NVFP4 W4A16 >= 0.975, MXFP8 >= 0.997; INT4 AWQ >= 0.967, INT4 AWQ+GPTQ >= 0.98; NVFP4/MX rows: torch only)"
        )
    for label, layers in result.sensitivity.items():
        worst = ", ".join(f"{name} (cosine {c:.4f})" for name, c in layers)
        lines.append(f"{label}: inputs that hurt most, by the cosine reached with them kept float: {worst}")
    lines += [f"{r.fmt} {r.calib}: export/ORT failed: {r.error}" for r in result.rows if r.error]
    lines.append(
        "quantized: nn.Linear weights per output channel, inputs per tensor (INT4: weights in blocks of 128 along "
        "the input axis, inputs float); LayerNorm, GELU, softmax and the "
        "attention matmuls stay float, except in the '+ attention' rows (Q, K, V and the softmax probabilities "
        f"per tensor). Latency: ORT CPU, {2 * result.n_pairs} sentences per batch, median."
    )
    lines.append(f"output folder: {result.out_dir}  ({result.seconds:.0f} s)")
    return "\n".join(lines)
