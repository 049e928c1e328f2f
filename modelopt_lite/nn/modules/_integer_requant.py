"""``requant="integer"``: a quantized Linear/Conv computes its quantized output the way a fused int8 kernel does.

By default (``requant="float"``) a quantized layer is ``output_quantizer(conv(input_quantizer(x),
weight_quantizer(W), b))``, with float32 accumulation. With ``requant="integer"`` (set by the ``INT8_ORT_CFG``
preset, or :func:`modelopt_lite.set_requant`) a layer whose three quantizers fit an int8 kernel accumulates the
integer codes exactly, adds the bias as int32 and requantizes with one float32 multiplier per channel (the formula
is in :mod:`modelopt_lite.functional.requant`): exactly what ONNX Runtime's ``QLinearConv``/``QGemm`` compute for
the ``target="onnxruntime"`` export, so torch and ORT agree bit for bit. The result differs from the float path by
at most one output step on a few elements (the bias rounded to its int32 grid, one rounding instead of many).

The layer fits when: input quantizer 8-bit per tensor (static amax); weight quantizer signed, at most 8 bits, per
tensor or per output channel (axis 0), static; output quantizer 8-bit per tensor, static, full range; float32
tensors; a Linear sees a 2-D input (a Gemm in ONNX), a Conv pads with zeros. Otherwise, and while any of the three
quantizers calibrates, the float path runs (:func:`unfit_reason` says why). Training works: the forward value is
the integer one, gradients are those of the float path (straight-through).

The layers opt in by subclassing :class:`IntegerRequantLayer` and saying what is specific to them (the exact
integer product, an extra reason not to fit, the input rank they accept): this module imports no layer module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...formats import int_range, is_float_format
from ...functional import requant as R
from ..tensor_quantizer import TensorQuantizer

REQUANT_MODES = ("float", "integer")


class IntegerRequantLayer(nn.Module):
    """Base of the quantized layers an int8 kernel can run with ``requant="integer"`` (Linear, ConvNd).

    A subclass builds the three quantizers (``QuantModuleMixin``) and overrides :meth:`_integer_product`;
    :meth:`_integer_unfit` and :meth:`_integer_input_fits` add what else keeps it on the float path.
    """

    input_quantizer: TensorQuantizer
    weight_quantizer: TensorQuantizer
    output_quantizer: TensorQuantizer
    weight: torch.Tensor

    def _integer_product(self, codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
        """The layer's op on integer codes held in float64 (exact), without the bias."""
        raise NotImplementedError(f"{type(self).__name__} does not define its integer product")

    def _integer_unfit(self) -> str | None:
        """A layer-specific reason not to run the integer path (None: none)."""
        return None

    def _integer_input_fits(self, x: torch.Tensor) -> bool:
        """Whether this input maps to one fused ONNX Runtime kernel (e.g. a Linear needs a 2-D input)."""
        return True


def _int8_per_tensor(q: TensorQuantizer, what: str) -> str | None:
    if not q.is_enabled:
        return f"{what} is disabled"
    if is_float_format(q.num_bits) or q.num_bits != 8:
        return f"{what} is not 8-bit integer (num_bits={q.num_bits})"
    if q.axis is not None or q.block_sizes:
        return f"{what} is not per tensor"
    if q.dynamic or not q.fake_quant:
        return f"{what} is dynamic or not fake-quantizing"
    return None


def unfit_reason(module: nn.Module) -> str | None:
    """Why ``module``'s quantizers do not fit an int8 kernel with integer requantization (None: they fit)."""
    if not isinstance(module, IntegerRequantLayer):
        return f"{type(module).__name__} is not a quantized Linear or Conv"
    reason = module._integer_unfit()
    if reason:
        return reason
    for q, what in ((module.input_quantizer, "input_quantizer"), (module.output_quantizer, "output_quantizer")):
        reason = _int8_per_tensor(q, what)
        if reason:
            return reason
    out = module.output_quantizer
    if out.narrow_range and not out.unsigned:
        return "output_quantizer is narrow-range (the int8 kernels saturate to the full range)"
    if out.pre_quant_scale is not None:
        return "output_quantizer has a pre_quant_scale"
    w = module.weight_quantizer
    if not w.is_enabled:
        return "weight_quantizer is disabled"
    if is_float_format(w.num_bits) or w.num_bits > 8 or w.unsigned:
        return (
            f"weight_quantizer is not signed integer of at most 8 bits (num_bits={w.num_bits}, unsigned={w.unsigned})"
        )
    if w.block_sizes or w.dynamic or not w.fake_quant or w.pre_quant_scale is not None:
        return "weight_quantizer uses blocks, a dynamic amax, real quantization or a pre_quant_scale"
    if getattr(w, "has_lowrank", False):
        return "weight_quantizer has SVDQuant low-rank factors (a float branch)"
    axes = (w.axis,) if isinstance(w.axis, int) else w.axis
    if axes is not None and tuple(a % module.weight.dim() for a in axes) != (0,):
        return f"weight_quantizer axis={w.axis} (per tensor or per output channel, axis 0)"
    return None


def active(module: IntegerRequantLayer, x: torch.Tensor) -> bool:
    """True when this forward of ``module`` runs the integer requantization."""
    if getattr(module, "requant", "float") != "integer":
        return False
    if torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False  # export/trace the standard graph; the ONNX layout adds the int32 bias itself
    if x.dtype != torch.float32 or module.weight.dtype != torch.float32:
        return False
    if not module._integer_input_fits(x):
        return False
    qs = (module.input_quantizer, module.weight_quantizer, module.output_quantizer)
    if any(q.is_calib_enabled or not q.is_quant_enabled or not q.is_enabled or not q.has_amax for q in qs):
        return False
    return unfit_reason(module) is None


def integer_forward(
    module: IntegerRequantLayer, x: torch.Tensor, float_forward: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The integer-requantized output of ``module`` for ``x``; ``float_forward(input_quantizer(x))`` (the float
    path from the quantized input on) gives the gradients when they are needed."""
    inq, wq, outq = module.input_quantizer, module.weight_quantizer, module.output_quantizer
    # the input quantizer runs once, as usual (its hooks too); its fake-quantized values divide back exactly to codes
    sx, so = inq.scale, outq.scale
    if sx is None or so is None:  # active() admits calibrated (static) quantizers only
        raise RuntimeError(f"{type(module).__name__}: integer requantization needs calibrated input/output quantizers")
    fx = inq(x)
    xc = torch.round(fx / sx)
    wc, sw = wq.quantize_weight_codes(module.weight)
    acc = module._integer_product(xc.double(), wc.double())
    shape = (1, -1) + (1,) * (acc.dim() - 2)  # the output channels are dim 1 (Linear: (N, C); Conv: (N, C, ...))
    out_channels = module.weight.shape[0]
    sw = sw.reshape(-1).expand(out_channels) if sw.numel() == 1 else sw.reshape(-1)
    bias = module.bias  # a Parameter or None
    if isinstance(bias, torch.Tensor):
        acc = acc + R.bias_codes(bias, R.bias_scale(sx, sw)).reshape(shape)
    _, qmin, qmax = int_range(8, outq.unsigned, False)
    codes = R.requantize(acc, R.multiplier(sx, sw, so).reshape(shape), 0, qmin, qmax)
    y = codes * so
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        ref = float_forward(fx)  # its gradients, straight through; the output quantizer's hooks run in there
        return ref + (y - ref).detach()
    # y lies on the output grid, where fake quantization is the identity (|q| <= 255: (q * s) / s rounds back to
    # q in float32): running it keeps the output quantizer's forward hooks working (share_relu_grids uses them)
    return outq(y)
