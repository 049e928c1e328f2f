"""Per-format state for :func:`~modelopt_lite.algorithms.auto_quantize.auto_quantize`: formats whose algorithm
changes the weights (SmoothQuant, AWQ, SVDQuant, GPTQ, lists of them: ``INT8_SMOOTHQUANT_CFG``, ``INT4_AWQ_CFG``,
``W4A8_AWQ_BETA_CFG``, ``NVFP4_AWQ_LITE_CFG``, ...).

Each candidate format has its own copy of the model, converted with the format everywhere and calibrated exactly as
``quantize(model, FORMAT, loop)`` would (the same algorithm on the same batches), so a copy's layer holds the state
the standalone ``quantize`` gives that layer: its weight (``W * s`` after SmoothQuant/AWQ, GPTQ's rounded weight),
bias, buffers and quantizers (amax, ``pre_quant_scale``, SVDQuant's low-rank factors). A layer switched to a format
(while scoring and in the returned model) takes all of that from the format's copy; "keep float" takes it from the
float copy. (ModelOpt keeps one model and swaps per-format quantizers, with AWQ's/SmoothQuant's weight scale held
as a weight-side ``pre_quant_scale`` until the end; the result is the same state.)

An algorithm may change modules that are not searched layers only in one way: AWQ's ``1 / s`` folded into the
norm (or unsearched Linear) that produces the scaled layers' input (:mod:`.awq_fold`; found from AWQ's records,
``debug=True`` is added to its parameters). When every layer that format scaled through that producer uses the
format, the producer takes the format's folded state too (bit for bit the standalone model); otherwise (some of
them use another format or float, or the producer is itself a layer left out of the search) the producer stays
float and the format's layers keep the ``1 / s`` as their input quantizer's ``pre_quant_scale`` instead (the same
function; the product rounds differently). Scores are measured that way too (a layer alone in a format). Anything else (a fold into a searched
layer, any other change outside the searched layers) raises ValueError naming the format, the module and why.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ..conversion.algorithm_registry import ALGORITHMS
from ..conversion.config import normalize_config
from ..conversion.model_quant import calibrate, quantize
from ..nn import TensorQuantizer
from .auto_quantize_spaces import is_quantizer_child, searchable_layers

#: the algorithms whose AWQ scale search may fold ``1 / s`` into a producer (their records say where)
_FOLDING = frozenset({"awq_lite", "awq_full", "svdquant"})

Key = str | None  #: a candidate format's name; None: the fixed_quantization_config baseline


@dataclass(frozen=True)
class Fold:
    """AWQ multiplied a layer's weight columns by ``scale`` and divided the output channels of ``producer``."""

    producer: str
    scale: torch.Tensor


def weight_algorithm(cfg: dict) -> str | None:
    """The config's algorithm name if it is a registered (weight-changing) one, else None."""
    alg = normalize_config(cfg, enable_by_default=True).algorithm
    return alg[0] if alg is not None and alg[0] in ALGORITHMS else None


def _traced(method: str, params: dict, fold_linear: bool) -> dict:
    """The algorithm with AWQ's records kept (``debug``) and, with ``fold_linear=False``, no fold into a Linear."""
    if method == "sequence":
        steps = [None if s is None else _traced(s[0], s[1], fold_linear) for s in params["steps"]]
        return {"method": "sequence", "steps": steps}
    if method not in _FOLDING:
        return {"method": method, **params}
    return {"method": method, **params, "debug": True, **({} if fold_linear else {"fold_linear": False})}


def _batches_loop(forward_step: Callable, batches: list) -> Callable:
    def loop(m):
        was = [(x, x.training) for x in m.modules()]
        m.eval()
        try:
            with torch.no_grad():
                for b in batches:
                    forward_step(m, b)
        finally:
            for x, t in was:
                x.train(t)

    return loop


