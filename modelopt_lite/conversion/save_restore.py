"""Save the quantization state of a model and re-create it on a fresh float model.

``save(model, path)`` writes two files side by side: ``<path>.json`` (the converted modules, and per quantizer its
descriptor, enable flags and ``num_steps``) and ``<path>.safetensors`` (every quantizer tensor: amax, per-step amax,
learned amax). ``restore(model, path)`` converts a fresh float model the same way, applies the saved settings and
loads the tensors, so its outputs are bit-identical to the saved model's (given the same float weights; pass
``include_weights=True`` to store the weights too, e.g. after QAT).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..descriptor import ScaledQuantDescriptor
from ..functional import deferred_errors
from ..nn import SequentialQuantizer, TensorQuantizer
from ..nn._quantizer_config import PEER_DEFAULTS
from ..nn.modules._base import module_device
from .config import DESCRIPTOR_KEYS
from .model_quant import _Replacements, set_quantizer_names
from .registry import REGISTRY
from .requant import check_mode
from .state import snapshot_quantizers
from .state_file import (
    FORMAT,
    TENSOR_METADATA,
    VERSION,
    bad,
    check_doc,
    check_quantizer_tensor,
    decode,
    read_json,
    read_tensors,
    sha256_of,
)
from .utils import named_quantizers, quantizer_sites

_WEIGHTS_PREFIX = "__model__."
_TAGS = ("__tuple__", "__dict__")


def _paths(path) -> tuple[Path, Path]:
    p = Path(path)
    if p.suffix in (".json", ".safetensors"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".safetensors")


def _encode(v):
    """JSON-safe, exactly reversible form of descriptor values (tuples and int-keyed dicts are tagged)."""
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in v):
            return {k: _encode(x) for k, x in v.items()}
        return {"__dict__": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    return v


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _own_param_shapes(m: nn.Module) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in m.named_parameters(recurse=False)}


def _quantizer_record(q) -> dict:
    return {
        "descriptor": _encode(q.quant_desc.dict()),
        "enabled": bool(q.is_enabled),
        "quant": bool(q.is_quant_enabled),
        "calib": bool(q.is_calib_enabled),
        "num_steps": int(getattr(q, "num_steps", 1) or 1),
        "peer": {k: getattr(q, k) for k in PEER_DEFAULTS},  # ModelOpt's trt_high_precision_dtype, pass_through_bwd...
        "tensors": sorted(q.state_dict().keys()),
        "bias": _encode(q.bias),  # the affine bias config (None: none)
    }


def save(model: nn.Module, path, *, include_weights: bool = False) -> tuple[Path, Path]:
    """Write the quantization state of ``model`` to ``<path>.json`` and ``<path>.safetensors``; returns both paths.

    ``path`` may end in ``.json`` or ``.safetensors`` (the suffix is replaced). With ``include_weights`` the whole
    ``state_dict`` of the model is stored too and loaded back by :func:`restore`.
    """
    deferred_errors.check_errors()  # a sync point: pending CUDA value errors raise before saving
    from safetensors.torch import save_file

    lowrank = [n for n, q in named_quantizers(model) if getattr(q, "has_lowrank", False)]
    if lowrank and not include_weights:
        raise ValueError(
            f"save: {len(lowrank)} quantizer(s) have SVDQuant low-rank factors (first: {lowrank[0]!r}), so the "
            "model's weights are the residuals W - B @ A and a fresh float model cannot reproduce it: save with "
            "include_weights=True"
        )
    smoothed = [n for n, q in named_quantizers(model) if q.pre_quant_scale is not None]
    if smoothed and not include_weights:
        raise ValueError(
            f"save: {len(smoothed)} quantizer(s) have a SmoothQuant pre_quant_scale (first: "
            f"{smoothed[0]!r}), so the model's weights were rescaled and a fresh float model cannot "
            "reproduce it: save with include_weights=True"
        )
    json_path, st_path = _paths(path)
    modules = []
    for name, m in model.named_modules():
        float_cls = REGISTRY.float_class_of(type(m))
        if float_cls is not None:
            modules.append(
                {
                    "name": name,
                    "float_cls": _qualname(float_cls),
                    "quant_cls": _qualname(type(m)),
                    "params": _own_param_shapes(m),
                    "requant": getattr(m, "requant", "float"),
                }
            )
    quantizers, tensors = {}, {}
    for name, q in named_quantizers(model):
        if getattr(q, "amax_pre", None) is not None:
            raise ValueError(
                f"save: quantizer {name!r} is in LSQ mode (learned amax_pre / amax_post), which the saved format "
                "does not hold: set its learned amax as .amax and call disable_lsq() first"
            )
        quantizers[name] = _quantizer_record(q)
        for k, v in q.state_dict().items():
            tensors[f"{name}.{k}" if name else k] = v.detach().cpu().contiguous()
    if include_weights:
        for k, v in model.state_dict().items():
            tensors[_WEIGHTS_PREFIX + k] = v.detach().cpu().contiguous().clone()
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "modules": modules,
        "quantizers": quantizers,
        "include_weights": include_weights,
        "torch": torch.__version__,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(st_path), metadata=TENSOR_METADATA)
    doc["tensors_sha256"] = sha256_of(st_path)  # restore refuses a tensor file of another save or a changed one
    json_path.write_text(json.dumps(doc, indent=1, sort_keys=False))
    return json_path, st_path


def _first_mismatch(model: nn.Module, records: list[dict]) -> str | None:
    by_name = {r["name"]: r for r in records}
    seen: set[str] = set()
    for name, m in model.named_modules():
        rec = by_name.get(name)
        eligible = REGISTRY.get(type(m)) is not None or REGISTRY.float_class_of(type(m)) is not None
        if rec is None:
            if eligible and not any(name.startswith(r + ".") for r in seen if r):
                return f"module {name!r} ({type(m).__name__}) is not quantized in the saved state"
            continue
        seen.add(name)
        if _qualname(type(m)) not in (rec["float_cls"], rec["quant_cls"]):
            return (
                f"module {name!r} is a {_qualname(type(m))}, the saved state has {rec['float_cls']} "
                f"(quantized as {rec['quant_cls']})"
            )
        shapes = _param_shapes(m, rec)
        if shapes != rec["params"]:
            return f"module {name!r} has parameters {shapes}, the saved state has {rec['params']}"
    converting = [n for n in seen if _qualname(type(model.get_submodule(n) if n else model)) != by_name[n]["quant_cls"]]
    missing = [  # a module created by its parent's conversion (the per-expert Linears of DBRX) is checked then
        r["name"] for r in records if r["name"] not in seen and not any(_under(r["name"], p) for p in converting)
    ]
    if missing:
        return f"module {missing[0]!r} of the saved state does not exist in the model"
    return None


def _param_shapes(m: nn.Module, rec: dict) -> dict[str, list[int]]:
    """``m``'s own parameter shapes as the saved quantized module has them."""
    converted = getattr(REGISTRY.get(type(m)), "converted_param_shapes", None)
    if converted is not None and _qualname(type(m)) == rec["float_cls"]:
        return converted(m)  # a float module whose conversion reshapes its parameters (HF Conv1D, DBRX experts)
    return _own_param_shapes(m)


