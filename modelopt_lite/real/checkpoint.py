"""Compact real-quantized checkpoints: a safetensors file (int8/int4 codes, scales, float tensors) + a JSON config.

Layout of ``save_dir``:

- ``model_int8.safetensors``: the real model's ``state_dict`` (int8 ``weight`` / uint8 ``weight_packed`` codes,
  float32 ``weight_scale`` and ``input_scale``, biases and every other float tensor as they are). The JSON config is
  also stored in the file's metadata under ``"modelopt_lite"``, so the file alone is enough to load.
- ``model_int8.json``: ``{"format": "modelopt_lite.real", "version": 1, "modules": {name: spec}, "float": [...]}``
  where each spec describes one real module (see :mod:`.convert`).

:func:`load_real` rebuilds the real model on a fresh FLOAT model of the same architecture; anything that does not
match raises ValueError naming the first mismatching tensor, before the model is touched. The files are untrusted:
the config is parsed strictly and every spec validated (:mod:`.spec_checks`), the codes must lie in their declared
range and the scales must be finite and positive; a corrupt or truncated file is a ValueError naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..conversion.utils import named_quantizers
from . import fast_gemm
from .pooling import pool_args
from .real_types import FLOAT_CLASSES, POOL_DIMS, WEIGHTED_TYPES, all_real_modules, build_real_module
from .spec_checks import FORMAT, VERSION, bad, check_config, check_values

WEIGHTS_NAME, CONFIG_NAME = "model_int8.safetensors", "model_int8.json"
__all__ = [
    "CONFIG_NAME",
    "DIGEST_KEY",
    "FORMAT",
    "VERSION",
    "WEIGHTS_NAME",
    "load_real",
    "read_checkpoint",
    "real_quant",
    "save_real",
    "tensors_digest",
]


def _safetensors():
    try:
        from safetensors.torch import load_file, safe_open, save_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("real checkpoints need safetensors: pip install safetensors") from e
    return save_file, load_file, safe_open


#: the metadata key of the tensors' SHA-256 (tensors_digest), recorded by save_real and checked by load_real
DIGEST_KEY = "modelopt_lite_sha256"


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict: each tensor's name, dtype, shape and bytes, in name order. A changed code or
    scale changes it even where the value stays valid (a code in range, a positive scale)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_config(model: nn.Module) -> dict:
    """The JSON config describing the real modules of ``model``."""
    return {"format": FORMAT, "version": VERSION, "modules": {n: m.spec for n, m in all_real_modules(model)}}


def save_real(model: nn.Module, save_dir) -> Path:
    """Write ``model``'s real checkpoint into ``save_dir`` (created if needed); returns the safetensors path."""
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
    save_file(tensors, str(path), metadata={"modelopt_lite": text, DIGEST_KEY: tensors_digest(tensors)})
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


def _no_constants(name: str):
    raise ValueError(f"the JSON literal {name} is not allowed")


def read_checkpoint(path) -> tuple[dict, dict]:
    """``(config, tensors)`` of a real checkpoint (directory or safetensors file), with the config validated.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: a corrupt or truncated file, invalid JSON, or a malformed config (naming file and entry).
    """
    _, load_file, safe_open = _safetensors()
    p = _resolve(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(p))
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt files
        raise ValueError(f"load_real: {p} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    digest = meta.get(DIGEST_KEY)  # absent in files written before it existed
    if digest is not None and digest != tensors_digest(tensors):
        raise ValueError(
            f"load_real: {p}: its tensors do not have the SHA-256 recorded when it was saved ({digest!r}): a "
            "corrupted file, or one whose tensors were changed"
        )
    text, source = meta.get("modelopt_lite"), p
    if text is None and (p.parent / CONFIG_NAME).is_file():
        source = p.parent / CONFIG_NAME
        try:
            text = source.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"load_real: {source} is not a UTF-8 JSON file ({e})") from e
    if text is None:
        raise ValueError(f"{p}: not a modelopt_lite real checkpoint (no config in the metadata or {CONFIG_NAME})")
    try:
        cfg = json.loads(text, parse_constant=_no_constants)
    except ValueError as e:
        raise ValueError(f"load_real: {source}: the config is not valid JSON ({e})") from e
    check_config(cfg, source)
    return cfg, tensors