def calibrate_candidate(
    q: nn.Module, cfg: dict, forward_step: Callable, batches: list, fold_linear: bool = True
) -> dict[str, Fold]:
    """Calibrate a candidate copy (converted with ``cfg``) as ``quantize(model, cfg, loop)`` would; its folds."""
    alg = normalize_config(cfg, enable_by_default=True).algorithm
    if alg is None:
        return {}
    method, params = alg
    loop = _batches_loop(forward_step, batches)
    if method not in ALGORITHMS:
        calibrate(q, None if method == "max" else method, loop, **params)
        return {}
    quantize(q, {**cfg, "algorithm": _traced(method, params, fold_linear)}, loop)
    folds = {}
    for name, m in q.named_modules():
        rec = getattr(m, "awq_lite", None)
        where = getattr(rec, "folded_into", "")
        if where not in ("", "pre_quant_scale") and isinstance(getattr(rec, "scale", None), torch.Tensor):
            folds[name] = Fold(where, rec.scale)  # type: ignore[union-attr]
    return folds


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(m.named_parameters(recurse=False)), **dict(m.named_buffers(recurse=False))}


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = _state(a), _state(b)
    return sa.keys() == sb.keys() and all(
        sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa
    )


def folds_into_layers(folds: dict[str, Fold], grouped: set[str]) -> list[tuple[str, str]]:
    """``(consumer, producer)`` of the folds into searched layers (their weight would hold another layer's scale)."""
    return [(c, f.producer) for c, f in folds.items() if f.producer in grouped]


def check_changes(ref: nn.Module, cand: nn.Module, folds: dict[str, Fold], grouped: set[str], what: str) -> None:
    """ValueError if the algorithm changed a module other than the layers and the producers of their folds."""
    layers = set(searchable_layers(ref))
    for c, p in folds_into_layers(folds, grouped):
        raise ValueError(
            f"auto_quantize: {what}: AWQ folded the input scale of {c!r} into the searched layer {p!r} (even with "
            "fold_linear=False); that layer's weight would then depend on its consumers' formats, which "
            "auto_quantize cannot switch independently (keep one of them out of the search with disabled_layers)"
        )
    for name in sorted(grouped):
        mine, theirs = _state(cand.get_submodule(name)), _state(ref.get_submodule(name))
        layout = {k: (tuple(t.shape), t.dtype) for k, t in mine.items()}
        if layout != {k: (tuple(t.shape), t.dtype) for k, t in theirs.items()}:
            raise ValueError(
                f"auto_quantize: {what}: its algorithm changed the tensors of the layer {name!r} (now {layout}); "
                "auto_quantize switches a layer's tensor values between formats, not its parameters"
            )
    producers = {f.producer for f in folds.values()}
    quantizers = {n for n, m in cand.named_modules() if is_quantizer_child(m)}
    for name, m in cand.named_modules():
        parts = name.split(".")
        if (
            name in layers
            or name in producers
            or any(".".join(parts[:i]) in quantizers for i in range(1, len(parts) + 1))
        ):
            continue
        try:
            other = ref.get_submodule(name)
        except AttributeError:
            other = None
        if other is None or not _same(m, other):
            raise ValueError(
                f"auto_quantize: {what}: its algorithm changed {name or 'the model'!r} ({type(m).__name__}), which "
                "is not a searched layer; auto_quantize switches formats per layer and cannot keep that change"
            )


def install(dst: nn.Module, src: nn.Module, prefix: str = "", state: bool = True) -> None:
    """Give ``dst`` a copy of every quantizer of ``src`` under ``prefix`` and (``state``) the direct parameters and
    buffers of the module at ``prefix`` (both models converted the same way)."""
    root = src.get_submodule(prefix) if prefix else src
    done: list[str] = []
    for name, m in root.named_modules():
        path = f"{prefix}.{name}" if prefix and name else (prefix or name)
        if any(path == d or path.startswith(d + ".") for d in done):
            continue
        for child, q in m.named_children():
            if is_quantizer_child(q):
                owner = dst.get_submodule(path) if path else dst
                setattr(owner, child, copy.deepcopy(q).train(owner.training))  # the owner's train/eval flag
                done.append(f"{path}.{child}" if path else child)
    if state and prefix:
        _copy_state(dst.get_submodule(prefix), root)


