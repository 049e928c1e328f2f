"""The functional layer: descriptors and exact, autograd-aware quantization functions.

Scale convention (everywhere in modelopt_lite, as in ONNX): ``scale = float32(amax) / bound`` and
``x ~= q * scale``. (NVIDIA's tools return the inverse, a multiplier; ours is the value an exported
QuantizeLinear/DequantizeLinear stores.) Integer quantization is ``q = clamp(rint(x / scale), qmin, qmax)``
with a true float32 division and round-half-to-even, bit-exact with ONNX Runtime.

Data flows descriptor -> TensorQuantizer -> these functions -> ``torch.ops.modelopt_lite.*`` -> a kernel
(pure-torch reference, C++ or CUDA; see :mod:`modelopt_lite.functional.backend`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .descriptor import (  # noqa: F401  (re-exported API)
    QUANT_DESC_4BIT_BLOCK_WEIGHT,
    QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW,
    QUANT_DESC_8BIT_PER_TENSOR,
    QUANT_DESC_FP8_PER_TENSOR,
    QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR,
    QuantDescriptor,
    ScaledQuantDescriptor,
)
from .formats import (
    CODE_TYPES,
    TORCH_CODE_TYPES,
    ElementFormat,
    element_format,
    float_codes,
    int_range,
    scaled_float_format,
    torch_dtype_range,
)
from .functional import blocks, eager, library, library_block, library_block_cuda, library_minifloat, reference
from .functional.amax_scale import checked_scale
from .functional.checks import (
    as_amax,
    check_input,
    check_unsigned_input,
)
from .functional.scales import affine_params, bound_of, positive_scale, scale_from_amax

#: the fake-quant op of each float32-scaled floating-point format (by ``ElementFormat.name``)
SCALED_FLOAT_OPS = {
    "e4m3": library.fake_e4m3,
    "e5m2": library_minifloat.fake_e5m2,
    "e2m1": library_minifloat.fake_e2m1,
}


def _int_scale(inputs, amax, num_bits, unsigned, narrow_range, fusable=True):
    """``(scale, qmin, qmax, fused, after)``: ``fused`` when the unsigned input check is left to the kernel's own
    pass (``fusable`` and :func:`.functional.library.fuses_unsigned_check`: the caller runs a ``*_uint`` op), else it
    ran here; ``after()``, called once the quantization kernel is launched, queues a deferred amax check
    (:func:`.functional.amax_scale.checked_scale`)."""
    check_input(inputs)
    amax = as_amax(amax, inputs, check_values=False)
    bound, qmin, qmax = int_range(num_bits, unsigned, narrow_range)
    fused = bool(unsigned) and fusable and library.fuses_unsigned_check(inputs)
    if unsigned and not fused:
        check_unsigned_input(inputs)
    scale, after = checked_scale(amax, bound)
    return scale, qmin, qmax, fused, after


# --- float64 inputs: computed in float32 (the exact grid every backend and ONNX Runtime share) ---------------------
def _to_compute(inputs):
    """``(inputs as computed, dtype to return)``: float64 is computed in float32 and returned as float64."""
    if isinstance(inputs, torch.Tensor) and inputs.dtype == torch.float64:
        return inputs.float(), torch.float64
    return inputs, None


def _back(y: torch.Tensor, dtype) -> torch.Tensor:
    return y if dtype is None else y.to(dtype)


# --- the two familiar call layouts ------------------------------------------------------------------------------------
# ModelOpt:             fake_tensor_quant(inputs, amax, bias=None, num_bits=8, unsigned=False, narrow_range=True)
# pytorch-quantization: fake_tensor_quant(inputs, amax, num_bits=8, [output_dtype,] unsigned=False, narrow_range=True)
_ARG_DEFAULTS = {"bias": None, "num_bits": 8, "output_dtype": None, "unsigned": False, "narrow_range": True}
_MODELOPT_ORDER = ("bias", "num_bits", "unsigned", "narrow_range")


def _call_args(fn: str, args: tuple, **given) -> dict:
    """Merge positional arguments of either layout with the keywords (``given``; defaults where not passed).

    The third positional argument decides the layout: None, a tensor or a float is ModelOpt's ``bias``; an int or an
    ``(E, M)`` tuple is pytorch-quantization's ``num_bits``, which may be followed by a ``torch.dtype`` (the
    ``output_dtype`` of its user guide).
    """
    if not args:
        return given
    if args[0] is None or isinstance(args[0], (torch.Tensor, float)):
        order: tuple[str, ...] = _MODELOPT_ORDER
    elif len(args) > 1 and isinstance(args[1], torch.dtype):
        order = ("num_bits", "output_dtype", "unsigned", "narrow_range")
    else:
        order = ("num_bits", "unsigned", "narrow_range")
    if len(args) > len(order):
        raise TypeError(f"{fn}() takes at most {2 + len(order)} positional arguments here ({', '.join(order)})")
    out = dict(given)
    for name, value in zip(order, args):
        v, default = given[name], _ARG_DEFAULTS[name]
        if v is not default and (isinstance(v, torch.Tensor) or v != default):
            raise TypeError(f"{fn}() got multiple values for argument {name!r}")
        out[name] = value
    return out


def _bias_tensor(bias, x: torch.Tensor) -> torch.Tensor:
    if isinstance(bias, bool) or not isinstance(bias, (torch.Tensor, int, float)):
        raise TypeError(f"bias must be None, a number or a tensor, got {type(bias).__name__}")
    b = torch.as_tensor(bias, dtype=torch.float32, device=x.device) if not isinstance(bias, torch.Tensor) else bias
    if not b.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor, got {b.dtype}")
    b = b.to(device=x.device, dtype=torch.float32)
    if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()) and not bool(torch.isfinite(b).all()):
        raise ValueError("bias must be finite")
    return b


def _check_output_dtype(output_dtype, fake: bool):
    if output_dtype is None:
        return None
    if not isinstance(output_dtype, torch.dtype):
        raise TypeError(f"output_dtype (dtype) must be a torch.dtype, got {output_dtype!r}")
    if fake and not output_dtype.is_floating_point:
        raise TypeError(f"fake quantization returns floats; output_dtype must be a floating dtype, got {output_dtype}")
    return output_dtype


def fake_tensor_quant(inputs, amax, *args, bias=None, num_bits=8, unsigned=False, narrow_range=True, output_dtype=None):
    """Fake-quantize (quantize then dequantize) ``inputs`` with range ``amax``.

    Both familiar call layouts work, positionally or by keyword: ModelOpt's
    ``fake_tensor_quant(inputs, amax, bias=None, num_bits=8, unsigned=False, narrow_range=True)`` and
    pytorch-quantization's ``fake_tensor_quant(inputs, amax, num_bits=8, [output_dtype,] unsigned=False,
    narrow_range=True)``. A third positional argument that is None, a tensor or a float is ``bias``; an int or
    ``(4, 3)`` is ``num_bits``.

    Args:
        inputs: float32/float16/bfloat16/float64 tensor (any layout; computed in float32, returned in its dtype).
        amax: a number, a 1-element tensor (per tensor), or a tensor with the input's rank and size 1 on the
            reduced dims (per channel / per axis). Must be finite and >= 0; ``amax <= 2**-24`` gives zeros.
        bias: None, or a number/tensor broadcastable to ``inputs``: ``y = fq(x - bias) + bias`` (computed in
            float32).
        num_bits: 1..16, or ``(4, 3)`` / ``(5, 2)`` / ``(2, 1)`` for FP8 E4M3 / FP8 E5M2 / FP4 E2M1.
        unsigned: use ``[0, 2**b - 1]`` (inputs must be >= 0).
        narrow_range: signed grid ``[-(2**(b-1) - 1), 2**(b-1) - 1]`` instead of ``[-2**(b-1), ...]``.
        output_dtype: None (the input's dtype) or a floating dtype to return.

    Gradient: straight-through inside ``[qmin * scale, qmax * scale]`` (ends included); a learnable amax gets the
    LSQ gradient.
    """
    p = _call_args(
        "fake_tensor_quant",
        args,
        bias=bias,
        num_bits=num_bits,
        unsigned=unsigned,
        narrow_range=narrow_range,
        output_dtype=output_dtype,
    )
    out_dtype = _check_output_dtype(p["output_dtype"], fake=True)
    x, back = _to_compute(inputs)
    b = None
    if p["bias"] is not None:
        check_input(x)
        b = _bias_tensor(p["bias"], x)
        back = back or x.dtype
        x = x.float() - b
    fmt = scaled_float_format(p["num_bits"])
    if fmt is not None:
        y = fake_float_quant(x, amax, fmt)
    else:
        scale, qmin, qmax, fused, after = _int_scale(x, amax, p["num_bits"], p["unsigned"], p["narrow_range"])
        y = eager.call(library.fake_quant_uint if fused else library.fake_quant_int, x, scale, qmin, qmax)
        after()
    if b is not None:
        y = y + b
    return _back(y, out_dtype or back)


def tensor_quant(
    inputs, amax, *args, bias=None, num_bits=8, unsigned=False, narrow_range=True, output_dtype=None, dtype=None
):
    """Real quantization: returns ``(q, scale)`` with ``q * scale`` the dequantized tensor.

    Call layouts as :func:`fake_tensor_quant` (ModelOpt's with ``bias`` third, pytorch-quantization's with
    ``num_bits`` third and an optional ``output_dtype`` fourth). ``q`` holds integers, as float32 by default (float64
    for float64 inputs, which are computed in float32) or as ``dtype``/``output_dtype`` (float32, int8, uint8, int16,
    int32) on request; ``scale`` (float32) has amax's shape and is strictly positive (a dead slice reports 1.0 and
    has all-zero codes). For ``num_bits=(4, 3)`` / ``(5, 2)`` q is a ``torch.float8_e4m3fn`` / ``float8_e5m2`` tensor;
    for ``(2, 1)`` (E2M1, no torch dtype) the float32 grid values.

    Unlike the NVIDIA tools, ``scale`` is ``amax / bound`` (the value a QuantizeLinear stores), not the multiplier
    ``bound / amax``; with ``bias`` the codes are those of ``x - bias`` and ``q * scale + bias`` dequantizes.
    """
    p = _call_args(
        "tensor_quant",
        args,
        bias=bias,
        num_bits=num_bits,
        unsigned=unsigned,
        narrow_range=narrow_range,
        output_dtype=output_dtype,
    )
    if dtype is not None and p["output_dtype"] is not None and dtype != p["output_dtype"]:
        raise TypeError(f"tensor_quant() got dtype={dtype} and output_dtype={p['output_dtype']}; give one")
    want = _check_output_dtype(dtype if dtype is not None else p["output_dtype"], fake=False)
    x, back = _to_compute(inputs)
    if p["bias"] is not None:
        check_input(x)
        x = x.float() - _bias_tensor(p["bias"], x)
    nb = p["num_bits"]
    fmt = scaled_float_format(nb)
    if fmt is not None:
        check_input(x)
        scale, after = checked_scale(as_amax(amax, x, check_values=False), fmt.bound)
        codes = float_codes(fmt, x, scale)
        after()
        return codes, positive_scale(scale)
    scale, qmin, qmax, fused, after = _int_scale(x, amax, nb, p["unsigned"], p["narrow_range"])
    q = (library.quantize_uint if fused else library.quantize_int)(x, scale, qmin, qmax)
    after()
    if want is None:
        return _back(q, back), positive_scale(scale)
    return _cast_codes(q, want, qmin, qmax), positive_scale(scale)


def _cast_codes(q: torch.Tensor, dtype, qmin: int, qmax: int) -> torch.Tensor:
    if dtype in (torch.float32, torch.float64):
        return q.to(dtype)
    dtype_range = torch_dtype_range(dtype)
    if dtype_range is None:
        choices = [CODE_TYPES[n].torch_dtype for n in TORCH_CODE_TYPES]
        raise TypeError(f"dtype must be float32, float64 or one of {choices}, got {dtype}")
    lo, hi = dtype_range
    if qmin < lo or qmax > hi:
        raise ValueError(f"codes in [{qmin}, {qmax}] do not fit {dtype} [{lo}, {hi}]")
    if bool(torch.isnan(q).any()):
        raise ValueError("inputs contain NaN, which has no integer code; clean the input or request float32 codes")
    return q.to(dtype)


def scaled_e4m3(inputs, amax=None, E=4, M=3):
    """Fake-quantize to FP8 E4M3: ``e4m3(clamp(x / s, -448, 448)) * s`` with ``s = amax / 448``.

    Saturating (never NaN from overflow), round-to-nearest-even, subnormals kept; ``amax=None`` means scale 1;
    ``amax <= 2**-24`` gives zeros.
    """
    if (E, M) != (4, 3):
        raise ValueError(f"only E4M3 is supported, got E={E}, M={M}")
    return fake_float_quant(inputs, amax, element_format((4, 3)))


def fake_float_quant(inputs, amax, fmt: ElementFormat):
    """Fake-quantize to a float32-scaled float format (:data:`SCALED_FLOAT_OPS`: E4M3, E5M2, E2M1):
    ``fmt.round(x / s) * s`` with ``s = amax / fmt.bound`` (saturating round-half-to-even, subnormals kept; 0 where
    ``amax <= 2**-24``); ``amax=None`` means scale 1."""
    x, back = _to_compute(inputs)
    check_input(x)
    if amax is None:
        return _back(SCALED_FLOAT_OPS[fmt.name](x, torch.ones((), dtype=torch.float32, device=x.device)), back)
    scale, after = checked_scale(as_amax(amax, x, check_values=False), fmt.bound)
    y = SCALED_FLOAT_OPS[fmt.name](x, scale)
    after()
    return _back(y, back)


def scaled_e4m3_abstract(input, amax=None):
    """Fake (meta) implementation of :func:`scaled_e4m3`: an empty tensor with the input's shape and dtype.

    The registered fake impl of ``torch.ops.modelopt_lite.fake_e4m3`` is the same function.
    """
    return torch.empty_like(input)


def _range_tensor(v, x, what):
    if isinstance(v, torch.Tensor):
        return v.to(device=x.device, dtype=torch.float32)
    try:
        return torch.tensor(float(v), dtype=torch.float32, device=x.device)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number or a tensor, got {v!r}") from None


def _affine(inputs, min_range, max_range, num_bits):
    check_input(inputs)
    lo, hi = _range_tensor(min_range, inputs, "min_range"), _range_tensor(max_range, inputs, "max_range")
    for name, t in (("min_range", lo), ("max_range", hi)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite, got {t.flatten()[~torch.isfinite(t.flatten())][0].item()}")
    if bool((lo > hi).any()):
        raise ValueError(f"min_range must be <= max_range, got {lo.min().item()} > {hi.max().item()}")
    if isinstance(num_bits, bool) or not isinstance(num_bits, int) or not 2 <= num_bits <= 16:
        raise ValueError(f"num_bits for affine quantization must be an int in 2..16, got {num_bits!r}")
    return affine_params(lo, hi, num_bits)


def fake_affine_tensor_quant(inputs, min_range, max_range, num_bits=8):
    """Asymmetric fake quantization with a zero point (gemmlowp style; exports as QuantizeLinear with a zp).

    ``scale = (hi - lo) / (2**b - 1)`` over the range widened to include 0, ``zp = clamp(rint(qmin - lo/scale))``,
    ``y = (clamp(rint(x / scale) + zp, qmin, qmax) - zp) * scale`` with ``[qmin, qmax] = [-2**(b-1), 2**(b-1)-1]``.
    Zero maps exactly to 0.
    """
    x, back = _to_compute(inputs)
    scale, zp, qmin, qmax = _affine(x, min_range, max_range, num_bits)
    return _back(library.fake_affine(x, scale, zp, qmin, qmax), back)


def affine_tensor_quant(inputs, min_range, max_range, num_bits=8):
    """Real asymmetric quantization: ``(q, scale, zero_point)`` with ``(q - zero_point) * scale`` dequantizing."""
    x, back = _to_compute(inputs)
    scale, zp, qmin, qmax = _affine(x, min_range, max_range, num_bits)
    return _back(library.quantize_affine(x, scale, zp, qmin, qmax), back), positive_scale(scale), zp


# --- block quantization ---------------------------------------------------------------------------------------------
def quantize_block_scales(scale: torch.Tensor, scale_bits, scale_block_sizes=None) -> torch.Tensor:
    """Double quantization: fake-quantize per-block scales with ``scale_bits`` (unsigned int or E4M3).

    Each group (``scale_block_sizes`` blocks of the scale tensor, or the whole tensor) gets ``amax = max(scale)``.
    Returns the dequantized scales, which the element quantization then uses as they are.
    """
    unsigned = scaled_float_format(scale_bits) is None  # integer scale codes are unsigned
    if scale_block_sizes:
        s_amax = blocks.block_amax(scale, scale_block_sizes)
        return fake_block_quant(scale, scale_block_sizes, s_amax, num_bits=scale_bits, unsigned=unsigned)
    s_amax = scale.detach().reshape(-1).amax(0) if scale.numel() else scale.new_zeros(())  # dim given: dynamo export
    return fake_tensor_quant(scale, s_amax, scale_bits, unsigned=unsigned, narrow_range=False)


def block_scales(inputs, block_sizes: dict, amax=None, num_bits=4, unsigned=False, narrow_range=False):
    """Per-block scales (shape: blocks per axis) for :func:`fake_block_quant`, double-quantized if asked."""
    inputs, _ = _to_compute(inputs)
    check_input(inputs)
    sizes = blocks.normalize(block_sizes, inputs.shape)
    bound = bound_of(num_bits, unsigned, narrow_range)
    if amax is None:
        scale = scale_from_amax(blocks.block_amax(inputs, block_sizes), bound)  # measured here: nothing to check
    else:
        if isinstance(amax, torch.Tensor) and amax.numel() != 1:  # blocks-per-axis shape: no broadcast against x
            if not amax.is_floating_point():
                raise TypeError(f"block amax must be a floating-point tensor, got {amax.dtype}")
            amax = amax.to(device=inputs.device, dtype=torch.float32)
        else:
            amax = as_amax(amax, inputs, "block amax", check_values=False)
        expected = blocks.blocks_shape(inputs.shape, sizes)
        if amax.dim() == 2 and amax.shape[1] == 1 and amax.numel() == torch.Size(expected).numel() > 1:
            amax = amax.reshape(expected)  # ModelOpt's flat layout (one row per block, in row-major block order)
        if amax.numel() != 1 and tuple(amax.shape) != expected:
            raise ValueError(
                f"block amax has shape {tuple(amax.shape)}, expected {expected} for block_sizes "
                f"{block_sizes} on inputs of shape {tuple(inputs.shape)}"
            )
        scale, after = checked_scale(amax, bound, "block amax")
        after()
    if block_sizes.get("scale_bits") is not None:
        scale = quantize_block_scales(scale, block_sizes["scale_bits"], block_sizes.get("scale_block_sizes"))
    return scale, sizes


def fake_block_quant(inputs, block_sizes: dict, amax=None, num_bits=4, unsigned=False, narrow_range=False):
    """Fake-quantize with one scale per block (static ``amax`` of shape blocks-per-axis, or dynamic if None).

    A dimension that is not a multiple of its block size is zero-padded internally; ``block_sizes`` may carry
    ``"scale_bits"`` / ``"scale_block_sizes"`` for double quantization of the scales.
    """
    x, back = _to_compute(inputs)
    if not unsigned and library_block_cuda.fused_device(x):
        check_input(x)
        y = library_block_cuda.fake_block_quant_fused(x, block_sizes, amax, num_bits, narrow_range)
        if y is not None:  # one CUDA pass: block amax (or the static one), scale, quantize
            return _back(y, back)
    fmt = scaled_float_format(num_bits)
    fused = library_block.fused_block(x, block_sizes, amax, fmt.name if fmt else None, unsigned)
    if fused is not None:  # blocks along the last axis: amax, scale and quantization in one pass
        _, qmin, qmax = int_range(num_bits, unsigned, narrow_range) if fmt is None else (0, 0, 0)
        kind = library_block.KINDS[fmt.name if fmt else "int"]
        bound = bound_of(num_bits, unsigned, narrow_range)
        y, _ = eager.call(library_block.fake_block_last, x, fused[1], fused[0], kind, bound, qmin, qmax)
        return _back(y, back)
    scale, sizes = block_scales(x, block_sizes, amax, num_bits, unsigned, narrow_range)
    if unsigned:
        check_unsigned_input(x)
    xb, pad = blocks.to_blocks(x, sizes)
    sb = blocks.expand_amax(scale.expand(blocks.blocks_shape(x.shape, sizes)), sizes)
    if fmt is not None:
        yb = SCALED_FLOAT_OPS[fmt.name](xb, sb)
    else:
        _, qmin, qmax = int_range(num_bits, unsigned, narrow_range)
        yb = library.fake_quant_int(xb, sb, qmin, qmax)
    return _back(blocks.from_blocks(yb, x.shape, pad), back)


def block_quant(inputs, block_sizes: dict, amax=None, num_bits=4, unsigned=False, narrow_range=False):
    """Real block quantization: ``(q, scale)``; q (float32 codes) has the input's shape, scale blocks-per-axis."""
    fmt = scaled_float_format(num_bits)
    if fmt is not None:
        raise ValueError(f"block_quant returns integer codes; use fake_block_quant for {fmt.name.upper()} blocks")
    x, back = _to_compute(inputs)
    scale, sizes = block_scales(x, block_sizes, amax, num_bits, unsigned, narrow_range)
    _, qmin, qmax = int_range(num_bits, unsigned, narrow_range)
    xb, pad = blocks.to_blocks(x, sizes)
    sb = blocks.expand_amax(scale.expand(blocks.blocks_shape(x.shape, sizes)), sizes)
    q = blocks.from_blocks(library.quantize_int(xb, sb, qmin, qmax), x.shape, pad)
    return _back(q, back), positive_scale(scale)


