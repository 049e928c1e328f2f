"""Hugging Face DBRX experts (``DbrxExperts`` / ``DbrxExpertGLU``) with one quantized Linear per expert, as ModelOpt.

transformers keeps the weights of all DBRX experts in three fused parameters of ``DbrxExpertGLU``: ``w1``, ``v1``
and ``w2``, each ``(num_experts * ffn_hidden_size, hidden_size)`` (in transformers 5.x, 2-D; viewed as
``(num_experts, ffn_hidden_size, hidden_size)`` per expert). ``DbrxExperts.forward`` slices expert ``e`` out of them
and calls ``mlp(x, w1[e], v1[e], w2[e])``, which computes ``(act(x @ w1[e].T) * (x @ v1[e].T)) @ w2[e]``.

Quantized (ModelOpt's layout and names), the GLU holds three ``nn.ModuleList``s of bias-free ``nn.Linear``s,
``w1_linear``, ``v1_linear`` (``hidden -> ffn``, weight ``w1[e]`` / ``v1[e]``) and ``w2_linear`` (``ffn -> hidden``,
weight ``w2[e].T``), and the fused parameters are gone; the Linears then convert to ``QuantLinear`` as usual, so
every expert has its own input and weight quantizers (per-channel weight amax per expert). ``DbrxExperts`` runs the
same routing as transformers' forward and calls ``mlp(tokens, expert_index)``. With the quantizers disabled the
outputs equal the float module's bit for bit (the same GEMMs in the same order).

ModelOpt 0.47 builds these Linears with ``in``/``out`` swapped for transformers 5.x (``nn.Linear(ffn, hidden)``
holding ``w1[e].T``), so its converted DBRX fails with a shape error there unless ``hidden == ffn``; this module
follows the installed transformers' forward. Both classes are found by a registry finder (``transformers`` is never
imported here): ``Quant<Name>`` subclasses the float class.
"""

from __future__ import annotations

import copy
import functools
import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._registry import QuantModuleRegistry

if TYPE_CHECKING:
    _MixinBase = nn.Module
else:
    _MixinBase = object

_DBRX_MODULE = "transformers.models.dbrx.modeling_dbrx"
#: the fused expert weights and the ModuleList each becomes (``w2`` is stored transposed per expert)
FUSED = (("w1", "w1_linear", False), ("v1", "v1_linear", False), ("w2", "w2_linear", True))


def _is_dbrx(cls, name: str) -> bool:
    return isinstance(cls, type) and cls.__module__ == _DBRX_MODULE and cls.__name__ == name


def _sizes(glu: nn.Module) -> tuple[int, int, int]:
    """``(num_experts, ffn_hidden_size, hidden_size)`` of a DbrxExpertGLU, checked against its fused weights."""
    sizes = []
    for attr in ("moe_num_experts", "ffn_hidden_size", "hidden_size"):
        v = getattr(glu, attr, None)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{type(glu).__name__}: {attr} must be a positive int, got {v!r}")
        sizes.append(v)
    e, f, h = sizes
    for name, _, _ in FUSED:
        w = getattr(glu, name, None)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (e * f, h):
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else w
            raise ValueError(
                f"{type(glu).__name__}: the fused expert weight {name!r} must be shaped (num_experts * "
                f"ffn_hidden_size, hidden_size) = ({e * f}, {h}), got {got!r}"
            )
    return e, f, h