def _check_float_module(path, name: str, spec: dict, float_mod: nn.Module) -> None:
    """The float module the spec replaces has the spec's class and arguments."""
    kind, want = spec["type"], FLOAT_CLASSES[spec["type"]]
    if type(float_mod) is not want:
        raise ValueError(
            f"load_real: {path}: module {name!r} is {type(float_mod).__name__}, the checkpoint holds a {kind} converted "
            f"from {want.__name__} (a different architecture?)"
        )
    if kind not in WEIGHTED_TYPES:
        got = pool_args(float_mod, POOL_DIMS[kind])
        if got != spec["pool"]:
            raise bad(path, f"modules[{name!r}].pool", f"is {spec['pool']}, the model's {want.__name__} has {got}")
        return
    assert isinstance(float_mod, (nn.Linear, nn.Conv2d))  # its type is FLOAT_CLASSES[kind] (checked above)
    w = float_mod.weight
    if list(w.shape) != list(spec["weight_shape"]):
        raise ValueError(
            f"load_real: {path}: tensor {name + '.weight'!r}: shape {list(spec['weight_shape'])} in the "
            f"checkpoint, {list(w.shape)} in the model"
        )
    if kind == "QuantizedConv2d":
        assert isinstance(float_mod, nn.Conv2d)
        p = float_mod.padding
        got = {
            "stride": list(float_mod.stride),
            "padding": p if isinstance(p, str) else list(p),
            "dilation": list(float_mod.dilation),
            "groups": float_mod.groups,
            "padding_mode": float_mod.padding_mode,
        }
        if got != spec["conv"]:
            raise bad(path, f"modules[{name!r}].conv", f"is {spec['conv']}, the model's Conv2d has {got}")


def _module_device(m: nn.Module):
    t: torch.Tensor | None = next(iter(m.parameters()), None)
    if t is None:
        t = next(iter(m.buffers()), None)
    return None if t is None else t.device


def _plan(model: nn.Module, cfg: dict, tensors: dict, backend: str, path=None):
    """Validate everything; returns the real modules to install (nothing is modified here)."""
    specs = cfg["modules"]
    built = {}
    for name, spec in specs.items():
        try:
            float_mod = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"load_real: {path}: tensor {name + '.weight'!r}: the model has no module {name!r} (a different architecture?)"
            ) from None
        _check_float_module(path, name, spec, float_mod)
        inp = spec.get("input")
        if inp is not None and inp.get("dynamic") is None:  # its length sizes a buffer: checked before allocating
            t = tensors.get(f"{name}.input_scale")
            if t is None or tuple(t.shape) != (inp["num_steps"],):
                got = None if t is None else tuple(t.shape)
                raise bad(path, f"{name}.input_scale", f"has shape {got}, the spec declares ({inp['num_steps']},)")
        why = fast_gemm.why_not(spec, backend) if spec["type"] in WEIGHTED_TYPES else None
        if why is not None:
            raise ValueError(f"load_real: module {name!r} ({fast_gemm.describe(spec)}): backend {backend!r}: {why}")
        built[name] = build_real_module(spec, None, backend, device=_module_device(float_mod))
        built[name].label = name
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
            raise ValueError(
                f"load_real: {path}: tensor {key!r} is missing from the checkpoint (a different architecture?)"
            )
        c = tensors[key]
        if tuple(c.shape) != tuple(t.shape) or c.dtype != t.dtype:
            raise ValueError(
                f"load_real: {path}: tensor {key!r}: checkpoint has {c.dtype} {tuple(c.shape)}, the model "
                f"expects {t.dtype} {tuple(t.shape)}"
            )
    extra = [k for k in tensors if k not in expected]
    if extra:
        raise ValueError(
            f"load_real: {path}: tensor {extra[0]!r} in the checkpoint has no place in the model "
            f"({len(extra)} unexpected tensor(s); a different architecture?)"
        )
    for name, spec in specs.items():
        check_values(path, name, spec, tensors)
    return built


def load_real(model: nn.Module, path, backend: str = "auto") -> nn.Module:
    """Rebuild a real quantized model from a checkpoint on a fresh FLOAT model of the same architecture.

    The float modules named in the checkpoint are replaced by real modules; every tensor (codes, scales, biases and
    the other float parameters and buffers) is loaded bit for bit. Returns ``model`` (modified in place).

    Raises:
        ValueError: the architecture differs (names the first mismatching tensor), or the checkpoint is corrupt or
            malformed (names the file, the entry and the bad value); nothing is modified then.
        FileNotFoundError: no checkpoint at ``path``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_real expects an nn.Module, got {type(model).__name__}")
    cfg, tensors = read_checkpoint(path)
    built = _plan(model, cfg, tensors, backend, _resolve(path))
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
