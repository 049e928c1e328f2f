"""Per-group sensitivity scores for :func:`~modelopt_lite.algorithms.auto_quantize.auto_quantize` (a registry).

Every method sees a :class:`ScoreContext`: ``ref`` (a float copy of the model, all quantizers off), ``cands``
(format name -> a copy quantized and calibrated with that format everywhere), ``groups`` (group -> its layer
paths), ``formats`` (group -> the formats to score) and the score batches; it returns ``{group: {format: score}}``,
a larger score meaning a larger loss increase. Methods (``METHODS``; add one with :func:`register_score_method`):

``"gradient"`` (ModelOpt's): second-order Taylor expansion of the loss in a layer's output ``Y`` with the Fisher
    information in place of the Hessian. With ``g = dL/dY`` on the float model and ``D = Q(layer)(X) - Y`` (the
    layer alone quantized with the format, on the float model's input ``X``), the loss change is about
    ``1/2 D^T H D ~ 1/2 D^T (g g^T) D``; as ModelOpt we use the element-wise (diagonal) form and drop the
    constant: ``score = sum over score batches and elements of (g * D)^2`` (each product clamped to +-1e10).
    The Fisher stands in for the Hessian only where the loss gradient is not 0 at the float model: a loss that is
    a distance to the float model's own output has ``g = 0`` (every score 0, a warning says so); sample its
    target around that output instead (``y + noise``: the expected score is then the Gauss-Newton diagonal).
``"layer_error"``: the output error alone, ``sum of D^2`` (as :func:`~modelopt_lite.analysis.compare_models`
    measures per layer); needs no loss.
``"sensitivity"``: the measured loss increase with only that group quantized (as
    :func:`~modelopt_lite.analysis.sensitivity` ranks layers): ``sum over batches of loss(group quantized) -
    loss(float)``; exact but one forward per group, format and batch.
``"kl_div"`` (ModelOpt's): the same one-group-at-a-time forwards, scored without a loss:
    ``sum over batches of KL(P || Q)`` with ``P = softmax(float32(logits))`` of the float model and ``Q`` of the
    model with only that group quantized (``F.kl_div(log Q, log P, log_target=True, reduction="sum")``, so summed
    over every row and class). ``forward_step`` must return the logits (a tensor, or an object with a tensor
    ``logits`` attribute such as a Hugging Face output); the last dimension is the class dimension.

Groups whose format is fixed (``fixed_quantization_config``, or a one-format ``module_search_spaces`` entry with
``allow_no_quant=False``) are not scored (not in ``groups``): they stay quantized in ``ref`` while the others are
scored, as in ModelOpt.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ScoreContext:
    """What a score method works on (see the module doc)."""

    ref: nn.Module
    cands: dict[str, nn.Module]
    groups: dict[str, list[str]]
    formats: dict[str, list[str]]
    batches: list
    forward_step: Callable
    loss_func: Callable | None
    forward_backward_step: Callable | None
    #: (format, layer) -> the module to score instead of the candidate's own layer (see auto_quantize_recipes)
    views: dict[tuple[str, str], nn.Module] = field(default_factory=dict)

    def layer(self, fmt: str, name: str) -> nn.Module:
        """The layer ``name`` in format ``fmt``, as scored."""
        view = self.views.get((fmt, name))
        return view if view is not None else self.cands[fmt].get_submodule(name)


#: method name -> (score function, needs a loss: loss_func or forward_backward_step)
METHODS: dict[str, tuple[Callable[[ScoreContext], dict], bool]] = {}


def register_score_method(name: str, fn: Callable[[ScoreContext], dict], needs_loss: bool) -> None:
    """Add a score method ``fn(ctx) -> {group: {format: score}}`` usable as ``auto_quantize(method=name)``."""
    METHODS[name] = (fn, needs_loss)


def _loss(ctx: ScoreContext, model: nn.Module, batch) -> torch.Tensor:
    assert ctx.loss_func is not None
    loss = ctx.loss_func(ctx.forward_step(model, batch), batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"auto_quantize: loss_func must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    if not torch.isfinite(loss).all():
        raise ValueError(f"auto_quantize: loss_func returned a non-finite loss {loss.item()!r}")
    return loss


def _layer_formats(ctx: ScoreContext) -> dict[str, tuple[str, list[str]]]:
    """layer path -> (its group, the formats to score it with)."""
    return {n: (g, ctx.formats[g]) for g, names in ctx.groups.items() for n in names}


def _zeros(ctx: ScoreContext) -> dict[str, dict[str, torch.Tensor]]:
    return {g: {f: torch.zeros((), dtype=torch.float64) for f in fs} for g, fs in ctx.formats.items()}


def _as_floats(acc: dict) -> dict[str, dict[str, float]]:
    out = {g: {f: float(v) for f, v in d.items()} for g, d in acc.items()}
    for g, d in out.items():
        for f, v in d.items():
            if not math.isfinite(v):
                raise ValueError(f"auto_quantize: the score of {g!r} in format {f!r} is {v!r} (non-finite outputs?)")
    return out


def _output_diff_hooks(ctx: ScoreContext, on_diff: Callable) -> list:
    """Forward hooks on ``ref``'s layers calling ``on_diff(group, {format: Q(layer)(X) - Y}, Y)`` per call."""
    hooks = []
    for name, (group, fmts) in _layer_formats(ctx).items():
        qmods = {f: ctx.layer(f, name) for f in fmts}

        def hook(mod, args, kwargs, out, group=group, qmods=qmods):
            if not isinstance(out, torch.Tensor):
                return
            with torch.no_grad():
                y = out.detach().float()
                diffs = {f: qm(*args, **kwargs).detach().float() - y for f, qm in qmods.items()}
            on_diff(group, diffs, out)

        hooks.append(ctx.ref.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    return hooks


def gradient_scores(ctx: ScoreContext) -> dict[str, dict[str, float]]:
    """ModelOpt's ``"gradient"`` score: ``sum((dL/dY * (Q(layer)(X) - Y))^2)`` (see the module doc)."""
    acc = _zeros(ctx)
    for p in ctx.ref.parameters():  # ref is our own copy: gradients flow to every layer output
        if p.is_floating_point():
            p.requires_grad_(True)

    def on_diff(group, diffs, out):
        if not out.requires_grad:
            return

        def on_grad(g, group=group, diffs=diffs):
            g = g.detach().float()
            for f, d in diffs.items():
                acc[group][f] += (g * d).clamp(-1e10, 1e10).square().sum().double()

        out.register_hook(on_grad)

    def step(model, batch):
        if ctx.forward_backward_step is not None:
            ctx.forward_backward_step(model, batch)
        else:
            _loss(ctx, model, batch).backward()

    hooks = _output_diff_hooks(ctx, on_diff)
    try:
        with torch.enable_grad():
            for batch in ctx.batches:
                step(ctx.ref, batch)
                ctx.ref.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    out = _as_floats(acc)
    if all(v == 0.0 for d in out.values() for v in d.values()):
        warnings.warn(
            "auto_quantize: every gradient score is 0: the loss gradient vanishes at the float model (e.g. a "
            "distance to the float model's own output); use a log-likelihood loss, targets sampled around the "
            "output (a sampled Fisher), or method='sensitivity'",
            UserWarning,
            stacklevel=3,
        )
    return out


def layer_error_scores(ctx: ScoreContext) -> dict[str, dict[str, float]]:
    """``sum((Q(layer)(X) - Y)^2)`` over the score batches: the layer's own output error, no loss needed."""
    acc = _zeros(ctx)

    def on_diff(group, diffs, out):
        for f, d in diffs.items():
            acc[group][f] += d.square().sum().double()

    hooks = _output_diff_hooks(ctx, on_diff)
    try:
        with torch.no_grad():
            for batch in ctx.batches:
                ctx.forward_step(ctx.ref, batch)
    finally:
        for h in hooks:
            h.remove()
    return _as_floats(acc)


def _swap(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent, _, local = name.rpartition(".")
    owner = model.get_submodule(parent)
    old = getattr(owner, local)
    setattr(owner, local, module)
    return old


def _one_group_at_a_time(ctx: ScoreContext, measure: Callable, delta: Callable) -> dict[str, dict[str, float]]:
    """``sum over batches of delta(measure(ref with only the group in format f, b), measure(ref, b))``.

    Batch by batch (as ModelOpt), so only one batch's float measure (e.g. LLM log-probabilities) is held."""
    out: dict[str, dict[str, float]] = {g: dict.fromkeys(ctx.formats[g], 0.0) for g in ctx.groups}
    with torch.no_grad():
        for b in ctx.batches:
            base = measure(b)
            for group, names in ctx.groups.items():
                for f in ctx.formats[group]:
                    olds = {n: _swap(ctx.ref, n, ctx.layer(f, n)) for n in names}
                    try:
                        out[group][f] += float(delta(measure(b), base))
                    finally:
                        for n, m in olds.items():
                            _swap(ctx.ref, n, m)
    return _as_floats(out)


def sensitivity_scores(ctx: ScoreContext) -> dict[str, dict[str, float]]:
    """The measured loss increase with only the group quantized, summed over the score batches."""
    if ctx.loss_func is None:
        raise ValueError("auto_quantize: method='sensitivity' needs loss_func (forward_backward_step gives no loss)")
    return _one_group_at_a_time(ctx, lambda b: float(_loss(ctx, ctx.ref, b)), lambda v, v0: v - v0)


def _log_probs(ctx: ScoreContext, batch) -> torch.Tensor:
    out = ctx.forward_step(ctx.ref, batch)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError(
            "auto_quantize: method='kl_div' needs forward_step to return the logits (a float tensor or an object "
            f"with a tensor 'logits' attribute), got {type(logits).__name__}"
            + (f" of dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else "")
        )
    if not torch.isfinite(logits).all():
        raise ValueError("auto_quantize: method='kl_div': forward_step returned non-finite logits")
    return torch.log_softmax(logits.float(), dim=-1)


def kl_div_scores(ctx: ScoreContext) -> dict[str, dict[str, float]]:
    """ModelOpt's ``"kl_div"``: ``sum KL(P_float || P_group quantized)`` over the score batches (module doc)."""
    return _one_group_at_a_time(
        ctx,
        lambda b: _log_probs(ctx, b),
        lambda log_q, log_p: F.kl_div(log_q, log_p, reduction="sum", log_target=True),
    )


register_score_method("gradient", gradient_scores, needs_loss=True)
register_score_method("layer_error", layer_error_scores, needs_loss=False)
register_score_method("sensitivity", sensitivity_scores, needs_loss=True)
register_score_method("kl_div", kl_div_scores, needs_loss=False)
