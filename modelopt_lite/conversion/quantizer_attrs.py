"""ModelOpt's quantizer switches: ``set_quantizer_attribute``, ``enable_quantizer``, ``disable_quantizer``, and
``postprocess_amax`` (a function applied to the amax of the matching quantizers).

A quantizer is selected by its module path (``"features.0.weight_quantizer"``) with an fnmatch wildcard
(``"*weight_quantizer"``) or a filter callable ``f(name) -> bool``, optionally only inside modules of
``parent_class``. The change is atomic: if one quantizer rejects the attributes, every quantizer is restored.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping

import torch
from torch import nn

from .state import snapshot_quantizers
from .utils import named_quantizers, quantizer_sites

WildcardOrFilter = str | Callable[[str], bool]


def _matcher(wildcard_or_filter_func, what: str) -> Callable[[str], bool]:
    if isinstance(wildcard_or_filter_func, str):
        pattern = wildcard_or_filter_func
        return lambda name: fnmatch.fnmatch(name, pattern)
    if callable(wildcard_or_filter_func):
        return lambda name: bool(wildcard_or_filter_func(name))
    raise TypeError(
        f"{what}: expected a wildcard str or a filter callable, got {type(wildcard_or_filter_func).__name__}"
    )


def set_quantizer_attribute(
    quant_model: nn.Module,
    wildcard_or_filter_func: WildcardOrFilter,
    attribute: Mapping,
    parent_class: type | None = None,
) -> list[str]:
    """Apply ``attribute`` (a dict such as ``{"num_bits": 4, "axis": None}`` or ``{"enable": False}``) to every
    matching quantizer with ``set_from_attribute_config``; returns the names of the quantizers changed.

    Raises:
        TypeError: a bad selector, ``attribute`` not a dict, or ``parent_class`` not a class.
        ValueError/TypeError from a quantizer (naming it) rejecting the attributes; nothing is changed then.
    """
    match = _matcher(wildcard_or_filter_func, "set_quantizer_attribute")
    if not isinstance(attribute, Mapping):
        raise TypeError(f"set_quantizer_attribute: attribute must be a dict, got {type(attribute).__name__}")
    if parent_class is not None and not isinstance(parent_class, type):
        raise TypeError(f"set_quantizer_attribute: parent_class must be a class, got {parent_class!r}")
    sites = [
        s
        for s in quantizer_sites(quant_model)
        if match(s.name) and (parent_class is None or isinstance(s.owner, parent_class))
    ]
    before = snapshot_quantizers(s.quantizer for s in sites)
    try:
        for s in sites:
            s.quantizer.set_from_attribute_config(dict(attribute))
    except BaseException:
        before.restore()
        raise
    return [s.name for s in sites]


def enable_quantizer(quant_model: nn.Module, wildcard_or_filter_func: WildcardOrFilter) -> list[str]:
    """Enable the matching quantizers; returns their names."""
    return set_quantizer_attribute(quant_model, wildcard_or_filter_func, {"enable": True})


def disable_quantizer(quant_model: nn.Module, wildcard_or_filter_func: WildcardOrFilter) -> list[str]:
    """Disable the matching quantizers (they pass their input through); returns their names."""
    return set_quantizer_attribute(quant_model, wildcard_or_filter_func, {"enable": False})


def postprocess_amax(model: nn.Module, key: WildcardOrFilter, post_process_fn: Callable) -> nn.Module:
    """ModelOpt's ``postprocess_amax``: ``amax = post_process_fn(amax)`` for every calibrated quantizer whose module
    path matches ``key`` (a wildcard or a filter callable); returns the model. The new amax goes through the amax
    setter's checks (finite, non-negative, a shape the quantizer takes).

    Raises:
        TypeError: a bad ``key`` or ``post_process_fn``, or a result that is not a tensor (naming the quantizer).
        ValueError: a result the quantizer rejects (naming it). Every amax is restored then.
    """
    match = _matcher(key, "postprocess_amax")
    if not callable(post_process_fn):
        raise TypeError(f"postprocess_amax: post_process_fn must be callable, got {type(post_process_fn).__name__}")
    chosen = [(n, q) for n, q in named_quantizers(model) if match(n) and q.amax is not None]
    before = snapshot_quantizers(q for _, q in chosen)
    try:
        for name, q in chosen:
            new = post_process_fn(q.amax)
            if not isinstance(new, torch.Tensor):
                raise TypeError(
                    f"postprocess_amax: {name}: post_process_fn returned {type(new).__name__}, not a tensor"
                )
            q.amax = new
    except BaseException:
        before.restore()
        raise
    return model
