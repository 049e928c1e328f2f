"""ModelOpt's ``modelopt_state(model)`` and ``restore_from_modelopt_state(model, state)`` for quantized models.

The state is the plain dict ModelOpt 0.47 writes: ``{"modelopt_state_dict": [(mode, {"config": ...,
"metadata": {"quantizer_state": {name: state}}}), ...], "modelopt_version": "0.47.0"}``, one quantizer state per
``TensorQuantizer`` (see :mod:`modelopt_lite.nn._modelopt_state`) and ``{"num_quantizers": n,
"is_sequential_quantizer": True}`` per ``SequentialQuantizer``. Ours has one mode, ``"quantize"``, whose metadata
holds the final quantizer states; a state ModelOpt wrote has the quantize mode followed by calibration modes
(``"max_calibrate"``, ``"smoothquant_calibrate"``, ...), and the last one's quantizer states are the final ones.

A state is untrusted input: its structure and every quantizer entry are validated, the modules converted are those
that own a listed quantizer, their quantized classes come from the quantization registry only, and the quantizers
of the converted model must be exactly those listed. Any problem raises ValueError naming the entry, and the model
is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..conversion.model_quant import _Replacements, set_quantizer_names
from ..conversion.registry import REGISTRY
from ..conversion.save_restore import MAX_SEQUENTIAL
from ..conversion.state import snapshot_quantizers
from ..conversion.utils import named_quantizers, quantizer_sites
from ..functional import blocks
from ..nn import SequentialQuantizer, TensorQuantizer
from ..nn._modelopt_state import tensor_metadata
from ..nn.modules._base import module_device

#: the ModelOpt version whose state layout this follows
MODELOPT_VERSION = "0.47.0"
_QUANTIZE = "quantize"


class ModelAlreadyQuantizedError(ValueError, AssertionError):
    """Restoring a state onto a model that already holds quantizers (ModelOpt raises an AssertionError there; this is
    both, so code catching either keeps working)."""


def peer_flat_amax_keys(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{state_dict key: ModelOpt's shape}`` of the static block weight amaxes that ModelOpt stores flat,
    ``(rows * blocks, 1)``, where ours are ``(rows, blocks)`` (what :func:`our_amax_shape` maps back)."""
    out = {}
    for site in quantizer_sites(model):
        a = site.quantizer._amax
        if a is None or a.dim() == 0 or (a.dim() == 2 and a.shape[1] == 1):
            continue
        flat = (int(a.numel()), 1)
        if our_amax_shape(site.quantizer, *_weight_owner(model, site), flat) == tuple(a.shape):
            out[f"{site.name}._amax"] = flat
    return out


def modelopt_state(model: nn.Module) -> dict:
    """The quantization state of ``model`` as ModelOpt's plain dict (no tensors: their shapes only).

    A static block weight amax is recorded in ModelOpt's flat shape ``(rows * blocks, 1)`` (as :func:`save` writes
    it), so ModelOpt restores the state; restoring here maps it back. A model without quantizers gives an empty
    ``modelopt_state_dict`` (as ModelOpt does for a plain model)."""
    qstate: dict[str, dict] = {}
    flat = peer_flat_amax_keys(model)
    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer):
            qstate[name] = m.get_modelopt_state()
            key = f"{name}._amax"
            if key in flat and "_amax" in qstate[name]["_pytorch_state_metadata"]["buffers"]:
                qstate[name]["_pytorch_state_metadata"]["buffers"]["_amax"]["shape"] = torch.Size(flat[key])
        elif isinstance(m, SequentialQuantizer):
            qstate[name] = {"num_quantizers": len(m), "is_sequential_quantizer": True}
    modes = []
    if qstate:
        # the settings themselves are in the quantizer states; ModelOpt builds a SequentialQuantizer only from a
        # list-valued config entry, so each one gets an entry naming it (placeholder attributes, which the states
        # then replace)
        seqs = [
            {"quantizer_name": name, "cfg": [{"num_bits": 8} for _ in range(st["num_quantizers"])]}
            for name, st in qstate.items()
            if st.get("is_sequential_quantizer") is True
        ]
        config = {"quant_cfg": seqs, "algorithm": None}
        modes.append((_QUANTIZE, {"config": config, "metadata": {"quantizer_state": qstate}}))
    return {"modelopt_state_dict": modes, "modelopt_version": MODELOPT_VERSION}


def _bad(entry: str, why: str) -> ValueError:
    return ValueError(f"restore_from_modelopt_state: {entry}: {why}")


