"""The export-time fusion of modules that read the same input (q/k/v, gate/up), as ModelOpt's HF export does it.

Deployment runtimes fuse such modules into one GEMM, so they must share their activation scale, their per-tensor
weight scale and their AWQ ``pre_quant_scale``. For every group of two or more quantized modules fed by the same
tensor (found with forward hooks on one dummy forward), in the W4A16 AWQ, W4A8 AWQ and NVFP4 formats (FP8 groups
are left alone, as ModelOpt does):

1. AWQ ``pre_quant_scale``: the group takes the mean of its members' scales (in the weights' dtype, in which the
   forward applies them); a member whose scale differs gets its weight re-smoothed in float32, ``w * old / mean``
   (cast back to the weight dtype), and its weight quantizer re-calibrated (max) on the new weight;
2. the input amax becomes the group's maximum (per-tensor input quantizers);
3. the per-tensor weight amax becomes the group's maximum: NVFP4's global amax (static NVFP4: its ``global_amax``,
   the block amaxes kept), W4A8's E4M3 second quantizer;
4. AWQ only: when the shared input is the output of a norm layer, the common ``pre_quant_scale`` is folded into
   the norm's weight (and bias) and removed from the members.

The fused model computes differently from the unfused one (shared scales); :func:`fuse_for_export` returns it as a
fake-quant model, which is what the checkpoint holds. The caller's model is never modified (the work is done on a
deep copy).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..algorithms.svdquant import svd_factors
from ..conversion.utils import named_quantizers
from ..nn.sequential_quantizer import SequentialQuantizer
from .hf_formats import AWQ_FORMATS, FUSED_FORMATS, NVFP4_SVD, has_lowrank

#: norms that compute ``(1 + weight) * x``: the scale folds into ``1 + weight``
_PLUS_ONE_NORMS = ("LayerNorm1P", "GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def _is_norm(module: nn.Module) -> bool:
    n = type(module).__name__
    return ("Norm" in n and "BatchNorm" not in n and "GroupNorm" not in n) and isinstance(
        getattr(module, "weight", None), torch.Tensor
    )


def _dummy_input(model: nn.Module) -> torch.Tensor:
    p = next(iter(model.parameters()), None)
    return torch.ones((1, 2), dtype=torch.long, device=None if p is None else p.device)


@torch.no_grad()
def shared_input_groups(model: nn.Module, names: list[str], dummy_input=None) -> list[tuple[list[str], str | None]]:
    """``[(module names, norm name or None)]``: the modules of ``names`` that read the same tensor in one forward
    of ``dummy_input`` (default: token ids ``ones(1, 2)``, an LLM), with the norm layer that produced it."""
    feeds: dict[int, list[str]] = {}
    produced: dict[int, str] = {}
    keep: list[torch.Tensor] = []  # the ids stay valid while the tensors live
    handles = []

    def on_input(name):
        def hook(_m, args, _out):
            if args and isinstance(args[0], torch.Tensor):
                keep.append(args[0])
                feeds.setdefault(id(args[0]), []).append(name)

        return hook

    def on_norm(name):
        def hook(_m, _args, out):
            if isinstance(out, torch.Tensor):
                keep.append(out)
                produced[id(out)] = name

        return hook

    wanted = set(names)
    for name, m in model.named_modules():
        if name in wanted:
            handles.append(m.register_forward_hook(on_input(name)))
        elif _is_norm(m):
            handles.append(m.register_forward_hook(on_norm(name)))
    x = _dummy_input(model) if dummy_input is None else dummy_input
    was_on: list[tuple[Any, bool]] = [(q, bool(q.is_enabled)) for _, q in named_quantizers(model)]
    for q, _ in was_on:  # a float forward: no quantizer state (calibrators, temporal steps) is touched
        q.disable()
    try:
        model(*x) if isinstance(x, tuple) else model(**x) if isinstance(x, dict) else model(x)
    except Exception as e:
        raise ValueError(
            "export_hf_checkpoint: the forward pass that finds the modules sharing an input failed "
            f"({type(e).__name__}: {e}); pass dummy_input= (a tensor, tuple of args or dict of kwargs) for this model"
        ) from e
    finally:
        for h in handles:
            h.remove()
        for q, on in was_on:
            if on:
                q.enable()
    return [(group, produced.get(key)) for key, group in feeds.items() if len(set(group)) > 1]


def _recalibrate_weight(module: Any) -> None:
    """Max-calibrate every enabled weight quantizer of ``module`` on its current weight."""
    wq = module.weight_quantizer
    for q in list(wq) if isinstance(wq, SequentialQuantizer) else [wq]:
        if not q.is_enabled or q.quant_desc.dynamic:
            continue
        if q.calibrator is not None:
            q.calibrator.reset()
        q.disable_quant()
        q.enable_calib()
        q(module.weight.detach())
        q.load_calib_amax()
        q.disable_calib()
        q.enable_quant()


def _resmooth(mods: list[Any]) -> torch.Tensor | None:
    pqs = [m.input_quantizer.pre_quant_scale for m in mods]
    if pqs[0] is None:
        return None
    if any(p is None or p.shape != pqs[0].shape for p in pqs):
        raise ValueError("export_hf_checkpoint: modules sharing an input have pre_quant_scales of different shapes")
    dt = mods[0].weight.dtype  # the scales as the forward applies them: in the activations' (weights') dtype
    mean = torch.stack([p.to(dt) for p in pqs]).mean(dim=0)
    for m, old in zip(mods, pqs):
        if torch.equal(old.to(dt), mean):
            continue
        w = m.weight
        new = (w.detach().float() * old.to(dt).float().to(w.device) / mean.float().to(w.device)).to(w.dtype)
        m.weight = nn.Parameter(new, requires_grad=w.requires_grad)
        m.input_quantizer.pre_quant_scale = mean
        _recalibrate_weight(m)
    return mean


def _resmooth_lowrank(mods: list[Any], label: str) -> torch.Tensor:
    """The NVFP4_SVD group re-smoothing (module docstring, step 1): one shared branch, new residual weights."""
    pqs = [m.input_quantizer.pre_quant_scale for m in mods]
    if any(p is None or p.shape != pqs[0].shape for p in pqs):
        raise ValueError(f"export_hf_checkpoint: {label}: SVDQuant modules sharing an input need pre_quant_scales")
    dt = mods[0].weight.dtype
    mean = torch.stack([p.to(dt) for p in pqs]).mean(dim=0)
    m32 = mean.float()
    ranks = {int(m.weight_quantizer.svdquant_lora_a.shape[0]) for m in mods}
    if len(ranks) != 1:
        raise ValueError(f"export_hf_checkpoint: {label}: SVDQuant modules sharing an input have ranks {sorted(ranks)}")
    full = []
    for m, old in zip(mods, pqs):
        wq, w = m.weight_quantizer, m.weight.detach()
        low = wq.svdquant_lora_b.float().to(w.device) @ wq.svdquant_lora_a.float().to(w.device)
        full.append((w.float() + low) * (old.float().to(w.device) / m32.to(w.device)))
    stacked = torch.cat(full, dim=0)
    a, b = svd_factors(stacked, ranks.pop(), label)
    residual = (stacked - b @ a).to(dt)
    row = 0
    for m in mods:
        n, w = m.weight.shape[0], m.weight
        m.weight = nn.Parameter(residual[row : row + n].clone(), requires_grad=w.requires_grad)
        m.weight_quantizer.svdquant_lora_a = a
        m.weight_quantizer.svdquant_lora_b = b[row : row + n]
        m.input_quantizer.pre_quant_scale = mean
        _recalibrate_weight(m)
        row += n
    return mean


def _share_amax(quantizers: list) -> None:
    if quantizers and all(getattr(q, "is_nvfp4_static", False) for q in quantizers):  # static NVFP4: the global amax
        gs = [q.global_amax for q in quantizers]
        if all(g is not None for g in gs):
            top = torch.stack([g.detach().float().reshape(()) for g in gs]).max()
            for q in quantizers:
                q.global_amax = top
        return
    amaxes = [q.amax for q in quantizers]
    if any(a is None or a.numel() != 1 for a in amaxes):
        return
    top = torch.stack([a.detach().float().reshape(()) for a in amaxes]).max()
    for q, a in zip(quantizers, amaxes):
        q.amax = top.to(a.dtype).reshape(a.shape)


def _fold_into_norm(norm: Any, mods: list[Any], pqs: torch.Tensor) -> None:
    w = norm.weight
    s = pqs.to(w.device)
    if type(norm).__name__ in _PLUS_ONE_NORMS or getattr(norm, "zero_centered_gamma", False):
        new = (w.detach() + 1.0) * s - 1.0
    else:
        new = w.detach() * s
    norm.weight = nn.Parameter(new.to(w.dtype), requires_grad=w.requires_grad)
    b = getattr(norm, "bias", None)
    if isinstance(b, torch.Tensor):
        norm.bias = nn.Parameter((b.detach() * s).to(b.dtype), requires_grad=b.requires_grad)
    for m in mods:
        m.input_quantizer.pre_quant_scale = None


def fuse_groups(model: nn.Module, formats: dict[str, str], dummy_input=None) -> list[list[str]]:
    """Apply the fusion to ``model`` IN PLACE (see the module docstring); returns the fused groups."""
    candidates = [n for n, f in formats.items() if f in FUSED_FORMATS]
    if not candidates:
        return []
    fused = []
    for names, norm_name in shared_input_groups(model, candidates, dummy_input):
        names = list(dict.fromkeys(names))
        kinds = {formats[n] for n in names}
        if len(kinds) != 1:
            raise ValueError(
                f"export_hf_checkpoint: modules {names} read the same input but have different formats "
                f"{sorted(kinds)}; a runtime fuses them into one GEMM"
            )
        fmt = kinds.pop()
        mods: list[Any] = [model.get_submodule(n) for n in names]
        pqs: torch.Tensor | None
        if (
            fmt == NVFP4_SVD
            and all(has_lowrank(m) for m in mods)
            and mods[0].input_quantizer.pre_quant_scale is not None
        ):
            pqs = _resmooth_lowrank(mods, "+".join(names))
        else:
            pqs = _resmooth(mods)
        iqs = [m.input_quantizer for m in mods]
        if all(q.is_enabled for q in iqs):
            _share_amax(iqs)
        wqs = [m.weight_quantizer for m in mods]
        _share_amax([q[-1] if isinstance(q, SequentialQuantizer) else q for q in wqs])
        if fmt in AWQ_FORMATS and pqs is not None and norm_name is not None:
            _fold_into_norm(model.get_submodule(norm_name), mods, pqs)
        fused.append(names)
    return fused


def fuse_for_export(model: nn.Module, formats: dict[str, str], dummy_input=None) -> nn.Module:
    """A deep copy of ``model`` with the export fusion applied (the fake-quant model the checkpoint holds)."""
    work = copy.deepcopy(model)
    fuse_groups(work, formats, dummy_input)
    return work
