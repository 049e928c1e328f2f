"""Reading and validating the files :func:`modelopt_lite.save` writes (the ``restore`` side).

The files are untrusted input: the JSON is parsed strictly (no NaN/Infinity literals), every entry is checked for
its type, and every tensor for its name, dtype, shape (against what the quantizer's descriptor and the module it
belongs to expect), finiteness and sign before anything is loaded. Nothing a file names is ever imported: module
classes are resolved through the quantization registry only. Problems raise ValueError naming the file, the entry
and the bad value.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TypeGuard

import torch

from ..functional import blocks
from ..functional.checks import check_axes, first_bad
from ..nn._affine_bias import bias_value_problem, check_bias_config
from ..nn._quantizer_config import PEER_DEFAULTS, check_peer_extra
from .requant import check_mode

FORMAT = "modelopt_lite.quant_state"
VERSION = 1
#: the tensors a quantizer may hold in the file
QUANTIZER_TENSORS = (
    "_amax",
    "_global_amax",  # static NVFP4's per-tensor amax
    "_pre_quant_scale",
    "_bias_value",
    "_svdquant_lora_a",
    "_svdquant_lora_b",
    "clip.clip_value_min",  # the learned clip stage of a learn_amax quantizer (pytorch-quantization's if_clip)
    "clip.clip_value_max",
)
_TAGS = ("__tuple__", "__dict__")
#: the metadata :func:`modelopt_lite.save` gives its tensor file
TENSOR_METADATA = {"format": FORMAT, "version": str(VERSION)}
#: the keys :func:`modelopt_lite.save` writes; any other key is a newer version's file or a corrupted one
DOC_KEYS = ("format", "version", "modules", "quantizers", "include_weights", "torch", "tensors_sha256")
MODULE_KEYS = ("name", "float_cls", "quant_cls", "params", "requant")
QUANTIZER_KEYS = ("descriptor", "enabled", "quant", "calib", "num_steps", "peer", "tensors", "bias")


def bad(path, entry: str, why: str) -> ValueError:
    """The one error type of a malformed file: ``restore: <file>: <entry>: <why>``."""
    return ValueError(f"restore: {path}: {entry}: {why}")


def _no_constants(name: str):
    raise ValueError(f"the JSON literal {name} is not allowed")


def read_json(path: Path) -> dict:
    """The parsed document of ``path`` (ValueError naming the file when it is not a strict JSON object)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"restore: no saved quantization state at {path}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"restore: {path} is not a UTF-8 JSON file ({e})") from e
    try:
        doc = json.loads(text, parse_constant=_no_constants)
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"restore: {path} is not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"restore: {path} is not a {FORMAT} v{VERSION} file")
    return doc


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex (what the JSON file records of its tensor file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_tensors(path: Path, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file. ValueError naming the file when it is truncated or corrupt, when its
    metadata names another format (save writes TENSOR_METADATA; a file rewritten by other tools may have none), or
    when ``sha256`` (the JSON file's record of the tensor file it was saved with) differs: a tensor file of another
    save, or one whose bytes changed."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"restore: no tensor file {path} next to the JSON file")
    actual = sha256_of(path) if sha256 is not None else None
    if actual != sha256:
        raise ValueError(
            f"restore: {path} is not the tensor file its JSON file was saved with (SHA-256 {actual}, the JSON file "
            f"records {sha256}): a tensor file of another save, or a corrupted one"
        )
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt headers
        raise ValueError(f"restore: {path} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    if meta and meta != TENSOR_METADATA:
        raise ValueError(f"restore: {path} is not a {FORMAT} v{VERSION} tensor file (its metadata: {meta!r})")
    return tensors


def check_keys(rec: dict, known: tuple[str, ...], path, entry: str) -> None:
    """ValueError for keys of ``rec`` that save does not write."""
    unknown = sorted(str(k) for k in rec if k not in known)
    if unknown:
        raise bad(path, entry, f"has unknown key(s) {unknown} (a newer version's file, or a corrupted one)")


def decode(v, path, entry: str):
    """Inverse of the tagged encoding of descriptor values (tuples and int-keyed dicts), strictly."""
    if isinstance(v, dict):
        if "__tuple__" in v:
            if set(v) != {"__tuple__"} or not isinstance(v["__tuple__"], list):
                raise bad(path, entry, f"malformed tuple {v!r}")
            return tuple(decode(x, path, entry) for x in v["__tuple__"])
        if "__dict__" in v:
            pairs = v["__dict__"]
            if (
                set(v) != {"__dict__"}
                or not isinstance(pairs, list)
                or any(not isinstance(p, list) or len(p) != 2 for p in pairs)
            ):
                raise bad(path, entry, f"malformed dict {v!r}")
            out = {}
            for k, x in pairs:
                k = decode(k, path, entry)
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise bad(path, entry, f"dict key {k!r} is not a str or an int")
                out[k] = decode(x, path, entry)
            return out
        return {k: decode(x, path, entry) for k, x in v.items()}
    if isinstance(v, list):
        return [decode(x, path, entry) for x in v]
    return v


def _is_int(v) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def check_doc(doc: dict, path) -> None:
    """Types of every entry of the JSON document (before any of it is used)."""
    check_keys(doc, DOC_KEYS, path, "document")
    if not isinstance(doc.get("torch", ""), str):
        raise bad(path, "torch", f"must be a string, got {doc.get('torch')!r}")
    digest = doc.get("tensors_sha256")  # absent in files written before it existed
    if digest is not None and (
        not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)
    ):
        raise bad(path, "tensors_sha256", f"must be 64 lowercase hex digits, got {digest!r}")
    modules = doc.get("modules")
    if not isinstance(modules, list):
        raise bad(path, "modules", f"must be a list, got {type(modules).__name__}")
    names = set()
    for i, rec in enumerate(modules):
        entry = f"modules[{i}]"
        if not isinstance(rec, dict):
            raise bad(path, entry, f"must be an object, got {type(rec).__name__}")
        check_keys(rec, MODULE_KEYS, path, entry)
        for key in ("name", "float_cls", "quant_cls"):
            if not isinstance(rec.get(key), str):
                raise bad(path, f"{entry}.{key}", f"must be a string, got {rec.get(key)!r}")
        if rec["name"] in names:
            raise bad(path, f"{entry}.name", f"module {rec['name']!r} is listed twice")
        names.add(rec["name"])
        params = rec.get("params")
        if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(s, list) and all(_is_int(n) and n >= 0 for n in s)
            for k, s in params.items()
        ):
            raise bad(path, f"{entry}.params", f"must map parameter names to shapes, got {params!r}")
        try:
            check_mode(rec.get("requant", "float"))
        except ValueError as e:
            raise bad(path, f"{entry}.requant", str(e)) from None
    quantizers = doc.get("quantizers")
    if not isinstance(quantizers, dict):
        raise bad(path, "quantizers", f"must be an object, got {type(quantizers).__name__}")
    for name, rec in quantizers.items():
        entry = f"quantizers[{name!r}]"
        if not isinstance(rec, dict):
            raise bad(path, entry, f"must be an object, got {type(rec).__name__}")
        check_keys(rec, QUANTIZER_KEYS, path, entry)
        if not isinstance(rec.get("descriptor"), dict):
            raise bad(path, f"{entry}.descriptor", f"must be an object, got {rec.get('descriptor')!r}")
        for key in ("enabled", "quant", "calib"):
            if not isinstance(rec.get(key), bool):
                raise bad(path, f"{entry}.{key}", f"must be true or false, got {rec.get(key)!r}")
        n = rec.get("num_steps")
        if not _is_int(n) or n < 1:
            raise bad(path, f"{entry}.num_steps", f"must be an int >= 1, got {n!r}")
        peer = rec.get("peer", {})
        if not isinstance(peer, dict) or any(k not in PEER_DEFAULTS for k in peer):
            raise bad(path, f"{entry}.peer", f"must be an object with keys from {sorted(PEER_DEFAULTS)}, got {peer!r}")
        for k, v in peer.items():
            try:
                check_peer_extra(k, v, f"{entry}.peer")
            except (TypeError, ValueError) as e:
                raise bad(path, f"{entry}.peer.{k}", str(e)) from None
        try:  # the affine bias config (absent in files written before it existed)
            check_bias_config(decode(rec.get("bias"), path, f"{entry}.bias"), f"{entry}.bias")
        except (TypeError, ValueError) as e:
            raise bad(path, f"{entry}.bias", str(e)) from None
        ts = rec.get("tensors")
        if not isinstance(ts, list) or len(set(map(str, ts))) != len(ts) or any(t not in QUANTIZER_TENSORS for t in ts):
            raise bad(
                path, f"{entry}.tensors", f"must be a list of distinct names from {QUANTIZER_TENSORS}, got {ts!r}"
            )
    if not isinstance(doc.get("include_weights", False), bool):
        raise bad(path, "include_weights", f"must be true or false, got {doc.get('include_weights')!r}")


def _weight_shape(owner, local: str):
    w = getattr(owner, "weight", None) if local == "weight_quantizer" else None
    return tuple(w.shape) if isinstance(w, torch.Tensor) else None


def _amax_shape_problem(shape: tuple, q, owner, local: str) -> str | None:
    """Why an amax of ``shape`` does not fit quantizer ``q`` (None when it fits)."""
    steps = q.num_steps
    if steps > 1:
        if not shape or shape[0] != steps:
            return f"a temporal quantizer with num_steps={steps} needs a leading dimension of {steps}"
        shape = shape[1:]
    numel = int(torch.Size(shape).numel())
    wshape = _weight_shape(owner, local)
    bs, axis = q.block_sizes, q.axis
    if bs and q.quant_desc.per_block_amax:  # one amax per block (dynamic NVFP4: one per tensor, its global amax)
        if wshape is not None:
            want = blocks.blocks_shape(wshape, blocks.normalize(bs, wshape))
            return None if shape == want else f"block_sizes={bs} of a weight {wshape} need an amax of shape {want}"
        return None if len(shape) >= 1 else "block quantization needs one amax per block, got a scalar"
    if axis is None:
        return None if numel == 1 else "a per-tensor quantizer needs a single amax value"
    if wshape is not None:
        axes = check_axes(axis, len(wshape), "axis")
        keep = tuple(n if d in axes else 1 for d, n in enumerate(wshape))
        flat = (wshape[axes[0]],) if len(axes) == 1 else None
        return None if shape in (keep, flat) else f"axis={axis} of a weight {wshape} needs an amax of shape {keep}"
    if not shape:
        return f"a per-channel quantizer (axis={axis}) needs a per-channel amax, got a scalar"
    single = isinstance(axis, int) or len(tuple(axis)) == 1
    if len(shape) == 1 and single:
        return None  # a flat per-channel amax (reshaped to the input at use)
    try:
        axes = check_axes(axis, len(shape), "axis")
    except ValueError:
        return f"axis={axis} does not fit an amax of rank {len(shape)}"
    if any(n != 1 for d, n in enumerate(shape) if d not in axes):
        return f"axis={axis} needs size 1 on the reduced dimensions"
    return None


def lowrank_shape_problem(key: str, shape: tuple, owner, local: str) -> str | None:
    """Why an SVDQuant factor's shape does not fit its layer (``(rank, in)`` / ``(out, rank)``), or None."""
    w = getattr(owner, "weight", None)
    if local != "weight_quantizer" or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return "SVDQuant factors belong to the weight quantizer of a Linear"
    if len(shape) != 2:
        return f"must be 2-D, got shape {shape}"
    a = key.endswith("_a")
    dim, n = (1, w.shape[1]) if a else (0, w.shape[0])
    if shape[dim] != n or not 1 <= shape[1 - dim] <= min(w.shape):
        want = f"(rank, {w.shape[1]})" if a else f"({w.shape[0]}, rank)"
        return f"has shape {shape}, the layer's weight {tuple(w.shape)} needs {want} with 1 <= rank <= {min(w.shape)}"
    return None


def check_quantizer_tensor(path, key: str, t: torch.Tensor, q, owner, local: str) -> None:
    """dtype, shape, finiteness and sign of one quantizer tensor of the file."""
    if t.dtype != torch.float32:
        raise bad(path, key, f"must be float32, got {t.dtype}")
    if t.numel() == 0:
        raise bad(path, key, "is empty")
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        raise bad(path, key, f"must be finite, got {first_bad(t, ~finite)!r}")
    if key.endswith("_bias_value"):  # the static affine bias: any sign, the configured shape
        problem = bias_value_problem(q.bias, tuple(t.shape))
        if problem:
            raise bad(path, key, f"shape {tuple(t.shape)} does not fit: {problem}")
        return
    if key.endswith(("clip.clip_value_min", "clip.clip_value_max")):  # one learned bound, any sign
        if t.numel() != 1:
            raise bad(path, key, f"a clip bound is one value, got shape {tuple(t.shape)}")
        return
    if key.endswith(("_svdquant_lora_a", "_svdquant_lora_b")):
        problem = lowrank_shape_problem(key, tuple(t.shape), owner, local)
        if problem:
            raise bad(path, key, problem)
        return
    if key.endswith("_global_amax"):
        if not q.quant_desc.nvfp4_static or t.numel() != 1 or not bool((t >= 0).all()):
            raise bad(path, key, f"a global amax is one value >= 0 of a static NVFP4 quantizer, got {t.tolist()!r}")
        return
    if key.endswith("_pre_quant_scale"):
        if t.dim() != 1:
            raise bad(path, key, f"must be 1-D (one value per input channel), got shape {tuple(t.shape)}")
        w = getattr(owner, "weight", None)
        if local == "input_quantizer" and isinstance(w, torch.Tensor) and w.dim() == 2 and t.numel() != w.shape[1]:
            raise bad(path, key, f"has {t.numel()} channels, the layer has {w.shape[1]} inputs")
        if not bool((t > 0).all()):
            raise bad(path, key, f"must be > 0, got {t[t <= 0][0].item()!r}")
        return
    if q.dynamic:
        raise bad(path, key, "a dynamic quantizer stores no amax")
    if not bool((t >= 0).all()):
        raise bad(path, key, f"amax must be >= 0, got {t[t < 0][0].item()!r}")
    problem = _amax_shape_problem(tuple(t.shape), q, owner, local)
    if problem:
        raise bad(path, key, f"shape {tuple(t.shape)} does not fit: {problem}")