# --- autograd-style classes with the familiar names ------------------------------------------------------------------
class _OpFunction:
    """Familiar ``X.apply(...)`` entry points. Autograd comes from the registered ops themselves."""


class FakeTensorQuantFunction(_OpFunction):
    """``apply(inputs, amax, num_bits=8, unsigned=False, narrow_range=True)`` or ModelOpt's ``apply(inputs, amax,
    bias=None, num_bits=8, unsigned=False, narrow_range=True)``: see :func:`fake_tensor_quant`."""

    apply = staticmethod(fake_tensor_quant)


class TensorQuantFunction(_OpFunction):
    """``apply(inputs, amax, num_bits=8, unsigned=False, narrow_range=True)`` (or ModelOpt's layout with ``bias``
    third) -> ``(q, scale)``: see :func:`tensor_quant`."""

    apply = staticmethod(tensor_quant)


class ScaledE4M3Function(_OpFunction):
    """``apply(inputs, amax=None, E=4, M=3)``: see :func:`scaled_e4m3`."""

    apply = staticmethod(scaled_e4m3)


class FakeAffineTensorQuantFunction(_OpFunction):
    """``apply(inputs, min_range, max_range, num_bits=8)``: see :func:`fake_affine_tensor_quant`."""

    apply = staticmethod(fake_affine_tensor_quant)


