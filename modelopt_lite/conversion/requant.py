"""``set_requant``: choose how a model's quantized Linear/Conv layers compute quantized outputs.

``"integer"`` makes every layer whose quantizers fit an int8 kernel compute its output the way ONNX Runtime's
fused ``QLinearConv``/``QGemm`` do (exact integer accumulation, int32 bias, one float32 multiplier), so the torch
model and its ``target="onnxruntime"`` export agree bit for bit; ``"float"`` (the default) is plain fake
quantization. The ``INT8_ORT_CFG`` preset sets ``"integer"`` (a config's top-level ``"requant"`` key).
"""

from __future__ import annotations

from torch import nn

from ..nn.modules._integer_requant import REQUANT_MODES, unfit_reason
from ..nn.modules.quant_conv import _QuantConvNd
from ..nn.modules.quant_linear import QuantLinear


def check_mode(mode) -> str:
    """``mode`` if it is one of ``REQUANT_MODES``, else a ValueError naming the choices."""
    if mode not in REQUANT_MODES:
        raise ValueError(f"requant must be one of {REQUANT_MODES}, got {mode!r}")
    return mode


def set_requant(model: nn.Module, mode: str = "integer") -> dict[str, str | None]:
    """Set ``requant=mode`` on every quantized Linear and Conv of ``model``.

    Returns ``{module name: None}`` for the layers that run the integer requantization and ``{name: reason}`` for
    those that keep the float path (a reason such as ``"output_quantizer is disabled"``); empty for ``"float"``.
    The quantizers are read again at every forward, so calling this before calibration is fine.
    """
    check_mode(mode)
    if not isinstance(model, nn.Module):
        raise TypeError(f"set_requant expects an nn.Module, got {type(model).__name__}")
    report: dict[str, str | None] = {}
    for name, m in model.named_modules():
        if isinstance(m, (QuantLinear, _QuantConvNd)):
            m.requant = mode
            if mode == "integer":
                report[name] = unfit_reason(m)
    return report