def _copy_state(dst: nn.Module, src: nn.Module) -> None:
    """``dst``'s direct parameters and buffers take ``src``'s values (the same tensors objects, updated in place)."""
    mine, theirs = _state(dst), _state(src)
    if mine.keys() != theirs.keys():
        raise RuntimeError(f"auto_quantize: {type(dst).__name__} has tensors {sorted(mine)}, its copy {sorted(theirs)}")
    with torch.no_grad():
        for k, t in mine.items():
            if t.shape != theirs[k].shape or t.dtype != theirs[k].dtype:
                raise RuntimeError(f"auto_quantize: {type(dst).__name__}.{k} differs in shape/dtype from its copy's")
            if not torch.equal(t, theirs[k]):
                t.copy_(theirs[k])


def _add_inverse(layer: nn.Module, scale: torch.Tensor) -> None:
    """The fold undone for one layer: its input is multiplied by ``1 / scale`` before its input quantizer."""
    iq = cast(TensorQuantizer, layer.input_quantizer)
    old = iq.pre_quant_scale
    inv = (1.0 / scale).to(cast(torch.Tensor, layer.weight).device)
    iq.pre_quant_scale = inv if old is None else old.to(inv.device) * inv


def place(
    dst: nn.Module,
    ref: nn.Module,
    srcs: dict[Key, nn.Module],
    folds: dict[Key, dict[str, Fold]],
    layer_src: dict[str, Key],
) -> None:
    """Install every layer of ``layer_src`` (layer -> the model whose state it takes) into ``dst``, then settle the
    producers of the folds of the formats in use: exact where one format's consumers all use it (and the producer
    is no layer), else float (as ``ref``) with the ``1 / s`` kept by those consumers (see the module doc)."""
    layers = set(searchable_layers(ref))  # an unsearched layer's own state in a format's copy is not wanted
    for name, key in layer_src.items():
        install(dst, srcs[key], name)
    active: dict[str, list[tuple[Key, str]]] = {}  # producer -> (format, consumer) folds whose consumer uses it
    for key in dict.fromkeys(layer_src.values()):
        for c, f in folds.get(key, {}).items():
            if layer_src.get(c) == key:
                active.setdefault(f.producer, []).append((key, c))
    for p in {f.producer for fs in folds.values() for f in fs.values()} - set(active):
        _copy_state(dst.get_submodule(p), ref.get_submodule(p))  # no consumer uses a fold into it: float
    for p, used in active.items():
        keys = list(dict.fromkeys(k for k, _ in used))
        everyone = {c for c, f in folds[keys[0]].items() if f.producer == p}
        exact = len(keys) == 1 and {c for _, c in used} == everyone and p not in layers
        _copy_state(dst.get_submodule(p), (srcs[keys[0]] if exact else ref).get_submodule(p))
        if not exact:
            for k, c in used:
                _add_inverse(dst.get_submodule(c), folds[k][c].scale)


def scoring_views(cands: dict[str, nn.Module], folds: dict[Key, dict[str, Fold]]) -> dict[tuple[str, str], nn.Module]:
    """``(format, layer) -> module`` to score a layer alone in a format whose AWQ folded its scale into a producer:
    a copy of the format's layer keeping ``1 / s`` as ``pre_quant_scale`` (the producer stays float then)."""
    out = {}
    for f, fs in folds.items():
        if f is None or f not in cands:
            continue
        for c, fold in fs.items():
            view = copy.deepcopy(cands[f].get_submodule(c))
            _add_inverse(view, fold.scale)
            out[(f, c)] = view
    return out
