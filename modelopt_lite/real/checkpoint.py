"""Compact real-quantized checkpoints: a safetensors file (int8/int4 codes, scales, float tensors) + a JSON config.

Layout of ``save_dir``:

- ``model_int8.safetensors``: the real model's ``state_dict`` (int8 ``weight`` / uint8 ``weight_packed`` codes,
  float32 ``weight_scale`` and ``input_scale``, biases and every other float tensor as they are). The JSON config is
  also stored in the file's metadata under ``"modelopt_lite"``, so the file alone is enough to load.
- ``model_int8.json``: ``{"format": "modelopt_lite.real", "version": 1, "modules": {name: spec}, "float": [...]}``
  where each spec describes one real module (see :mod:`.convert`).

:func:`load_real` rebuilds the real model on a fresh FLOAT model of the same architecture; anything that does not
match raises ValueError naming the first mismatching tensor, before the model is touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

FORMAT, VERSION = "modelopt_lite.real", 1
WEIGHTS_NAME, CONFIG_NAME = "model_int8.safetensors", "model_int8.json"


def _safetensors():
    try:
        from safetensors.torch import load_file, safe_open, save_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("real checkpoints need safetensors: pip install safetensors") from e
    return save_file, load_file, safe_open


def checkpoint_config(model: nn.Module) -> dict:
    """The JSON config describing the real modules of ``model``."""
    from .convert import real_modules

    return {"format": FORMAT, "version": VERSION, "modules": {n: m.spec for n, m in real_modules(model)}}


def save_real(model: nn.Module, save_dir) -> Path:
    """Write ``model``'s real checkpoint into ``save_dir`` (created if needed); returns the safetensors path."""
    from ..conversion.utils import named_quantizers

    leftover = [n for n, _ in named_quantizers(model)]
    if leftover:
        raise ValueError(
            f"save_real: the model still has fake-quant modules ({leftover[0]!r}, ...); a real "
            "checkpoint can only hold real and float modules"
        )
    save_file, _, _ = _safetensors()
    cfg = checkpoint_config(model)
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    text = json.dumps(cfg, indent=1, sort_keys=True)
    path = out / WEIGHTS_NAME
    save_file(tensors, str(path), metadata={"modelopt_lite": text})
    (out / CONFIG_NAME).write_text(text + "\n", encoding="utf-8")
    return path


def _resolve(path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS_NAME
    if not p.is_file():
        raise FileNotFoundError(
            f"no real checkpoint at {str(path)!r} (expected a directory holding {WEIGHTS_NAME} "
            "or the .safetensors file itself)"
        )
    return p


def read_checkpoint(path) -> tuple[dict, dict]:
    """``(config, tensors)`` of a real checkpoint (directory or safetensors file)."""
    _, load_file, safe_open = _safetensors()
    p = _resolve(path)
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata() or {}
    text = meta.get("modelopt_lite")
    if text is None and (p.parent / CONFIG_NAME).is_file():
        text = (p.parent / CONFIG_NAME).read_text(encoding="utf-8")
    if text is None:
        raise ValueError(f"{p}: not a modelopt_lite real checkpoint (no config in the metadata or {CONFIG_NAME})")
    cfg = json.loads(text)
    if cfg.get("format") != FORMAT or cfg.get("version") != VERSION:
        raise ValueError(f"{p}: unsupported checkpoint format {cfg.get('format')!r} version {cfg.get('version')!r}")
    return cfg, load_file(str(p))


def _expected_float(spec: dict) -> type:
    return {"QuantizedLinear": nn.Linear, "QuantizedConv2d": nn.Conv2d}[spec["type"]]


def _plan(model: nn.Module, cfg: dict, tensors: dict, backend: str):
    """Validate everything; returns the real modules to install (nothing is modified here)."""
    from .convert import build_real_module

    specs = cfg["modules"]
    built = {}
    for name, spec in specs.items():
        try:
            float_mod = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"load_real: tensor {name + '.weight'!r}: the model has no module {name!r} (a different architecture?)"
            ) from None
        want = _expected_float(spec)
        if type(float_mod) is not want:
            raise ValueError(
                f"load_real: tensor {name + '.weight'!r}: module {name!r} is {type(float_mod).__name__}, "
                f"the checkpoint holds a {spec['type']} converted from {want.__name__}"
            )
        w = getattr(float_mod, "weight", None)
        if not isinstance(w, torch.Tensor) or list(w.shape) != list(spec["weight_shape"]):
            raise ValueError(
                f"load_real: tensor {name + '.weight'!r}: shape {list(spec['weight_shape'])} in the "
                f"checkpoint, {list(w.shape) if isinstance(w, torch.Tensor) else None} in the model"
            )
        built[name] = build_real_module(spec, None, backend, device=w.device)
    # the expected state dict: float tensors of the model, with real modules' buffers in place of theirs
    expected: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        owner = next((n for n in built if key.startswith(n + ".")), None)
        if owner is None:
            expected[key] = t
    for n, mod in built.items():
        for k, t in mod.state_dict().items():
            expected[f"{n}.{k}"] = t
    for key, t in expected.items():
        if key not in tensors:
            raise ValueError(f"load_real: tensor {key!r} is missing from the checkpoint (a different architecture?)")
        c = tensors[key]
        if tuple(c.shape) != tuple(t.shape) or c.dtype != t.dtype:
            raise ValueError(
                f"load_real: tensor {key!r}: checkpoint has {c.dtype} {tuple(c.shape)}, the model "
                f"expects {t.dtype} {tuple(t.shape)}"
            )
    extra = [k for k in tensors if k not in expected]
    if extra:
        raise ValueError(
            f"load_real: tensor {extra[0]!r} in the checkpoint has no place in the model "
            f"({len(extra)} unexpected tensor(s); a different architecture?)"
        )
    return built


def load_real(model: nn.Module, path, backend: str = "auto") -> nn.Module:
    """Rebuild a real quantized model from a checkpoint on a fresh FLOAT model of the same architecture.

    The float modules named in the checkpoint are replaced by real modules; every tensor (codes, scales, biases and
    the other float parameters and buffers) is loaded bit for bit. Returns ``model`` (modified in place).

    Raises:
        ValueError: the architecture differs (names the first mismatching tensor); nothing is modified then.
        FileNotFoundError: no checkpoint at ``path``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_real expects an nn.Module, got {type(model).__name__}")
    cfg, tensors = read_checkpoint(path)
    built = _plan(model, cfg, tensors, backend)
    for name, mod in built.items():
        old = model.get_submodule(name)
        mod.train(old.training)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, mod)
    with torch.no_grad():
        sd = model.state_dict()
        for key, t in sd.items():
            t.copy_(tensors[key])
    return model


def real_quant(model: nn.Module, n_bits: int, num_steps: int, ckpt_path, backend: str = "auto") -> nn.Module:
    """Seed-style loader: :func:`load_real` plus a check that the checkpoint holds ``n_bits`` activations and
    ``num_steps`` temporal steps (ValueError naming the first module that differs)."""
    cfg, _ = read_checkpoint(ckpt_path)
    for name, spec in cfg["modules"].items():
        inp = spec.get("input")
        bits = inp["num_bits"] if inp else spec["weight"]["num_bits"]
        steps = inp["num_steps"] if inp else 1
        if bits != n_bits or (inp is not None and steps != num_steps):
            raise ValueError(
                f"real_quant: module {name!r} in {os.fspath(ckpt_path)!r} has n_bits={bits}, "
                f"num_steps={steps}; expected n_bits={n_bits}, num_steps={num_steps}"
            )
    return load_real(model, ckpt_path, backend)