def _under(name: str, parent: str) -> bool:
    return not parent or name.startswith(parent + ".")


def _quant_class_for(m: nn.Module, rec: dict, path) -> type:
    """The registered quant class of ``m``'s type; the file's ``quant_cls`` string must name it (never imported)."""
    quant_cls = REGISTRY.get(type(m))
    if quant_cls is None or _qualname(quant_cls) != rec["quant_cls"]:
        now = "nothing" if quant_cls is None else _qualname(quant_cls)
        raise bad(
            path,
            f"module {rec['name']!r}",
            f"quant_cls {rec['quant_cls']!r} is not the class registered for {_qualname(type(m))} ({now}); "
            "classes are only taken from the quantization registry (modelopt_lite.register)",
        )
    return quant_cls


def _convert_recorded(model: nn.Module, records: list[dict], undo: _Replacements, path) -> nn.Module:
    memo: dict[int, nn.Module] = {}
    for rec in records:
        name = rec["name"]
        try:
            m = model.get_submodule(name) if name else model
        except AttributeError:
            raise bad(path, f"module {name!r}", "does not exist in the model once its parents are converted") from None
        shapes = _param_shapes(m, rec)
        if shapes != rec["params"]:  # checked before for all but the modules created by their parent's conversion
            raise bad(path, f"module {name!r}", f"has parameters {shapes}, the saved state has {rec['params']}")
        if _qualname(type(m)) == rec["quant_cls"] and REGISTRY.float_class_of(type(m)) is not None:
            continue
        new = memo.get(id(m))
        if new is None:
            quant_cls: Any = _quant_class_for(m, rec, path)
            new = memo[id(m)] = quant_cls.from_float(m)
            new.train(m.training)
        model = undo.put(model, name, new)
    return model


def _apply_record(name: str, site, rec: dict, tensors: dict, json_path, path) -> None:
    q = site.quantizer
    entry = f"quantizers[{name!r}]"
    try:
        desc = ScaledQuantDescriptor(**decode(rec["descriptor"], json_path, entry + ".descriptor"))
        attrs = {k: getattr(desc, k) for k in DESCRIPTOR_KEYS}
        if attrs.get("amax") is not None:
            attrs["amax"] = attrs["amax"].tolist()
        attrs["num_steps"] = rec["num_steps"]
        attrs.update(rec.get("peer", {}))  # absent in files written before these settings existed
        attrs["bias"] = decode(rec.get("bias"), json_path, entry + ".bias")
        q.set_from_attribute_config(attrs)
    except (TypeError, ValueError, KeyError) as e:
        if str(e).startswith("restore: "):
            raise
        raise bad(json_path, entry + ".descriptor", f"{type(e).__name__}: {e}") from None
    (q.enable if rec["enabled"] else q.disable)()
    (q.enable_quant if rec["quant"] else q.disable_quant)()
    (q.enable_calib if rec["calib"] else q.disable_calib)()
    prefix = f"{name}." if name else ""
    state = {}
    for k in rec["tensors"]:
        key = prefix + k
        if key not in tensors:
            raise bad(path, key, f"is missing from the tensor file ({entry} lists it)")
        check_quantizer_tensor(path, key, tensors[key], q, site.owner, site.local)
        state[k] = tensors[key]
    try:
        q.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError, TypeError) as e:
        raise bad(path, entry, f"{type(e).__name__}: {e}") from None


