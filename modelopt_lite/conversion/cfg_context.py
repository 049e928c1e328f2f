"""``set_quantizer_by_cfg_context``: ModelOpt's context manager that applies a ``quant_cfg`` for a block only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .config import QuantConfig
from .model_quant import _apply_cfg, _Replacements
from .state import snapshot_quantizers
from .utils import named_quantizers


@contextlib.contextmanager
def set_quantizer_by_cfg_context(model: nn.Module, quant_cfg: dict | QuantConfig) -> Iterator[dict[str, list[str]]]:
    """Apply ``quant_cfg`` as :func:`~modelopt_lite.conversion.model_quant.set_quantizer_by_cfg` does, and put every
    quantizer back exactly as it was (settings, switches, amax, calibrators; a quantizer a list entry replaced by a
    ``SequentialQuantizer`` returns to its owner) when the block ends, also on an exception. Yields what was applied
    (``{quantizer: [labels]}``). A config that is rejected raises before the block runs, changing nothing.
    """
    before = snapshot_quantizers(q for _, q in named_quantizers(model))
    replaced = _Replacements()
    try:
        applied = _apply_cfg(model, quant_cfg, replaced.done)
    except BaseException:
        replaced.undo()
        before.restore()
        raise
    try:
        yield applied
    finally:
        replaced.undo()
        before.restore()
