"""``quantize`` (convert a float model in place from a config, then calibrate) and the ``calibrate`` context.

Conversion is per instance: every child whose exact type is in the registry (:mod:`.registry`) is replaced by
``QuantX.from_float(child)``; ``torch.nn`` itself is never touched. Each quantizer's ``name`` becomes its module
path, the config's rules are applied (see :mod:`.config`), and with a ``forward_loop`` the model is calibrated by
running ``forward_loop(model)`` inside :func:`calibrate` with the config's algorithm.

``quantize`` is atomic: if anything fails (a bad config, a quantizer rejecting an attribute, an error in the
forward loop), the replaced children are put back and every quantizer that existed before is restored exactly.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .algorithm_registry import ALGORITHMS
from .cfg_sites import apply_attrs, config_sites, merge_attrs
from .config import (
    QuantConfig,
    QuantConfigError,
    check_method,
    normalize_algorithm,
    normalize_config,
)
from .registry import REGISTRY, QuantModuleRegistryCls
from .requant import set_requant
from .state import ModuleSnapshot, snapshot_quantizers
from .utils import named_quantizers

log = logging.getLogger(__name__)

_HIST_METHODS = ("histogram", "percentile", "mse", "entropy")


# --- conversion ----------------------------------------------------------------------------------------------------
class _Replacements:
    """The (parent, attribute, original child) triples of one conversion, so it can be undone."""

    def __init__(self):
        self.done: list[tuple[nn.Module, str, nn.Module]] = []

    def put(self, model: nn.Module, name: str, new: nn.Module) -> nn.Module:
        """Put ``new`` at the dotted ``name`` of ``model`` (recorded, so :meth:`undo` puts the original back) and
        return the model: ``new`` itself when ``name`` is ``""`` (the root is replaced, nothing to record)."""
        if not name:
            return new
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        self.done.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, new)
        return model

    def undo(self) -> None:
        for parent, attr, original in reversed(self.done):
            setattr(parent, attr, original)
        self.done.clear()


def _keeps_children_float(module: nn.Module) -> bool:
    return getattr(type(module), "_quant_keep_children_float", False) is True


def _convert_tree(model: nn.Module, registry: QuantModuleRegistryCls, record: _Replacements) -> nn.Module:
    memo: dict[int, nn.Module] = {}

    def convert(m: nn.Module) -> nn.Module | None:
        if id(m) in memo:
            return memo[id(m)]
        if type(m) not in registry:
            return None
        new = registry.convert(m)
        memo[id(m)] = new
        return new

    root = convert(model)
    model = model if root is None else root
    visited = {id(model)}
    stack = [] if _keeps_children_float(model) else [model]
    while stack:
        module = stack.pop()
        for attr, child in list(module._modules.items()):  # not named_children(): it hides repeated children
            if child is None:
                continue
            new = convert(child)
            if new is not None:
                record.done.append((module, attr, child))
                setattr(module, attr, new)
                child = new  # a converted module's children are converted too (an attention module's Linears)
                if _keeps_children_float(new):  # ... unless it quantizes them itself (a LoRA layer's merged weight)
                    visited.add(id(new))
            if id(child) not in visited:
                visited.add(id(child))
                stack.append(child)
    return model


def replace_quant_modules(model: nn.Module, registry: QuantModuleRegistryCls | None = None) -> nn.Module:
    """Replace (in place) every child whose exact type is registered by its quantized twin; returns the model.

    A module shared under several names is converted once and stays shared. If ``model`` itself is of a
    registered type, the converted module is returned (use the return value). Quantizer names are left unset
    (``quantize`` sets them). ``replace_quant_module`` is ModelOpt's name for the same function.
    """
    return _convert_tree(model, registry or REGISTRY, _Replacements())


replace_quant_module = replace_quant_modules


def set_quantizer_names(model: nn.Module) -> None:
    """Set every quantizer's ``name`` to its module path (used in messages, summaries and exports)."""
    for name, q in named_quantizers(model):
        q.name = name