def _is_calib_mode(mode: str) -> bool:
    return mode.endswith("_calibrate")


def quantizer_state_of(state) -> dict[str, Mapping] | None:
    """The final per-quantizer states of a ModelOpt state dict (validated structure); None when it has no modes."""
    if not isinstance(state, Mapping):
        raise _bad("state", f"must be a dict, got {type(state).__name__}")
    if "modelopt_state" in state and "modelopt_state_dict" not in state:
        raise _bad("state", "this is a whole checkpoint (mto.save); pass checkpoint['modelopt_state'] or use restore")
    modes = state.get("modelopt_state_dict")
    if not isinstance(modes, (list, tuple)):
        raise _bad("modelopt_state_dict", f"must be a list, got {type(modes).__name__}")
    if not isinstance(state.get("modelopt_version"), str):
        raise _bad("modelopt_version", f"must be a str, got {state.get('modelopt_version')!r}")
    final = None
    for i, entry in enumerate(modes):
        where = f"modelopt_state_dict[{i}]"
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], str):
            raise _bad(where, "must be a (mode name, {'config', 'metadata'}) pair")
        mode, body = entry
        if mode != _QUANTIZE and not _is_calib_mode(mode):
            raise _bad(where, f"mode {mode!r} is not supported (only 'quantize' and calibration modes are)")
        if (mode == _QUANTIZE) != (i == 0):
            raise _bad(where, f"mode {mode!r}: the 'quantize' mode must come first, once")
        if not isinstance(body, Mapping) or not isinstance(body.get("metadata"), Mapping):
            raise _bad(where, "must hold a dict with a 'metadata' dict")
        if not isinstance(body.get("config", {}), Mapping):
            raise _bad(where + ".config", "must be a dict")
        qs = body["metadata"].get("quantizer_state")
        if qs is not None:
            if not isinstance(qs, Mapping) or not all(isinstance(k, str) for k in qs):
                raise _bad(where + ".metadata.quantizer_state", "must map quantizer names to states")
            final = qs
    if modes and final is None:
        raise _bad("modelopt_state_dict", "no mode holds a 'quantizer_state'")
    return None if final is None else dict(final)


def _split_sequential(qstate: Mapping) -> tuple[dict[str, int], dict[str, Mapping]]:
    """(sequential quantizer -> length, quantizer -> state), with the sequential entries' members checked."""
    seq: dict[str, int] = {}
    for name, st in qstate.items():
        if isinstance(st, Mapping) and "is_sequential_quantizer" in st:
            n = st.get("num_quantizers")
            if set(st) != {"is_sequential_quantizer", "num_quantizers"} or st["is_sequential_quantizer"] is not True:
                raise _bad(f"quantizer_state[{name!r}]", f"malformed sequential quantizer entry {dict(st)!r}")
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SEQUENTIAL:
                raise _bad(f"quantizer_state[{name!r}]", f"num_quantizers must be an int in 1..{MAX_SEQUENTIAL}")
            seq[name] = n
    singles = {k: v for k, v in qstate.items() if k not in seq}
    for name, n in seq.items():
        members = {k for k in singles if k.startswith(name + ".")}
        if members != {f"{name}.{i}" for i in range(n)}:
            raise _bad(f"quantizer_state[{name!r}]", f"lists {n} quantizers but its members are {sorted(members)}")
    return seq, singles


def _owner_names(names) -> list[str]:
    """The modules that own the listed quantizers, parents before children."""
    owners = {n.rpartition(".")[0] for n in names}
    return sorted(owners, key=lambda n: (n.count(".") if n else -1, n))


def _convert_owners(model: nn.Module, owners: list[str], seq: Mapping[str, int], undo: _Replacements) -> nn.Module:
    memo: dict[int, nn.Module] = {}
    for name in owners:
        if name in seq:
            continue
        try:
            m = model.get_submodule(name) if name else model
        except AttributeError:
            model = _convert_creator(model, name, undo)
            try:
                m = model.get_submodule(name)
            except AttributeError:
                raise _bad("quantizer_state", f"module {name!r} does not exist in the model") from None
        if REGISTRY.float_class_of(type(m)) is not None or isinstance(m, SequentialQuantizer):
            continue  # already quantized
        if REGISTRY.get(type(m)) is None:
            raise _bad("quantizer_state", f"module {name!r} ({type(m).__name__}) has no registered quantized class")
        new = memo.get(id(m))
        if new is None:
            new = memo[id(m)] = REGISTRY.convert(m)
        model = undo.put(model, name, new)
    return model