def _load_weights(model: nn.Module, tensors: dict, quantizer_keys: set, path) -> None:
    """The model's own tensors (``include_weights``): same names, shapes and dtypes as the model's."""
    n = len(_WEIGHTS_PREFIX)
    saved = {k[n:]: v for k, v in tensors.items() if k.startswith(_WEIGHTS_PREFIX)}
    expected = model.state_dict()
    for k, t in expected.items():
        entry = _WEIGHTS_PREFIX + k
        if k not in saved:
            raise bad(path, entry, "is missing from the tensor file")
        c = saved[k]
        if c.dtype != t.dtype or c.shape != t.shape:
            raise bad(path, entry, f"is {c.dtype} {tuple(c.shape)}, the model has {t.dtype} {tuple(t.shape)}")
        if k in quantizer_keys and not torch.equal(c, tensors[k]):
            raise bad(path, entry, f"differs from the quantizer's own entry {k!r}")
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise bad(path, _WEIGHTS_PREFIX + extra[0], "has no place in the model")
    model.load_state_dict(saved, strict=True)


#: the most quantizers a saved SequentialQuantizer may chain (a bound on what an untrusted file can make us build)
MAX_SEQUENTIAL = 8


def _rebuild_sequential(model: nn.Module, saved: dict, undo: _Replacements) -> None:
    """A quantizer saved as a :class:`SequentialQuantizer` (entries ``name.0``, ``name.1``... instead of ``name``)
    becomes one of that length again (fresh ``TensorQuantizer``s, configured by their records next)."""
    for site in quantizer_sites(model):
        if site.name in saved or not isinstance(site.quantizer, TensorQuantizer) or site.owner is None:
            continue
        n = 0
        while f"{site.name}.{n}" in saved and n <= MAX_SEQUENTIAL:
            n += 1
        if n == 0:
            continue
        if n > MAX_SEQUENTIAL:
            raise ValueError(f"restore: quantizer {site.name!r} chains more than {MAX_SEQUENTIAL} quantizers")
        seq = SequentialQuantizer(*(TensorQuantizer() for _ in range(n))).to(module_device(site.owner))
        undo.done.append((site.owner, site.local, site.quantizer))
        setattr(site.owner, site.local, seq)


def restore(model: nn.Module, path) -> nn.Module:
    """Re-create the saved quantization state on ``model`` (float, or already converted the same way); returns it.

    The files are untrusted: every entry is validated (see :mod:`.state_file`) and module classes are taken from
    the quantization registry only, never imported by the name the file gives.

    Raises:
        ValueError: the files are not a valid saved quantization state (the message names the file, the entry and
            the bad value), or ``model`` differs from the saved one (the message names the first differing module
            or quantizer); ``model`` is left unchanged then.
        FileNotFoundError: one of the two files is missing.
    """
    deferred_errors.check_errors()  # a sync point: pending CUDA value errors raise before loading
    json_path, st_path = _paths(path)
    doc = read_json(json_path)
    check_doc(doc, json_path)
    tensors = read_tensors(st_path, doc.get("tensors_sha256"))
    problem = _first_mismatch(model, doc["modules"])
    if problem:
        raise ValueError(f"restore: the model does not match the saved state: {problem}")
    before = snapshot_quantizers(q for _, q in named_quantizers(model))
    undo = _Replacements()
    try:
        model = _convert_recorded(model, doc["modules"], undo, json_path)
        saved = doc["quantizers"]
        _rebuild_sequential(model, saved, undo)
        set_quantizer_names(model)
        present = {s.name: s for s in quantizer_sites(model)}
        for name in present:
            if name not in saved:
                raise ValueError(f"restore: the model has quantizer {name!r}, which the saved state does not")
        for name in saved:
            if name not in present:
                raise ValueError(f"restore: quantizer {name!r} of the saved state does not exist in the model")
        used = {(f"{n}." if n else "") + k for n, rec in saved.items() for k in rec["tensors"]}
        include_weights = doc.get("include_weights", False)
        extra = sorted(k for k in tensors if k not in used and not (include_weights and k.startswith(_WEIGHTS_PREFIX)))
        if extra:
            raise bad(st_path, extra[0], "is not listed by any quantizer of the saved state")
        for name, rec in saved.items():
            _apply_record(name, present[name], rec, tensors, json_path, st_path)
        if include_weights:
            _load_weights(model, tensors, used, st_path)
        modes: list[tuple[Any, str]] = [  # (module with a settable ``requant``, mode)
            (model.get_submodule(r["name"]) if r["name"] else model, check_mode(r.get("requant", "float")))
            for r in doc["modules"]
        ]
        for m, mode in modes:
            if hasattr(m, "requant"):
                m.requant = mode
    except BaseException:
        undo.undo()
        before.restore()
        raise
    return model
