"""The KV-cache scales of an HF checkpoint back onto attention modules (part of :func:`~.hf_load.load_hf_checkpoint`).

The checkpoint stores, per attention module, ``k_proj.k_scale`` and ``v_proj.v_scale``: float32 scalars, ``amax / 448``
(ModelOpt's layout, for an FP8 and an NVFP4 KV cache alike). Each such module becomes its quantized twin (the
quantized-attention class of :data:`~modelopt_lite.nn.QuantModuleRegistry`: a Hugging Face attention class, or one
given to ``register_attention_for_kv_quant``) with only ``k_bmm_quantizer`` / ``v_bmm_quantizer`` enabled, in the
format of ``kv_cache_quant_algo`` and with an amax whose scale ``float32(amax) / 448`` is the stored scale exactly
(:func:`~modelopt_lite.functional.scales.amax_for_scale`): an FP8 KV cache is then quantized bit for bit as the
fake-quant model did. NVFP4's per-tensor scale is ``amax / (6 * 448)``; the checkpoint keeps only ``amax / 448``, so
the recovered amax is one of the float32 values with that scale, which may round that second scale differently.

Everything is checked by :func:`kv_plans` before the model is touched; :func:`install_kv` then only converts.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..formats import E4M3_MAX
from ..functional.scales import amax_for_scale
from ..nn.modules._registry import QuantModuleRegistry
from ..nn.modules.quant_attention import AttentionQuantMixin
from ..presets.kv import FP8_KV_CFG, KV_PATTERN, NVFP4_KV_CFG
from .hf_checks import bad, want
from .hf_formats import FP8, NVFP4

#: checkpoint key (relative to the attention module) -> the quantizer it restores
KV_KEYS = {"k_proj.k_scale": "k_bmm_quantizer", "v_proj.v_scale": "v_bmm_quantizer"}
_ATTRS = {FP8: FP8_KV_CFG["quant_cfg"][KV_PATTERN], NVFP4: NVFP4_KV_CFG["quant_cfg"][KV_PATTERN]}


def _attention_owners(tensors: dict) -> list[str]:
    out = set()
    for key in tensors:
        for rel in KV_KEYS:
            if key == rel or key.endswith("." + rel):
                out.add(key[: -len(rel)].rstrip("."))
    return sorted(out)


def kv_plans(
    path, model: nn.Module, kv_algo: str | None, tensors: dict
) -> dict[str, dict[str, tuple[str, torch.Tensor]]]:
    """``{attention module: {checkpoint key: (quantizer attribute, amax)}}``, every entry checked (nothing modified).

    Raises:
        ValueError: KV scales without ``kv_cache_quant_algo`` (or the reverse), a missing, non-scalar, non-float32,
            non-finite or non-positive scale, or a module that is not an attention module this project quantizes.
    """
    owners = _attention_owners(tensors)
    if kv_algo is None:
        if owners:
            raise bad(path, f"{owners[0]}.k_proj.k_scale", "a KV-cache scale, but kv_cache_quant_algo is null")
        return {}
    if not owners:
        raise bad(
            path, "kv_cache_quant_algo", f"is {kv_algo!r}, but the checkpoint has no k_proj.k_scale / v_proj.v_scale"
        )
    plans: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for name in owners:
        try:
            att = model.get_submodule(name)
        except AttributeError:
            raise bad(path, f"module {name!r}", "is not in the model (a different architecture?)") from None
        quant_cls = QuantModuleRegistry.get(type(att))
        if not name or not (isinstance(quant_cls, type) and issubclass(quant_cls, AttentionQuantMixin)):
            raise bad(
                path,
                f"module {name!r}",
                f"holds KV-cache scales but its {type(att).__name__} has no quantized attention "
                "(register it with modelopt_lite.plugins.register_attention_for_kv_quant)",
            )
        plan = {}
        for rel, attr in KV_KEYS.items():
            key = f"{name}.{rel}"
            s = want(path, key, tensors.get(key), torch.float32, ())
            if not bool(torch.isfinite(s) & (s > 0)):
                raise bad(path, key, f"must be finite and > 0, got {float(s)!r}")
            amax, exact = amax_for_scale(s, E4M3_MAX)
            if not exact:
                warnings.warn(
                    f"load_hf_checkpoint: {key} = {float(s)!r} is not float32(amax) / 448 for any amax; "
                    f"{name}.{attr} uses the amax whose scale is nearest",
                    stacklevel=3,
                )
            plan[key] = (attr, amax)
        plans[name] = plan
    return plans


def install_kv(model: nn.Module, plans: dict[str, dict[str, tuple[str, torch.Tensor]]], kv_algo: str | None) -> None:
    """Replace each planned attention module by its quantized twin with the KV quantizers set (see the module doc)."""
    for name, plan in plans.items():
        assert kv_algo is not None  # kv_plans refuses plans without a format
        att = model.get_submodule(name)
        new = QuantModuleRegistry.convert(att)
        device = next((t.device for t in att.parameters()), torch.device("cpu"))
        for attr, amax in plan.values():
            q = getattr(new, attr)
            q.set_from_attribute_config(dict(_ATTRS[kv_algo]))
            q.amax = amax.to(device)
            q.name = f"{name}.{attr}"
        new.train(att.training)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
