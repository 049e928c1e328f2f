"""``export_hf_checkpoint``: ModelOpt's unified Hugging Face checkpoint of a calibrated fake-quant model.

``export_dir`` receives:

- ``model.safetensors``: every float tensor of the model under its own name, and per quantized module the weight
  in its storage dtype with its scales (layouts: :mod:`.hf_weights`); the KV-cache scales of quantized attention;
- ``hf_quant_config.json``: ``{"producer", "quantization": {"quant_algo", "kv_cache_quant_algo", "group_size",
  ..., "exclude_modules"}}`` (:func:`.hf_formats.hf_quant_config`);
- ``config.json`` (Hugging Face models, those with a ``config``): the model's config with ModelOpt's
  ``quantization_config`` entry (``"quant_method": "modelopt"``), and ``generation_config.json`` where the model
  has one.

This is the layout TensorRT-LLM, vLLM and SGLang load for ModelOpt checkpoints. Before the tensors are written,
modules that read the same input are fused as ModelOpt does it (:mod:`.hf_fusion`), on a copy: the caller's model
is not modified. :func:`fuse_for_hf_export` returns that fused fake-quant model (what the checkpoint computes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from ..functional import deferred_errors
from .hf_formats import NVFP4, NVFP4_SVD, config_json_entry, has_quantizers, hf_quant_config, kv_format, module_format
from .hf_fusion import fuse_for_export
from .hf_weights import float_state, kv_tensors, module_tensors

WEIGHTS_NAME, QUANT_CONFIG_NAME, CONFIG_NAME = "model.safetensors", "hf_quant_config.json", "config.json"
__all__ = ["export_hf_checkpoint", "fuse_for_hf_export", "hf_formats_of"]


def hf_formats_of(model: nn.Module) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """``(weight formats {module: format}, KV formats {attention module: format}, float quantized modules)``;
    ValueError for any module the checkpoint cannot hold (uncalibrated, unsupported format)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"export_hf_checkpoint expects an nn.Module, got {type(model).__name__}")
    formats, kv, excluded = {}, {}, []
    for name, m in model.named_modules():
        if has_quantizers(m) and not isinstance(getattr(m, "weight_quantizer", None), nn.Identity):
            if name == "":
                raise ValueError("export_hf_checkpoint: the model itself is a quantized module; wrap it")
            fmt = module_format(name, m)
            if fmt is None:
                excluded.append(name)
            else:
                formats[name] = fmt
        k = kv_format(name, m)
        if k is not None:
            kv[name] = k
    if NVFP4_SVD in formats.values():  # SVDQuant's skipped NVFP4 layers: the same format without factors (ModelOpt)
        formats = {n: NVFP4_SVD if f == NVFP4 else f for n, f in formats.items()}
    if len(set(kv.values())) > 1:
        raise ValueError(f"export_hf_checkpoint: mixed KV-cache formats {sorted(set(kv.values()))}")
    return formats, kv, excluded


def fuse_for_hf_export(model: nn.Module, dummy_input=None) -> nn.Module:
    """The fake-quant model an HF checkpoint of ``model`` holds: a deep copy with the shared-input fusion applied
    (identical to ``model`` for FP8)."""
    formats, _, _ = hf_formats_of(model)
    return fuse_for_export(model, formats, dummy_input)


def _version() -> str:
    # the package root is always loaded before its submodules; read its constant without importing upward
    return str(getattr(sys.modules.get(__package__.partition(".")[0]), "__version__", "unknown"))


def _write_configs(model: nn.Module, out: Path, qcfg: dict) -> None:
    (out / QUANT_CONFIG_NAME).write_text(json.dumps(qcfg, indent=4) + "\n", encoding="utf-8")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(str(out))
        data = json.loads((out / CONFIG_NAME).read_text(encoding="utf-8"))
    else:
        data = config.to_dict()
    if data.get("dtype") is None:  # as save_pretrained writes it: the model's float dtype
        p = next((t for t in model.parameters() if t.is_floating_point()), None)
        if p is not None:
            data["dtype"] = str(p.dtype).replace("torch.", "")
    data["quantization_config"] = config_json_entry(qcfg)
    (out / CONFIG_NAME).write_text(json.dumps(data, indent=4) + "\n", encoding="utf-8")
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(str(out))


def export_hf_checkpoint(model: nn.Module, export_dir, dummy_input=None) -> Path:
    """Write the unified HF checkpoint of the calibrated fake-quant ``model`` into ``export_dir`` (created).

    Args:
        model: quantized and calibrated (:func:`modelopt_lite.quantize`) with ``FP8_DEFAULT_CFG``,
            ``INT4_AWQ_CFG``, ``W4A8_AWQ_BETA_CFG``, ``NVFP4_DEFAULT_CFG`` or ``NVFP4_SVDQUANT_DEFAULT_CFG``
            (optionally with an FP8/NVFP4 KV cache). Not modified.
        export_dir: the output directory.
        dummy_input: the input of the forward pass that finds modules sharing an input (default: token ids
            ``ones(1, 2)``, for language models); not needed for FP8.

    Returns:
        The path of ``model.safetensors``.

    Raises:
        ValueError: an uncalibrated quantizer, a module in a format the checkpoint cannot hold (names the module
            and its format), a mix of weight formats, or a failing dummy forward.
    """
    deferred_errors.check_errors()  # a sync point: pending CUDA value errors raise before exporting
    try:
        from safetensors.torch import save_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("export_hf_checkpoint needs safetensors: pip install safetensors") from e
    formats, kv, excluded = hf_formats_of(model)
    groups = {}
    tensors: dict[str, torch.Tensor] = {}
    work = fuse_for_export(model, formats, dummy_input)
    for name, fmt in formats.items():
        t, group = module_tensors(name, work.get_submodule(name), fmt)
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
        if group is not None:
            groups[name] = group
    for name in kv:
        tensors.update({f"{name}.{k}": v for k, v in kv_tensors(name, work.get_submodule(name)).items()})
    sizes = set(groups.values())
    if len(sizes) > 1:
        raise ValueError(f"export_hf_checkpoint: modules use different block sizes {sorted(sizes)}")
    kv_algo = next(iter(kv.values()), None)
    qcfg = hf_quant_config(formats, kv_algo, next(iter(sizes), None), excluded, _version())
    state = float_state(work, set(formats))
    clash = sorted(set(state) & set(tensors))
    if clash:
        raise ValueError(f"export_hf_checkpoint: tensor {clash[0]!r} is both a model tensor and an export scale")
    state.update(tensors)
    out = Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / WEIGHTS_NAME
    save_file(state, str(path), metadata={"format": "pt"})
    _write_configs(model, out, qcfg)
    return path
