"""PNG plots for quantization analysis (matplotlib is optional: imported only here, on first use).

- :func:`plot_calibration_histogram`: the histogram of ``|x|`` a HistogramCalibrator collects, with the amax each
  calibration method (max, percentile, mse, entropy) picks marked as a vertical line.
- :func:`plot_layer_errors`: a per-layer bar chart of a :func:`compare_models` metric (SQNR by default).
- :func:`plot_sensitivity`: per-layer metric drop of a sensitivity (or auto_skip) report, skipped layers marked.

Figures are drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend change).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

_METHOD_STYLE = {
    "max": ("tab:red", "-"),
    "percentile": ("tab:orange", "--"),
    "mse": ("tab:green", "-."),
    "entropy": ("tab:purple", ":"),
}


def _figure(width: float, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib (or pip install modelopt_lite[demo])") from e
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path) -> Path:
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise ValueError(f"plots are saved as PNG; path must end with .png, got {str(path)!r}")
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, format="png")
    return p


def calibration_amaxes(
    tensor: torch.Tensor,
    num_bits: int = 8,
    methods=("max", "percentile", "mse", "entropy"),
    percentile: float = 99.99,
    num_bins: int = 2048,
    unsigned: bool = False,
):
    """``({method: amax}, calibrator)``: the amax each method picks for ``tensor`` (per tensor)."""
    from ..calib import HistogramCalibrator, MaxCalibrator

    bad = [m for m in methods if m not in _METHOD_STYLE]
    if bad:
        raise ValueError(f"unknown calibration method {bad[0]!r}; choose from {list(_METHOD_STYLE)}")
    hist = HistogramCalibrator(num_bits, None, unsigned, num_bins=num_bins)
    hist.collect(tensor.detach())
    out = {}
    for m in methods:
        if m == "max":
            mc = MaxCalibrator(num_bits, None, unsigned)
            mc.collect(tensor.detach())
            out[m] = float(mc.compute_amax())
        elif m == "percentile":
            out[m] = float(hist.compute_amax("percentile", percentile=percentile))
        else:
            out[m] = float(hist.compute_amax(m))
    return out, hist


def plot_calibration_histogram(
    tensor: torch.Tensor,
    path,
    num_bits: int = 8,
    methods=("max", "percentile", "mse", "entropy"),
    percentile: float = 99.99,
    num_bins: int = 2048,
    unsigned: bool = False,
    title: str | None = None,
) -> dict:
    """Histogram of ``|x|`` (log counts) with the amax of each calibration method marked; saved as PNG.

    Returns:
        ``{"path": Path, "amax": {method: float}}``.
    """
    amax, hist = calibration_amaxes(tensor, num_bits, methods, percentile, num_bins, unsigned)
    counts = hist.counts.double()
    width = hist.bin_width
    last = int(torch.nonzero(counts).max()) + 1 if bool((counts > 0).any()) else 1
    merge = max(1, math.ceil(last / 256))  # at most ~256 drawn bars
    n = math.ceil(last / merge) * merge
    c = torch.nn.functional.pad(counts[:last], (0, n - last)).view(-1, merge).sum(1)
    edges = [i * merge * width for i in range(c.numel() + 1)]
    fig = _figure(10.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    ax.stairs(
        c.clamp(min=0.5).tolist(),
        edges,
        fill=True,
        color="tab:blue",
        alpha=0.8,
        baseline=0.5,
        zorder=3,
        label=f"|x| histogram ({int(counts.sum())} values)",
    )
    ax.set_yscale("log")
    for m, v in amax.items():
        color, style = _METHOD_STYLE[m]
        ax.axvline(
            v,
            color=color,
            linestyle=style,
            linewidth=1.8,
            alpha=0.9,
            zorder=2,
            label=f"{m}{f' {percentile:g}%' if m == 'percentile' else ''}: amax = {v:.4g}",
        )
    ax.set_xlim(0, max(edges[-1], max(amax.values())) * 1.04)
    ax.set_xlabel("|x|")
    ax.set_ylabel("count (log)")
    ax.set_title(title or f"Calibration of a {tuple(tensor.shape)} tensor, int{num_bits}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    return {"path": _save(fig, path), "amax": amax}


def _bars(names, values, path, xlabel, title, colors=None, note=None):
    h = max(2.5, 0.32 * len(names) + 1.3)
    fig = _figure(8.0, h)
    ax = fig.add_subplot(1, 1, 1)
    ys = list(range(len(names)))
    finite = [v for v in values if math.isfinite(v)]
    cap = max(finite) * 1.1 if finite and max(finite) > 0 else 1.0
    shown = [v if math.isfinite(v) else cap for v in values]
    bars = ax.barh(ys, shown, color=colors or "tab:blue")
    ax.set_yticks(ys, labels=names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    for b, v in zip(bars, values):
        ax.annotate(
            "inf" if not math.isfinite(v) else f"{v:.3g}",
            (b.get_width(), b.get_y() + b.get_height() / 2),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    ax.set_xlabel(xlabel)
    ax.set_title(f"{title}\n{note}" if note else title, fontsize=10)
    lo = min(0.0, min(shown) * 1.1 if shown else 0.0)
    ax.set_xlim(lo, max(shown + [0.0]) * 1.18 + 1e-12)
    return _save(fig, path)


def plot_layer_errors(rows: list[dict], path, metric: str = "sqnr_db", title: str | None = None) -> Path:
    """Horizontal bars of ``metric`` per layer from :func:`compare_models` rows; saved as PNG, returns the path."""
    if not rows:
        raise ValueError("plot_layer_errors: no rows to plot")
    if metric not in rows[0]:
        raise ValueError(
            f"plot_layer_errors: rows have no metric {metric!r}; available: "
            f"{[k for k, v in rows[0].items() if isinstance(v, float)]}"
        )
    names = [f"{r['name']} ({r.get('quant_type', '')})" for r in rows]
    values = [float(r[metric]) for r in rows]
    label = {
        "sqnr_db": "SQNR (dB, higher is better)",
        "mse": "MSE",
        "max_abs_error": "max |error|",
        "cosine_similarity": "cosine similarity",
    }.get(metric, metric)
    quantized = [r.get("quant_type", "") != r.get("float_type", "") for r in rows]
    colors = ["tab:blue" if q else "tab:gray" for q in quantized]
    note = "blue: quantized layers, gray: float layers (error inherited from upstream)"
    return _bars(names, values, path, label, title or f"Per-layer quantization error: {metric}", colors, note)


def plot_sensitivity(report, path, title: str | None = None) -> Path:
    """Bars of the metric drop when quantizing each layer alone (most sensitive on top); auto_skip reports mark
    their skipped layers in red. Saved as PNG; returns the path."""
    sens = getattr(report, "sensitivity", report)
    skipped = set(getattr(report, "skipped", []))
    rows = sens.rows
    if not rows:
        raise ValueError("plot_sensitivity: the report has no layers")
    colors = ["tab:red" if r["layer"] in skipped else "tab:blue" for r in rows]
    note = f"baseline {sens.baseline:.4g}, all quantized {sens.all_quantized:.4g}"
    if skipped:
        note += f"; red: left in float (final {report.final_metric:.4g})"
    return _bars(
        [r["layer"] for r in rows],
        [float(r["drop"]) for r in rows],
        path,
        "metric drop when only this layer is quantized",
        title or "Layer sensitivity",
        colors,
        note,
    )
