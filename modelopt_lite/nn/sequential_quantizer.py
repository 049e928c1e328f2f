"""``SequentialQuantizer``: several :class:`TensorQuantizer` applied one after the other to the same tensor.

ModelOpt's W4A8 AWQ config quantizes a weight twice: INT4 in blocks, then FP8 per tensor (the GEMM's format).
A config entry that is a *list* of attribute dicts turns the quantizer it selects into a ``SequentialQuantizer``
(see :func:`modelopt_lite.conversion.model_quant.set_quantizer_by_cfg`), and it can also be built by hand::

    seq = SequentialQuantizer(TensorQuantizer(), TensorQuantizer())
    seq.set_from_attribute_config([{"num_bits": 4, "block_sizes": {-1: 128}}, {"num_bits": (4, 3)}])
    y = seq(w)              # seq[1](seq[0](w))

It is an ``nn.Sequential``: indexing, iteration, ``len`` and ``state_dict`` (``0._amax``, ``1._amax``) work as
usual, and each quantizer keeps its own amax and calibrator, so calibration (:func:`modelopt_lite.calibrate`, or
``enable_calib`` / ``load_calib_amax`` here) treats them one by one. In calibration mode with quantization off,
every quantizer passes its input on unchanged, so each one collects the original tensor (as in ModelOpt).
The switches (``enable``, ``disable``, ``enable_quant``, ...) and ``load_calib_amax`` / ``reset_amax`` apply to
every quantizer of the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from .tensor_quantizer import TensorQuantizer


class SequentialQuantizer(nn.Sequential):
    """An ``nn.Sequential`` of :class:`TensorQuantizer` modules, applied in order (see the module docstring).

    Args:
        *quantizers: one or more ``TensorQuantizer`` instances.

    Raises:
        TypeError: an argument that is not a ``TensorQuantizer``.
        ValueError: no quantizer at all.
    """

    def __init__(self, *quantizers: TensorQuantizer):
        if not quantizers:
            raise ValueError("SequentialQuantizer needs at least one TensorQuantizer")
        for i, q in enumerate(quantizers):
            if not isinstance(q, TensorQuantizer):
                raise TypeError(f"SequentialQuantizer: argument {i} must be a TensorQuantizer, got {type(q).__name__}")
        super().__init__(*quantizers)

    def __iter__(self) -> Iterator[TensorQuantizer]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    # --- configuration -----------------------------------------------------------------------------------------
    def set_from_attribute_config(self, attributes) -> None:
        """Configure the quantizers: a list/tuple gives one attribute dict per quantizer (same length), a single dict
        (or descriptor) is applied to every quantizer. Errors name the position of the rejected entry."""
        if isinstance(attributes, Sequence) and not isinstance(attributes, (str, bytes)):
            if len(attributes) != len(self):
                raise ValueError(
                    f"SequentialQuantizer of {len(self)} quantizers got {len(attributes)} attribute configs"
                )
            pairs = list(zip(attributes, self))
        elif isinstance(attributes, Mapping) or hasattr(attributes, "dict"):
            pairs = [(attributes, q) for q in self]
        else:
            raise TypeError(
                f"SequentialQuantizer attributes must be a list of dicts or one dict, got {type(attributes).__name__}"
            )
        for i, (attrs, q) in enumerate(pairs):
            try:
                q.set_from_attribute_config(attrs)
            except (TypeError, ValueError) as e:
                raise type(e)(f"SequentialQuantizer[{i}]: {e}") from e

    # --- switches and calibration, applied to every quantizer --------------------------------------------------------
    def enable(self) -> None:
        """Turn every quantizer on."""
        for q in self:
            q.enable()

    def disable(self) -> None:
        """Turn every quantizer off (the sequence then returns its input)."""
        for q in self:
            q.disable()

    def enable_quant(self) -> None:
        """Quantize in forward (every quantizer)."""
        for q in self:
            q.enable_quant()

    def disable_quant(self) -> None:
        """Stop quantizing in forward (every quantizer)."""
        for q in self:
            q.disable_quant()

    def enable_calib(self) -> None:
        """Collect calibration statistics (every quantizer)."""
        for q in self:
            q.enable_calib()

    def disable_calib(self) -> None:
        """Stop collecting calibration statistics (every quantizer)."""
        for q in self:
            q.disable_calib()

    def load_calib_amax(self, *args, **kwargs) -> None:
        """``load_calib_amax(*args, **kwargs)`` on every quantizer, in order."""
        for q in self:
            q.load_calib_amax(*args, **kwargs)

    def reset_amax(self) -> None:
        """Forget every quantizer's amax and calibration statistics."""
        for q in self:
            q.reset_amax()

    @property
    def is_enabled(self) -> bool:
        """True when at least one quantizer of the sequence is on."""
        return any(q.is_enabled for q in self)

    @property
    def fake_quant(self) -> bool:
        """True when every quantizer fake-quantizes (returns floats)."""
        return all(q.fake_quant for q in self)

    @property
    def _calibrator(self):
        """pytorch-quantization's loop asks ``module._calibrator``: the first quantizer's calibrator."""
        return self[0].calibrator

    @staticmethod
    def tensor_quantizer_iterator(quantizers) -> Iterator[TensorQuantizer]:
        """The ``TensorQuantizer`` modules of ``quantizers`` (a sequence, or one quantizer itself; None: none)."""
        if quantizers is None:
            return
        if isinstance(quantizers, TensorQuantizer):
            yield quantizers
        elif isinstance(quantizers, SequentialQuantizer):
            yield from quantizers
        else:
            raise TypeError(f"expected a TensorQuantizer or a SequentialQuantizer, got {type(quantizers).__name__}")

    @staticmethod
    @contextlib.contextmanager
    def convert_to_single_quantizer(model: nn.Module, indx: int = 0) -> Iterator[None]:
        """ModelOpt's context manager: inside it, every ``SequentialQuantizer`` of ``model`` is replaced by its
        quantizer number ``indx`` (to calibrate or inspect that one alone); on exit the very same sequences are put
        back, also when the body raises.

        Raises:
            TypeError: ``indx`` is not an int.
            ValueError: a sequence has no quantizer ``indx`` (the message names it); nothing is replaced then.
        """
        if isinstance(indx, bool) or not isinstance(indx, int):
            raise TypeError(f"convert_to_single_quantizer: indx must be an int, got {indx!r}")
        found = [(n, m) for n, m in model.named_modules() if n and isinstance(m, SequentialQuantizer)]
        for name, seq in found:
            if not -len(seq) <= indx < len(seq):
                raise ValueError(f"convert_to_single_quantizer: {name!r} has {len(seq)} quantizers, no index {indx}")
        swapped = []
        for name, seq in found:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, seq[indx])
            swapped.append((parent, attr, seq))
        try:
            yield
        finally:
            for parent, attr, seq in reversed(swapped):
                setattr(parent, attr, seq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` through every quantizer in order (a new tensor; ``x`` is never modified)."""
        for q in self:
            x = q(x)
        return x