def set_quantizer_by_cfg(model: nn.Module, quant_cfg: dict | QuantConfig) -> dict[str, list[str]]:
    """Apply a ``quant_cfg`` dict (or a whole config) to the model's quantizers; returns ``{quantizer: [labels]}``.

    For each quantizer, the attributes of every matching rule are merged in order (later rules win) and applied in
    one :meth:`TensorQuantizer.set_from_attribute_config` call. A rule whose attributes are a list of dicts makes
    the quantizer a :class:`~modelopt_lite.nn.SequentialQuantizer` (one fresh quantizer per dict, replacing it in
    its owner); a ``SequentialQuantizer`` is matched by its own path, and a dict applies to all its members.

    Raises:
        QuantConfigError: a malformed config, or a quantizer rejecting the merged attributes (the message names the
            quantizer and the patterns that matched it).
    """
    return _apply_cfg(model, quant_cfg, [])


def _apply_cfg(model: nn.Module, quant_cfg: dict | QuantConfig, replaced: list) -> dict[str, list[str]]:
    if not isinstance(quant_cfg, QuantConfig):
        cfg = quant_cfg if "quant_cfg" in quant_cfg or "algorithm" in quant_cfg else {"quant_cfg": quant_cfg}
        quant_cfg = normalize_config({**cfg, "algorithm": None})
    applied: dict[str, list[str]] = {}
    for site in config_sites(model):
        float_cls = None
        if site.owner is not None:
            float_cls = REGISTRY.float_class_of(type(site.owner)) or getattr(type(site.owner), "_float_cls", None)
        hits = [r for r in quant_cfg.rules if r.matches(site.name, site.local, site.owner, float_cls)]
        if not hits:
            continue
        merged = merge_attrs([r.attrs for r in hits])
        try:
            apply_attrs(site, merged, replaced)
        except (ValueError, TypeError) as e:
            labels = " + ".join(f"quant_cfg[{r.label}]" for r in hits)
            raise QuantConfigError(
                f"quantizer {site.name!r}: the attributes from {labels} (merged: {merged}) were rejected: {e}"
            ) from e
        applied[site.name] = [r.label for r in hits]
    return applied


def _call_forward_loop(forward_loop: Callable, model: nn.Module):
    """``forward_loop(model)``, or ``forward_loop()`` when it takes no argument (ModelOpt accepts both)."""
    try:
        sig = inspect.signature(forward_loop)
    except (TypeError, ValueError):  # no signature (some builtins): the documented form
        return forward_loop(model)
    try:
        sig.bind(model)
    except TypeError:
        try:
            sig.bind()
        except TypeError:
            raise TypeError(
                f"forward_loop {getattr(forward_loop, '__name__', forward_loop)!r}{sig} must take the model as its "
                "only argument, or no argument"
            ) from None
        return forward_loop()
    return forward_loop(model)


