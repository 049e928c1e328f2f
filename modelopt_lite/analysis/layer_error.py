"""``compare_models``: per-layer error of a quantized model against its float original, via forward hooks."""

from __future__ import annotations

import torch
from torch import nn

from .metrics import calculate_quantization_error


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    if isinstance(out, dict):
        for o in out.values():
            t = _first_tensor(o)
            if t is not None:
                return t
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        return _first_tensor(out.to_tuple())
    return None


def _run(model: nn.Module, inputs):
    with torch.no_grad():
        if isinstance(inputs, dict):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)


def _capture(model: nn.Module, names: list[str], inputs) -> tuple[dict, object]:
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    mods = dict(model.named_modules())
    for n in names:

        def hook(mod, args, out, n=n):
            t = _first_tensor(out)
            if t is not None and n not in seen:  # first call of a module reused inside one forward
                seen[n] = t.detach().float().cpu()

        hooks.append(mods[n].register_forward_hook(hook))
    try:
        out = _run(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen, out


def _is_quantizer(m: nn.Module) -> bool:
    from ..conversion.utils import is_quantizer

    return is_quantizer(m)


def compare_models(float_model: nn.Module, quant_model: nn.Module, inputs, layers: list[str] | None = None) -> list:
    """Run both models on ``inputs`` and compare every layer's output and the final output.

    Layers are matched by module path: by default every leaf module of ``float_model`` that also exists in
    ``quant_model`` (quantize() and fake2real() keep module names). ``inputs`` is a tensor, a tuple of positional
    arguments or a dict of keyword arguments. Neither model's training mode is changed (use ``.eval()``).

    Returns:
        A list of row dicts in forward order, one per layer that ran in both models, then a final ``"(output)"``
        row: ``name``, ``float_type``, ``quant_type``, ``shape`` and the metrics of
        :func:`~modelopt_lite.analysis.calculate_quantization_error` (``mse``, ``mae``, ``max_abs_error``,
        ``sqnr_db``, ``cosine_similarity``, ``numel``).

    Raises:
        ValueError: a requested layer is missing from one of the models.
    """
    fmods, qmods = dict(float_model.named_modules()), dict(quant_model.named_modules())
    if layers is None:
        layers = [
            n
            for n, m in float_model.named_modules()
            if n and not any(True for _ in m.children()) and n in qmods and not _is_quantizer(m)
        ]
    for n in layers:
        if n not in fmods or n not in qmods:
            raise ValueError(
                f"compare_models: layer {n!r} is missing from the {'float' if n not in fmods else 'quantized'} model"
            )
    fout, f_final = _capture(float_model, layers, inputs)
    qout, q_final = _capture(quant_model, layers, inputs)
    order = list(fout)  # forward order of the float model
    rows = []
    for n in order:
        if n not in qout or fout[n].shape != qout[n].shape:
            continue
        rows.append(
            {
                "name": n,
                "float_type": type(fmods[n]).__name__,
                "quant_type": type(qmods[n]).__name__,
                "shape": tuple(fout[n].shape),
                **calculate_quantization_error(fout[n], qout[n]),
            }
        )
    a, b = _first_tensor(f_final), _first_tensor(q_final)
    if a is not None and b is not None and a.shape == b.shape:
        rows.append(
            {
                "name": "(output)",
                "float_type": type(float_model).__name__,
                "quant_type": type(quant_model).__name__,
                "shape": tuple(a.shape),
                **calculate_quantization_error(a.detach().float(), b.detach().float()),
            }
        )
    return rows


def format_rows(
    rows: list[dict], columns=("name", "quant_type", "sqnr_db", "mse", "max_abs_error", "cosine_similarity")
) -> str:
    """A plain-text table of result rows (floats with 4 significant digits)."""

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    table = [list(columns)] + [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)