class LegacyFakeTensorQuantFunction(torch.autograd.Function):
    """Same numerics as :class:`FakeTensorQuantFunction`, computed by the pure-torch reference only."""

    @staticmethod
    def forward(ctx, inputs, amax, num_bits=8, unsigned=False, narrow_range=True):
        scale, qmin, qmax, _, after = _int_scale(inputs, amax, num_bits, unsigned, narrow_range, fusable=False)
        after()
        ctx.save_for_backward(inputs, scale)
        ctx.qrange = (qmin, qmax)
        return reference.fake_quant_int(inputs, scale, qmin, qmax)

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        qmin, qmax = ctx.qrange
        gx, _ = reference.int_backward(grad, x, scale, qmin, qmax, False)
        return gx, None, None, None, None


legacy_fake_tensor_quant = LegacyFakeTensorQuantFunction.apply


class _Unbound:
    """A function that stays unbound when stored as a class attribute, as ``torch.autograd.Function.apply`` does:
    ModelOpt's tests and users write ``self.fn = tensor_quant.fake_tensor_quant`` (or set it on the class) and call
    ``self.fn(x, amax)``. Name, docstring and signature are the function's."""

    __wrapped__: Callable[..., Any]  # set by functools.update_wrapper

    def __init__(self, fn):
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<function {self.__wrapped__.__qualname__}>"


fake_tensor_quant = _Unbound(fake_tensor_quant)
tensor_quant = _Unbound(tensor_quant)
scaled_e4m3 = _Unbound(scaled_e4m3)
fake_affine_tensor_quant = _Unbound(fake_affine_tensor_quant)
affine_tensor_quant = _Unbound(affine_tensor_quant)
fake_block_quant = _Unbound(fake_block_quant)
block_quant = _Unbound(block_quant)