def quantize(
    model: nn.Module,
    config: dict,
    forward_loop: Callable[[nn.Module], object] | None = None,
    *,
    registry: QuantModuleRegistryCls | None = None,
) -> nn.Module:
    """Convert ``model`` in place to fake-quantized modules, configure its quantizers and calibrate them.

    Args:
        model: a float (or partly quantized) model. It is modified in place and returned; if the model itself is
            of a registered type (e.g. a bare ``nn.Linear``) the converted module is returned instead.
        config: ``{"quant_cfg": {pattern: attrs}, "algorithm": ...}`` (see :mod:`modelopt_lite.conversion.config`),
            e.g. ``modelopt_lite.INT8_DEFAULT_CFG``. Deep-copied, never mutated. As in ModelOpt, an entry that does
            not say ``"enable"`` turns the quantizers it selects on.
        forward_loop: ``forward_loop(model)`` runs calibration data through the model (see :func:`calibrate_loop`);
            a ``forward_loop()`` that takes no argument is called without one (ModelOpt accepts both). None: as in
            ModelOpt, with the ``"max"`` algorithm the weight quantizers are calibrated on the weights alone
            (:func:`calibrate_weights`) and activation quantizers stay uncalibrated (dynamic: amax from each
            input); other algorithms leave every quantizer uncalibrated (call :func:`calibrate` yourself).
        registry: the float -> quant class map (default: the global one, see :func:`modelopt_lite.register`).

    Raises:
        QuantConfigError (ValueError): a malformed config; the model is left unchanged.
        TypeError: ``forward_loop`` is not callable.
    """
    cfg = normalize_config(config, enable_by_default=True)
    if forward_loop is not None and not callable(forward_loop):
        raise TypeError(
            f"forward_loop must be a callable taking the model (or nothing), got {type(forward_loop).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize expects an nn.Module, got {type(model).__name__}")
    before = snapshot_quantizers(q for _, q in named_quantizers(model))
    record = _Replacements()
    weights = None  # SmoothQuant rescales weights in place: their values before, to restore on failure
    modes: dict = {}  # requant modes before, to restore on failure
    try:
        model = _convert_tree(model, registry or REGISTRY, record)
        set_quantizer_names(model)
        _apply_cfg(model, cfg, record.done)
        if cfg.requant is not None:
            modes = {m: m.requant for m in model.modules() if hasattr(m, "requant")}
            set_requant(model, cfg.requant)
        if forward_loop is None and cfg.algorithm is not None and cfg.algorithm[0] == "max":
            calibrate_weights(model)  # ModelOpt: weight-only calibration; activations stay dynamic
        elif forward_loop is not None:
            if cfg.algorithm is None:
                warnings.warn(
                    "quantize: config algorithm is None, so forward_loop was not run (no calibration)", stacklevel=2
                )
            else:
                method, params = cfg.algorithm
                if method in ALGORITHMS:  # transform the model (weights may change), then calibrate
                    weights = ModuleSnapshot(
                        m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                    )
                    _run_algorithm(model, method, params, forward_loop)
                else:
                    # the algorithm "max" is ModelOpt's max_calibrate: every quantizer's own calibrator (method None)
                    with _calibration(model, None if method == "max" else method, params):
                        _call_forward_loop(forward_loop, model)
    except BaseException:
        for m, mode in modes.items():
            m.requant = mode
        if weights is not None:
            weights.restore()
        record.undo()
        before.restore()
        raise
    log.info("quantize: %d modules converted, %d quantizers", len(record.done), sum(1 for _ in named_quantizers(model)))
    return model


def _run_algorithm(model: nn.Module, method: str, params: dict, forward_loop: Callable) -> None:
    """Run a registered algorithm (see :mod:`.algorithm_registry`) with the user's loop and a max calibration."""

    def loop(m: nn.Module):
        return _call_forward_loop(forward_loop, m)

    def calibrate_max() -> None:
        with _calibration(model, None, {}):
            loop(model)

    ALGORITHMS[method].run(model, loop, calibrate_max, **params)


# --- calibration ---------------------------------------------------------------------------------------------------
def _is_per_tensor(q) -> bool:
    d = q.quant_desc
    return d.axis is None and not d.block_sizes


def _calibrators(q) -> list:
    """The calibrator of every temporal step (one for an ordinary quantizer; none when dynamic)."""
    steps = int(getattr(q, "num_steps", 1) or 1)
    if steps == 1:
        return [] if q.calibrator is None else [q.calibrator]
    saved, out = q.step, []
    try:
        for t in range(steps):
            q.step = t
            if q.calibrator is not None:
                out.append(q.calibrator)
    finally:
        q.step = saved
    return out


def _collected(cal) -> bool:
    n = getattr(cal, "num_collected", None)
    return n > 0 if n is not None else cal.compute_amax() is not None