def _expert_linears(w: torch.Tensor, e: int, f: int, h: int, transposed: bool) -> nn.ModuleList:
    """One bias-free Linear per expert holding a copy of its slice of ``w``: ``(f, h)``, or with ``transposed`` an
    ``(h, f)`` view of the ``(f, h)`` copy (strides ``(1, h)``), so that ``F.linear`` multiplies by the same memory
    layout as transformers' ``matmul(w2[e])`` and rounds the same way (a contiguous ``(h, f)`` copy does not, for
    some token counts)."""
    out = nn.ModuleList()
    per_expert = w.detach().view(e, f, h)
    for i in range(e):
        piece = per_expert[i].clone(memory_format=torch.contiguous_format)
        if transposed:  # a transposed view of the (f, h) copy: the GEMM reads the layout transformers' matmul reads
            piece = piece.t()
        lin = nn.Linear(piece.shape[1], piece.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(piece, requires_grad=w.requires_grad)
        out.append(lin)
    return out


class QuantDbrxExpertGLUMixin(_MixinBase):
    """The DBRX expert GLU with ``w1_linear`` / ``v1_linear`` / ``w2_linear`` (one Linear per expert)."""

    w1_linear: nn.ModuleList
    v1_linear: nn.ModuleList
    w2_linear: nn.ModuleList
    activation_fn: Any

    @classmethod
    def from_float(cls, module: nn.Module):
        """A converted copy of a ``DbrxExpertGLU``: the fused weights split into per-expert Linears (same values,
        dtype, device and requires_grad); ``module`` itself is not changed."""
        if not _is_dbrx(type(module), "DbrxExpertGLU"):
            raise TypeError(
                f"{cls.__name__}.from_float expects a transformers DbrxExpertGLU, got {type(module).__name__}"
            )
        e, f, h = _sizes(module)
        fused = {name: getattr(module, name) for name, _, _ in FUSED}
        held = {name: module._parameters.pop(name) for name in fused}  # not deep-copied: copied per expert below
        try:
            new: Any = copy.deepcopy(module)
        finally:
            module._parameters.update(held)
        new.__class__ = cls
        for name, attr, transposed in FUSED:
            setattr(new, attr, _expert_linears(fused[name], e, f, h, transposed))
        return new

    @classmethod
    def converted_param_shapes(cls, module: nn.Module) -> dict[str, list[int]]:
        """Own parameters once converted: none (the fused weights live in the per-expert Linears)."""
        return {}

    def forward(self, x: torch.Tensor, expert_idx: int) -> torch.Tensor:
        """Expert ``expert_idx`` on ``x`` (tokens, hidden): ``w2(act(w1(x)) * v1(x))``."""
        gate = self.activation_fn(self.w1_linear[expert_idx](x))
        return self.w2_linear[expert_idx](gate * self.v1_linear[expert_idx](x))


class QuantDbrxExpertsMixin(_MixinBase):
    """``DbrxExperts`` whose ``mlp`` is the converted GLU: the routing of transformers' forward, one expert call each."""

    mlp: Any
    hidden_size: int
    num_experts: int

    @classmethod
    def from_float(cls, module: nn.Module):
        """A converted copy of a ``DbrxExperts`` (its ``mlp`` converted too); ``module`` itself is not changed."""
        if not _is_dbrx(type(module), "DbrxExperts"):
            raise TypeError(
                f"{cls.__name__}.from_float expects a transformers DbrxExperts, got {type(module).__name__}"
            )
        mlp = module._modules.get("mlp")
        if mlp is None or not _is_dbrx(type(mlp), "DbrxExpertGLU"):
            raise TypeError(f"{cls.__name__}.from_float: the experts' mlp must be a DbrxExpertGLU, got {mlp!r}")
        glu_cls: Any = quant_dbrx_class(type(mlp))  # type: ignore[arg-type]
        glu = glu_cls.from_float(mlp)
        module._modules["mlp"] = None
        try:
            new: Any = copy.deepcopy(module)
        finally:
            module._modules["mlp"] = mlp
        new.__class__ = cls
        new.mlp = glu
        return new

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        next_states = torch.zeros_like(hidden_states)
        with torch.no_grad():  # transformers' routing: one class more for an index meaning "no expert"
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for hit in expert_hit:
            expert_idx = int(hit[0])
            if expert_idx >= self.num_experts:
                continue
            with torch.no_grad():
                idx, token_idx = torch.where(expert_mask[expert_idx])
            states = self.mlp(hidden_states[token_idx], expert_idx)
            states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, idx, None]
            next_states.index_add_(0, token_idx, states)
        return next_states.view(batch_size, -1, self.hidden_size)


_MIXINS = {"DbrxExperts": QuantDbrxExpertsMixin, "DbrxExpertGLU": QuantDbrxExpertGLUMixin}


@functools.cache
def quant_dbrx_class(float_cls: type) -> type:
    """``Quant<Name>(mixin, float_cls)`` for transformers' ``DbrxExperts`` / ``DbrxExpertGLU``."""
    mixin = _MIXINS[float_cls.__name__]
    return type(
        f"Quant{float_cls.__name__}",
        (mixin, float_cls),
        {"_float_cls": float_cls, "__module__": __name__, "__doc__": mixin.__doc__},
    )


def __getattr__(name: str) -> type:
    """``QuantDbrxExperts`` / ``QuantDbrxExpertGLU`` by name (what unpickling a quantized model looks up); imports
    transformers' DBRX module only then."""
    float_name = name.removeprefix("Quant")
    if name.startswith("Quant") and float_name in _MIXINS:
        return quant_dbrx_class(getattr(importlib.import_module(_DBRX_MODULE), float_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def find_hf_dbrx(cls: type) -> type | None:
    """The registry finder: the quantized class of transformers' ``DbrxExperts`` / ``DbrxExpertGLU``, else None."""
    if any(_is_dbrx(cls, name) for name in _MIXINS):
        return quant_dbrx_class(cls)
    return None


QuantModuleRegistry.add_finder(find_hf_dbrx)
