"""ModelOpt's checkpoint files: ``save(model, path)`` / ``restore(model, path)`` and ``restore_from_modelopt_state``.

A checkpoint is ModelOpt's ``{"modelopt_state": modelopt_state(model), "model_state_dict": model.state_dict()}``
written with ``torch.save``, so a file ModelOpt wrote restores here (quantize and calibration modes, see
:mod:`.state`) and ours restores in ModelOpt. Files are untrusted: they are read with
``torch.load(weights_only=True)`` only (plain containers, tensors, ``torch.Size`` and dtypes; nothing else is
unpickled, and a file that needs more is refused with the reason), the state is validated as :mod:`.state` says,
and every tensor is checked before anything is loaded: quantizer tensors as :func:`modelopt_lite.restore` checks
them (float32, finite, amax >= 0, a shape that fits the quantizer and its layer), the model's own tensors for
their names, dtypes and shapes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..conversion.state_file import check_quantizer_tensor
from ..conversion.utils import quantizer_sites
from ..functional import deferred_errors
from ..nn._modelopt_state import TENSOR_NAMES
from .state import modelopt_state, peer_flat_amax_keys, restore_with_undo


def save(model: nn.Module, f, **kwargs) -> None:
    """Write ModelOpt's checkpoint of ``model`` (its modelopt state and its whole ``state_dict``) to ``f``;
    ``kwargs`` go to ``torch.save``. Static block weight amaxes are written in ModelOpt's flat layout
    ``(rows * blocks, 1)``, so ModelOpt's ``mto.restore`` reads the file (:func:`restore` maps them back)."""
    deferred_errors.check_errors()  # a sync point: pending CUDA value errors raise before saving
    sd = model.state_dict()
    for key, shape in peer_flat_amax_keys(model).items():
        sd[key] = sd[key].reshape(shape)
    state = modelopt_state(model)
    custom = []
    for _, body in state["modelopt_state_dict"]:
        for name, qs in body["metadata"]["quantizer_state"].items():
            if qs.get("_modelopt_lite", {}).pop("calibrator", None) is not None:
                custom.append(name)
    if custom:
        warnings.warn(
            f"mto.save: the calibrator classes of {custom[:3]}{' ...' if len(custom) > 3 else ''} are not written "
            "(a checkpoint never names code to import); restoring the file gives them the default calibrator",
            RuntimeWarning,
            stacklevel=2,
        )
    torch.save({"modelopt_state": state, "model_state_dict": sd}, f, **kwargs)


def load_checkpoint(path) -> dict:
    """``torch.load(path, map_location="cpu", weights_only=True)``: ValueError naming the file when it cannot be
    read that way (corrupt, not a torch file, or it needs classes unpickled)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"restore: no checkpoint at {path}") from None
    except Exception as e:  # the unpickler raises several types for corrupt or unsafe files
        why = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"restore: {path} does not load with torch.load(weights_only=True), the only way files are read here "
            f"({type(e).__name__}: {why})"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"restore: {path} holds a {type(obj).__name__}, not a checkpoint dict")
    return obj


def restore_from_modelopt_state(
    model: nn.Module, modelopt_state: Mapping | None = None, modelopt_state_path=None
) -> nn.Module:
    """Re-create the quantization of a ModelOpt state on ``model`` (float, or converted the same way); returns it.

    The quantizer tensors (amax...) are re-created as zeros of the recorded shapes: load them with
    ``model.load_state_dict(...)`` (a ModelOpt flat block amax is taken in its flat layout too), or use
    :func:`restore` for a whole checkpoint. ``modelopt_state_path``: a file holding the state alone.

    Raises:
        ValueError: a malformed state, a mode other than quantize/calibrate, or a model whose modules or quantizers
            differ from the state's (the message names the first one); ``model`` is left unchanged then.
    """
    if (modelopt_state is None) == (modelopt_state_path is None):
        raise TypeError("restore_from_modelopt_state: give exactly one of modelopt_state and modelopt_state_path")
    if modelopt_state_path is not None:
        modelopt_state = load_checkpoint(modelopt_state_path)
    model, _ = restore_with_undo(model, modelopt_state)
    return model


def _bad(path, entry: str, why: str) -> ValueError:
    return ValueError(f"restore: {path}: {entry}: {why}")


def _flat_to_ours(t: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    if t.shape != cur.shape and t.dim() == 2 and t.shape[1] == 1 and t.numel() == cur.numel():
        return t.reshape(cur.shape)  # ModelOpt's flat block amax
    return t


def _checked_state_dict(model: nn.Module, sd, path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, validated against ``model`` (quantizer tensors in our layout)."""
    if not isinstance(sd, Mapping):
        raise _bad(path, "model_state_dict", f"must be a dict, got {type(sd).__name__}")
    for k, t in sd.items():
        if not isinstance(k, str) or not isinstance(t, torch.Tensor):
            raise _bad(path, f"model_state_dict[{k!r}]", f"must be a tensor under a str key, got {type(t).__name__}")
    expected = model.state_dict()
    out = dict(sd)
    sites = {s.name: s for s in quantizer_sites(model)}
    for key, t in sd.items():
        qname, _, tname = key.rpartition(".")
        site = sites.get(qname)
        if site is None or tname not in TENSOR_NAMES:
            continue
        if key not in expected:
            raise _bad(path, key, "has no place in the model (the state does not list this tensor)")
        t = _flat_to_ours(t, expected[key]) if site.quantizer.block_sizes else t
        check_quantizer_tensor(path, key, t, site.quantizer, site.owner, site.local)
        if t.shape != expected[key].shape:
            raise _bad(path, key, f"has shape {tuple(t.shape)}, the state records {tuple(expected[key].shape)}")
        out[key] = t
    for k, t in expected.items():
        if k not in out:
            raise _bad(path, k, "is missing from the checkpoint")
        c = out[k]
        if c.dtype != t.dtype or c.shape != t.shape:
            raise _bad(path, k, f"is {c.dtype} {tuple(c.shape)}, the model has {t.dtype} {tuple(t.shape)}")
    extra = sorted(set(out) - set(expected))
    if extra:
        raise _bad(path, extra[0], "has no place in the model")
    return out


def restore(model: nn.Module, f) -> nn.Module:
    """Restore a checkpoint :func:`save` (or ModelOpt's ``mto.save``) wrote: the quantization, then every tensor.

    Raises:
        ValueError: the file does not load with ``weights_only=True``, or its state or a tensor is invalid or does
            not fit ``model`` (the message names the file and the entry); ``model`` is left unchanged then.
        FileNotFoundError: no such file.
    """
    deferred_errors.check_errors()  # a sync point: pending CUDA value errors raise before loading
    ckpt = load_checkpoint(f)
    missing = [k for k in ("modelopt_state", "model_state_dict") if k not in ckpt]
    if missing:
        raise _bad(f, missing[0], "is missing: not a checkpoint written by mto.save")
    try:
        model, rollback = restore_with_undo(model, ckpt["modelopt_state"])
    except ValueError as e:
        raise ValueError(f"restore: {f}: {e}") from None
    try:
        model.load_state_dict(_checked_state_dict(model, ckpt["model_state_dict"], f), strict=True)
    except BaseException:
        rollback()
        raise
    return model