def _start(q, method) -> None:
    d = q.quant_desc
    if method in _HIST_METHODS and _is_per_tensor(q) and d.calib_method != "histogram":
        q.set_from_attribute_config({"calib_method": "histogram"})
    elif method == "max" and d.calib_method != "max" and not d.block_sizes:
        # exactly the method asked for: a histogram left by an earlier entropy/mse/percentile pass (or configured)
        # must not answer a "max" pass with its percentile (issue 13)
        q.set_from_attribute_config({"calib_method": "max"})
    for cal in _calibrators(q):
        cal.reset()
    q.disable_quant()
    q.enable_calib()


def _finish(q, method, params: dict) -> bool:
    """Load amax from the collected statistics; False when the quantizer saw no data (its amax is left as is)."""
    cals = _calibrators(q)
    seen = sum(_collected(c) for c in cals)
    q.disable_calib()
    q.enable_quant()
    if not seen:
        return False
    if q.quant_desc.calib_method == "histogram" and not q.quant_desc.block_sizes:
        m, kw = (None if method in (None, "max", "histogram") else method), params
    else:
        m, kw = None, {}
    # temporal steps that saw no data get the max of the others (load_calib_amax warns, naming the steps)
    q.load_calib_amax(m, strict=seen == len(cals), **kw)
    return True


_UNSET = object()


def calibrate(
    model: nn.Module,
    method: str | dict | None = "max",
    forward_loop: Callable | None = None,
    *,
    algorithm=_UNSET,
    **compute_amax_kwargs,
):
    """Calibrate the quantizers on the data run inside a ``with`` block (or by ``forward_loop``), then load amax.

    Two forms::

        with mtq.calibrate(model, "entropy"):        # a context manager
            for x in batches:
                model(x)

        mtq.calibrate(model, algorithm="max", forward_loop=loop)   # ModelOpt's form: runs loop now, returns model
        mtq.calibrate(model, algorithm="max")      # ModelOpt's weight-only form (no loop): weights now, returns model

    Every enabled, static quantizer without a fixed ``amax`` switches to collect mode (quantization off) for the
    block; on exit it computes and loads amax and turns quantization back on (calibration off). If the block (or the
    amax computation) raises, every quantizer's state (flags, amax, calibrator statistics, descriptor) is restored
    exactly and the exception propagates. Statistics start fresh at entry.

    Methods (exactly the one asked for is used):
        ``"max"``: the max of ``|x|`` for every quantizer (one left on ``calib_method="histogram"`` by an earlier
        histogram pass, or by its config, switches back to ``"max"``; block quantizers always use a running
        block max). None: each quantizer's own calibrator with its default (max; ``calib_method="histogram"``: the
        99.99th percentile), which is what a config's ``"algorithm": "max"`` runs, as ModelOpt's max_calibrate
        does. ``"histogram"``/``"percentile"`` (``percentile=``), ``"mse"``/``"entropy"`` (``start_bin=``,
        ``stride=``): per-tensor quantizers collect a histogram (their ``calib_method`` becomes ``"histogram"``)
        and use that method; per-channel and block quantizers keep max calibration. ``method`` (or ModelOpt's
        ``algorithm=``) may also be a dict ``{"method": ..., **params}``.

    A quantizer that saw no data is left exactly as it was before the block, and a warning names it.

    Args:
        forward_loop: ``forward_loop(model)`` (or ``forward_loop()``); given, the calibration runs at once and the
            model is returned. None: a context manager is returned.

    Raises:
        QuantConfigError (ValueError): an unknown method or parameter, before anything runs.
    """
    if algorithm is not _UNSET:
        if method != "max":
            raise TypeError("calibrate: give the method positionally or as algorithm=, not both")
        method = algorithm
    if isinstance(method, dict):
        normalized = normalize_algorithm(method)
        assert normalized is not None  # only None normalizes to None
        method, params = normalized
        compute_amax_kwargs = {**params, **compute_amax_kwargs}
    if forward_loop is None:
        if algorithm is not _UNSET:  # ModelOpt's calibrate(model, algorithm=...): weight-only, at once
            calibrate_weights(model, method, **compute_amax_kwargs)
            return model
        return _calibration(model, method, compute_amax_kwargs)
    if not callable(forward_loop):
        raise TypeError(f"forward_loop must be callable, got {type(forward_loop).__name__}")
    with _calibration(model, method, compute_amax_kwargs):
        _call_forward_loop(forward_loop, model)
    return model