def _convert_creator(model: nn.Module, name: str, undo: _Replacements) -> nn.Module:
    """Convert the outermost float ancestor of the missing module ``name`` that has a registered quantized class
    (whose conversion may create it: DBRX's experts become per-expert Linears); returns the model."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        path = ".".join(parts[:i])
        try:
            m = model.get_submodule(path)
        except AttributeError:
            return model
        if REGISTRY.float_class_of(type(m)) is None and REGISTRY.get(type(m)) is not None:
            return undo.put(model, path, REGISTRY.convert(m))
    return model


def _make_sequential(model: nn.Module, seq: Mapping[str, int], undo: _Replacements) -> None:
    for name, n in seq.items():
        parent_name, _, attr = name.rpartition(".")
        try:
            owner = model.get_submodule(parent_name) if parent_name else model
            cur = getattr(owner, attr)
        except AttributeError:
            raise _bad(f"quantizer_state[{name!r}]", "no such quantizer in the model") from None
        if not isinstance(cur, (TensorQuantizer, SequentialQuantizer)):
            raise _bad(f"quantizer_state[{name!r}]", f"the model has a {type(cur).__name__} there")
        new = SequentialQuantizer(*(TensorQuantizer() for _ in range(n))).to(module_device(owner))
        undo.done.append((owner, attr, cur))
        setattr(owner, attr, new)


def _weight_owner(model: nn.Module, site) -> tuple[nn.Module | None, str]:
    """``(module, quantizer attribute)`` a quantizer serves: for a member of a SequentialQuantizer, the module
    holding the sequence and the sequence's attribute name (``weight_quantizer.0`` serves the weight too)."""
    if isinstance(site.owner, SequentialQuantizer):
        parent, _, attr = site.name.rpartition(".")[0].rpartition(".")
        return model.get_submodule(parent), attr
    return site.owner, site.local


def our_amax_shape(q: TensorQuantizer, owner, local: str, shape: tuple) -> tuple:
    """Our layout of a ModelOpt amax shape: a static block weight amax ``(rows * blocks, 1)`` is ``(rows, blocks)``."""
    d = q.quant_desc
    w = getattr(owner, "weight", None) if local == "weight_quantizer" else None
    if d.per_block_amax and isinstance(w, torch.Tensor) and q.num_steps == 1:
        want = blocks.blocks_shape(tuple(w.shape), blocks.normalize(d.block_sizes, tuple(w.shape)))
        if int(torch.Size(want).numel()) == int(torch.Size(shape).numel()):
            return tuple(want)
    return shape


def apply_quantizer_states(model: nn.Module, qstate: Mapping, undo: _Replacements) -> nn.Module:
    """Convert, build sequential quantizers and set every quantizer from ``qstate`` (see the module docstring)."""
    seq, singles = _split_sequential(qstate)
    model = _convert_owners(model, _owner_names(singles), seq, undo)
    _make_sequential(model, seq, undo)
    set_quantizer_names(model)
    present = {s.name: s for s in quantizer_sites(model)}
    for name in present:
        if name not in singles:
            raise _bad("quantizer_state", f"the model has quantizer {name!r}, which the state does not list")
    for name in singles:
        if name not in present:
            raise _bad("quantizer_state", f"quantizer {name!r} of the state does not exist in the model")
    for name, st in singles.items():
        site = present[name]
        q = site.quantizer
        q.set_from_modelopt_state(st)
        meta = tensor_metadata(st, f"quantizer {name!r}")
        if "_amax" in meta:
            shape = our_amax_shape(q, *_weight_owner(model, site), meta["_amax"][0])
            if shape != meta["_amax"][0]:
                q._store_amax(torch.zeros(shape, device=q._amax.device if q._amax is not None else None))
    return model


def restore_with_undo(model: nn.Module, state) -> tuple[nn.Module, Callable[[], None]]:
    """:func:`restore_from_modelopt_state`'s work; returns the model and a callable that undoes it."""
    qstate = quantizer_state_of(state)
    if qstate is None:
        return model, lambda: None
    held = next((name for name, _ in named_quantizers(model)), None)
    if held is not None:
        raise ModelAlreadyQuantizedError(
            f"restore_from_modelopt_state: Model already has modelopt state! (it holds quantizer {held!r}); "
            "restore into the float model"
        )
    before = snapshot_quantizers(q for _, q in named_quantizers(model))
    undo = _Replacements()

    def rollback() -> None:
        undo.undo()
        before.restore()

    try:
        model = apply_quantizer_states(model, qstate, undo)
    except BaseException:
        rollback()
        raise
    return model, rollback