def _weight_sites(model: nn.Module) -> list[tuple[nn.Module, torch.Tensor]]:
    """``(weight_quantizer, weight)`` of every module quantizing its own ``weight`` (Linear, Conv, Embedding...)."""
    out = []
    for m in model.modules():
        wq = getattr(m, "weight_quantizer", None)
        merged = getattr(m, "quantizer_weight", None)  # what the quantizer sees when it is not ``weight`` (LoRA)
        w = merged() if callable(merged) else getattr(m, "weight", None)
        if isinstance(wq, nn.Module) and isinstance(w, torch.Tensor):
            out.append((wq, w))
    return out


def calibrate_weights(model: nn.Module, method: str | None = "max", **compute_amax_kwargs) -> nn.Module:
    """ModelOpt's weight-only calibration (``calibrate``/``quantize`` without a forward loop): every enabled static
    weight quantizer collects its module's ``weight`` and loads amax; activation quantizers are left untouched
    (uncalibrated ones quantize dynamically). Quantizers applied to weights inside ``forward`` only (the RNN
    families) are not reached and stay dynamic. The model's mode flags are restored."""
    with torch.no_grad():  # a LoRA layer computes its merged weight here
        sites = _weight_sites(model)
    chosen = {id(q) for wq, _ in sites for q in wq.modules()}
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), _calibration(model, method, compute_amax_kwargs, only=chosen):
            for wq, w in sites:
                wq(w)
    finally:
        for m, training in flags:
            m.training = training
    return model


@contextlib.contextmanager
def _calibration(model: nn.Module, method, compute_amax_kwargs: dict, only=None):
    """The calibration block of :func:`calibrate` (``only``: ids of the quantizers to calibrate, default all)."""
    check_method(method, compute_amax_kwargs)
    snaps = [(n, q, snapshot_quantizers([q])) for n, q in named_quantizers(model)]
    targets = [
        (n, q, snap)
        for n, q, snap in snaps
        if q.is_enabled and not q.quant_desc.dynamic and q.quant_desc.amax is None and (only is None or id(q) in only)
    ]
    missing: list[str] = []
    try:
        for _, q, _ in targets:
            _start(q, method)
        yield model
        for n, q, snap in targets:
            if not _finish(q, method, compute_amax_kwargs):
                snap.restore()  # no data: exactly as before the block
                missing.append(n)
    except BaseException:
        for _, _, snap in snaps:
            snap.restore()
        raise
    if missing:
        warnings.warn(
            f"calibrate: {len(missing)} quantizer(s) saw no data and were left as they were: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}",
            stacklevel=3,
        )


def calibrate_loop(model: nn.Module, batches: Iterable, progress: bool = True, desc: str = "calibrate") -> int:
    """Run ``model`` on each batch (eval mode, no grad) with an optional tqdm bar; returns the number of batches.

    A batch is a tensor (``model(batch)``), a tuple/list (``model(*batch)``) or a dict (``model(**batch)``). The
    training flags of all modules are restored afterwards.
    """
    modes = [(m, m.training) for m in model.modules()]
    it = batches
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(batches, desc=desc, leave=False)
        except ImportError:  # pragma: no cover
            pass
    n = 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in it:
                if isinstance(batch, dict):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
                n += 1
    finally:
        for m, mode in modes:
            m.training = mode
    return n


def make_forward_loop(batches: Iterable, progress: bool = False, desc: str = "calibrate"):
    """A ``forward_loop(model)`` for :func:`quantize` that runs :func:`calibrate_loop` over ``batches``."""
    batches = list(batches)

    def forward_loop(model: nn.Module) -> int:
        return calibrate_loop(model, batches, progress=progress, desc=desc)

    return forward_loop
