"""Real quantized modules: ``QuantizedLinear`` and ``QuantizedConv2d`` store integer weight codes and scales.

State (buffers, so ``state_dict`` holds the compact form):

- ``weight``: int8 codes, or ``weight_packed``: uint8 with two 4-bit codes per byte (see :mod:`.packing`);
- ``weight_scale``: float32; shape ``()`` per tensor, ``(out,)`` per output channel (or keepdims for other axes),
  or blocks-per-axis for block quantization;
- ``bias``: in the original float dtype (or absent);
- ``input_scale``: float32 ``(num_steps,)``, the activation scale per temporal step (``scale = amax / bound``; 0
  means a dead range: all codes 0). Absent for weight-only quantization.
- ``pre_quant_scale``: float32 ``(in_features,)``, SmoothQuant's input multiplier (Linear only; absent unless the
  fake-quant input quantizer had one): the input is multiplied by it before it is quantized.

Compute paths (``module.compute``):

- ``"int8"``: activations are quantized to integer codes with the exact ``quantize_int`` op and multiplied with
  the weight codes through an exact integer GEMM (:mod:`.int8_gemm`); used when the input is quantized per tensor
  with <= 8 bits and the weights per tensor or per output channel with <= 8 bits.
- ``"dequant"``: weights are dequantized (``q * scale`` in float32, the very product fake quantization computes)
  and the float op runs on the (fake-quantized) input: bit-identical to the fake-quant module. Used for
  weight-only models, block-quantized (INT4) weights and W4A8; the storage is still compressed.

The float32 scales stay float32 through ``.half()`` / ``.to()``; the int8 path computes in float32 and returns the
input's dtype.
"""

from __future__ import annotations

from typing import cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import int_range
from ..functional import blocks, library
from . import fast_gemm, fp8, int8_gemm, microscaling
from .packing import dequantize_weight, unpack_int4

_FP32_BUFFERS = ("weight_scale", "input_scale", "pre_quant_scale", "weight_global_scale")


_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def _dtype(name: str) -> torch.dtype:
    if str(name) not in _DTYPES:
        raise ValueError(f"unsupported dtype name {name!r} in a real module spec; expected one of {sorted(_DTYPES)}")
    return _DTYPES[str(name)]


def weight_scale_shape(spec: dict) -> tuple[int, ...]:
    """Shape of ``weight_scale`` for a module spec."""
    w = spec["weight"]
    shape = tuple(spec["weight_shape"])
    if w["layout"] == "tensor":
        return ()
    if w["layout"] == "channel":
        axes = {a % len(shape) for a in w["axis"]}
        return tuple(n if d in axes else 1 for d, n in enumerate(shape)) if axes != {0} else (shape[0],)
    sizes = blocks.normalize(block_sizes_from_json(w["block_sizes"]), shape)
    return blocks.blocks_shape(shape, sizes)


@overload
def block_sizes_from_json(bs: dict) -> dict: ...
@overload
def block_sizes_from_json(bs: None) -> None: ...
def block_sizes_from_json(bs: dict | None) -> dict | None:
    """``{"-1": 128}`` (JSON keys) -> ``{-1: 128}``."""
    return None if bs is None else {int(k): (None if v is None else int(v)) for k, v in bs.items()}


def check_input(module: nn.Module, x: torch.Tensor) -> None:
    """Host-metadata checks of a real module's input (always), and the opt-in NaN/Inf scan (``module.validate``)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = type(x).__name__ if not isinstance(x, torch.Tensor) else str(x.dtype)
        raise TypeError(f"{type(module).__name__} {module.label!r}: expected a floating-point tensor, got {got}")
    anchor = next((t for t in fast_gemm.own_buffers(module) if t is not None), None)
    if anchor is not None and x.device != anchor.device:
        raise ValueError(f"{type(module).__name__} {module.label!r}: input on {x.device}, weights on {anchor.device}")
    k = getattr(module, "in_features", None)
    if k is not None and (x.dim() == 0 or x.shape[-1] != k):
        raise ValueError(f"{type(module).__name__} {module.label!r}: expected a last dim of {k}, got {tuple(x.shape)}")
    if module.validate and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{type(module).__name__} {module.label!r}: the input contains NaN or Inf (validate=True)")


class _RealQuantModule(nn.Module):
    """Shared state handling of the real modules (built from a JSON-able ``spec`` dict; see :mod:`.convert`)."""

    # buffers registered in __init__ (which of them exist depends on the spec; see the module docstring)
    weight: torch.Tensor
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None
    pre_quant_scale: torch.Tensor | None

    def __init__(self, spec: dict, backend: str = "auto"):
        super().__init__()
        self.spec = spec
        self.backend = int8_gemm.check_backend(backend)
        self.step = 0
        w, shape = spec["weight"], tuple(spec["weight_shape"])
        self.weight_dtype = _dtype(w["dtype"])
        if microscaling.is_microscaling(w):  # NVFP4 / MX (see .microscaling)
            for k, t in microscaling.weight_buffers(w, shape).items():
                self.register_buffer(k, t)
        elif w["storage"] in ("int8", "e4m3"):
            dt = torch.int8 if w["storage"] == "int8" else torch.float8_e4m3fn
            self.register_buffer("weight", torch.zeros(shape, dtype=dt))
        else:
            self.register_buffer("weight_packed", torch.zeros(shape[:-1] + ((shape[-1] + 1) // 2,), dtype=torch.uint8))
        if not microscaling.is_microscaling(w):
            self.register_buffer("weight_scale", torch.ones(weight_scale_shape(spec), dtype=torch.float32))
        bias = spec.get("bias")
        self.register_buffer("bias", None if bias is None else torch.zeros(shape[0], dtype=_dtype(bias)))
        inp = spec.get("input")
        self.num_steps = 1 if inp is None else int(inp["num_steps"])
        static = inp is not None and inp.get("dynamic") is None
        self.register_buffer("input_scale", torch.ones(self.num_steps, dtype=torch.float32) if static else None)
        # SmoothQuant's scale sits in the input entry; a weight-only Linear (AWQ's unfolded scale) has it at the top
        pqs = (inp is not None and inp.get("pre_quant_scale", False)) or bool(spec.get("pre_quant_scale", False))
        self.register_buffer("pre_quant_scale", torch.ones(shape[-1], dtype=torch.float32) if pqs else None)
        if inp is not None and not microscaling.is_microscaling(inp):
            _, self._qmin, self._qmax = int_range(inp["num_bits"], inp["unsigned"], inp["narrow_range"])
        self._kernel: int8_gemm.LinearKernel | int8_gemm.Conv2dKernel | None = None
        self._kernel_key: tuple | None = None
        self.fast_kind = fast_gemm.kind_of(spec)
        why = fast_gemm.why_not(spec, backend)
        if why is not None:
            raise ValueError(f"{type(self).__name__}: backend {backend!r} cannot compute this module: {why}")
        #: opt-in NaN/Inf scan of every input (a host read-back per call; see :func:`.convert.set_validate`)
        self.validate = False
        self.label = ""

    # --- properties ------------------------------------------------------------------------------------------------
    @property
    def compute(self) -> str:
        """``"int8"`` (integer GEMM) or ``"dequant"`` (float op on dequantized weights); see the module doc."""
        w, inp = self.spec["weight"], self.spec.get("input")
        if microscaling.is_microscaling(w) or microscaling.is_microscaling(inp) or fp8.is_fp8_weight(w):
            return "dequant"
        if fp8.is_fp8_input(inp):
            return "dequant"
        ok_w = w["layout"] == "tensor" or (
            w["layout"] == "channel" and [a % len(self.spec["weight_shape"]) for a in w["axis"]] == [0]
        )
        ok_w = ok_w and w["num_bits"] <= 8
        ok_in = inp is not None and inp["num_bits"] <= 8
        return "int8" if ok_w and ok_in and not self.spec.get("force_dequant", False) else "dequant"

    @property
    def weight_codes(self) -> torch.Tensor:
        """The int8 weight codes (unpacked from int4 storage if needed; E4M3 codes as they are)."""
        if self.spec["weight"]["storage"] in ("int8", "e4m3"):
            return self.weight
        w = self.spec["weight"]
        return unpack_int4(self.weight_packed, self.spec["weight_shape"][-1], signed=not w["unsigned"])

    def dequantized_weight(self) -> torch.Tensor:
        """The weights as the fake-quant module sees them (``q * scale`` in float32, then the weight dtype)."""
        if microscaling.is_microscaling(self.spec["weight"]):
            shape = tuple(self.spec["weight_shape"])
            return microscaling.dequantize(self.spec["weight"], dict(self.named_buffers()), shape).to(self.weight_dtype)
        if fp8.is_fp8_weight(self.spec["weight"]):
            return fp8.dequantize(self.weight, self.weight_scale).to(self.weight_dtype)
        bs = (
            block_sizes_from_json(self.spec["weight"]["block_sizes"])
            if self.spec["weight"]["layout"] == "block"
            else None
        )
        scale = self.weight_scale
        if self.spec["weight"]["layout"] == "channel" and scale.dim() == 1:
            scale = scale.view((-1,) + (1,) * (len(self.spec["weight_shape"]) - 1))
        return dequantize_weight(self.weight_codes, scale, bs).to(self.weight_dtype)

    def current_input_scale(self) -> torch.Tensor:
        """float32 scalar scale of the selected temporal step (``self.step``)."""
        if not 0 <= self.step < self.num_steps:
            raise ValueError(f"{type(self).__name__}: step {self.step} is out of range (num_steps={self.num_steps})")
        return cast(torch.Tensor, self.input_scale)[self.step]  # a static input always has its scales

    # --- helpers ---------------------------------------------------------------------------------------------------
    def _pre_scaled(self, x: torch.Tensor) -> torch.Tensor:
        pqs = self.pre_quant_scale
        return x if pqs is None else x * pqs.to(x.dtype)

    def input_codes(self, x: torch.Tensor) -> torch.Tensor:
        """Integer codes of x (float32, NaN where x is NaN): the exact quantizer of the fake-quant module."""
        return library.quantize_int(self._pre_scaled(x), self.current_input_scale(), self._qmin, self._qmax)

    def fake_quant_input(self, x: torch.Tensor) -> torch.Tensor:
        """``codes * scale`` in x's dtype, as the fake-quant input quantizer returns it."""
        inp = self.spec.get("input")
        if inp is None:
            return self._pre_scaled(x)  # weight-only: AWQ's scale, if any
        if microscaling.is_microscaling(inp):
            return microscaling.fake_quant(inp, cast(torch.Tensor, self.input_scale), self._pre_scaled(x))
        if fp8.is_fp8_input(inp):
            scale = None if inp["dynamic"] else self.current_input_scale()
            return fp8.fake_quant(self._pre_scaled(x), inp["dynamic"], scale)
        return library.fake_quant_int(self._pre_scaled(x), self.current_input_scale(), self._qmin, self._qmax)

    def _get_kernel(self, make):
        w = self.weight_codes if self.spec["weight"]["storage"] == "int8" else self.weight_packed
        key = (
            w.device,
            w.data_ptr(),
            w._version,
            self.weight_scale.data_ptr(),
            self.weight_scale._version,
            self.backend,
        )
        if self._kernel is None or self._kernel_key != key:
            scale = self.weight_scale.reshape(-1)
            codes = self.weight_codes
            self._kernel = make(codes, scale.expand(codes.shape[0]) if scale.numel() == 1 else scale)
            self._kernel_key = key
        return self._kernel

    @property
    def unsigned_input(self) -> bool:
        """Whether activation codes are unsigned."""
        return bool(self.spec["input"]["unsigned"])

    def _apply(self, fn, recurse=True):
        keep = {n: buf for n in _FP32_BUFFERS if (buf := self._buffers.get(n)) is not None}
        w = self._buffers.get("weight")
        if w is not None and w.dtype == torch.float8_e4m3fn:  # E4M3 codes are not a float dtype to convert
            keep["weight"] = w
        out = super()._apply(fn, recurse)
        anchor = self._buffers.get("weight", self._buffers.get("weight_packed", self._buffers.get("weight_codes")))
        anchor = cast(torch.Tensor, anchor)  # every real module holds its weight codes in one of these
        for n, t in keep.items():
            self._buffers[n] = t.to(anchor.device)
        self.weight_dtype = fn(torch.zeros((), dtype=self.weight_dtype)).dtype
        self._kernel = self._kernel_key = None
        self.__dict__.pop("_fast_cache", None)
        return out

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_kernel"] = state["_kernel_key"] = None  # packed backend weights are rebuilt on demand
        state.pop("_fast_cache", None)
        return state

    def extra_repr(self) -> str:
        w, inp = self.spec["weight"], self.spec.get("input")
        if microscaling.is_microscaling(w) or microscaling.is_microscaling(inp):
            s = f"weight={w.get('scheme', 'int' + str(w.get('num_bits')))} ({w['storage']} storage)"
            s += "" if inp is None else f", input={inp.get('scheme', 'int' + str(inp.get('num_bits')))}"
            return s + f", compute={self.compute}"
        if fp8.is_fp8_weight(w) or fp8.is_fp8_input(inp):
            s = f"weight={'e4m3' if fp8.is_fp8_weight(w) else 'int' + str(w['num_bits'])} {w['layout']}"
            s += "" if inp is None else f", input={inp.get('elem', 'int' + str(inp['num_bits']))}"
            s += f" dynamic={inp['dynamic']}" if inp is not None and inp.get("dynamic") else ""
            return s + f", compute={self.compute}, backend={self.backend}"
        s = f"weight=int{w['num_bits']} {w['layout']} ({w['storage']} storage), compute={self.compute}"
        if inp is not None:
            s += f", input=int{inp['num_bits']}{' unsigned' if inp['unsigned'] else ''}"
            s += f", num_steps={self.num_steps}" if self.num_steps > 1 else ""
        return s + (f", backend={self.backend}" if self.compute == "int8" else "")


class QuantizedLinear(_RealQuantModule):
    """A Linear layer holding int8 (or packed int4) weight codes; see the module docstring."""

    def __init__(self, spec: dict, backend: str = "auto"):
        super().__init__(spec, backend)
        self.out_features, self.in_features = spec["weight_shape"]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + super().extra_repr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(self, x)
        path = fast_gemm.route(self, x)
        if path is not None:
            return fast_gemm.forward(self, path, x)
        if self.compute == "dequant":
            return F.linear(self.fake_quant_input(x), self.dequantized_weight(), self.bias)
        kernel = self._get_kernel(lambda w, s: int8_gemm.LinearKernel(w, s, self.backend))
        q = self.input_codes(x).reshape(-1, self.in_features)
        nan_rows = torch.isnan(q).any(1)
        has_nan = bool(nan_rows.any())
        if has_nan:
            q = torch.nan_to_num(q, nan=0.0)
        y = kernel(q, self.current_input_scale(), self.bias, self.unsigned_input)
        if has_nan:
            y[nan_rows] = float("nan")
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def abs_terms(self, x: torch.Tensor) -> torch.Tensor:
        """float64 ``sum_k |x_hat_k * w_hat_nk| + |bias_n|`` per output (the scale of the rounding error)."""
        q = self.input_codes(x).reshape(-1, self.in_features).double().abs()
        s = self.current_input_scale().double() * self.weight_scale.double().reshape(-1)
        t = (q @ self.weight_codes.double().abs().T) * s
        t = t + self.bias.double().abs() if self.bias is not None else t
        return t.reshape(*x.shape[:-1], self.out_features)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Bound on ``|forward(x) - fake_quant_module(x)|`` per output (0 for the bit-identical dequant path)."""
        path = fast_gemm.route(self, x)
        if path is not None:
            return fast_gemm.error_bound(self, path, x)
        if self.compute == "dequant":
            return torch.zeros(*x.shape[:-1], self.out_features, dtype=torch.float64, device=x.device)
        return int8_gemm.error_bound(self.abs_terms(x), self.in_features, x.dtype)


class QuantizedConv2d(_RealQuantModule):
    """A Conv2d layer holding int8 (or packed int4) weight codes; see the module docstring.

    ``spec["conv"]`` holds ``stride``, ``padding`` (ints or "same"/"valid"), ``dilation``, ``groups`` and
    ``padding_mode`` exactly as the float ``nn.Conv2d`` had them.
    """

    def __init__(self, spec: dict, backend: str = "auto"):
        super().__init__(spec, backend)
        c = spec["conv"]
        self.out_channels = spec["weight_shape"][0]
        self.in_channels = spec["weight_shape"][1] * c["groups"]
        self.kernel_size = tuple(spec["weight_shape"][2:])
        self.stride, self.dilation, self.groups = tuple(c["stride"]), tuple(c["dilation"]), int(c["groups"])
        self.padding = c["padding"] if isinstance(c["padding"], str) else tuple(c["padding"])
        self.padding_mode = c["padding_mode"]

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, groups={self.groups}, " + super().extra_repr()
        )

    def _pads(self) -> list[int]:
        """Explicit ``F.pad`` amounts (left, right, top, bottom) equivalent to the conv's padding."""
        if self.padding == "valid":
            return [0, 0, 0, 0]
        if self.padding == "same":
            out = []
            for d, k in zip(reversed(self.dilation), reversed(self.kernel_size)):
                total = d * (k - 1)
                out += [total // 2, total - total // 2]
            return out
        ph, pw = cast("tuple[int, int]", self.padding)  # two ints unless "same" / "valid" (checked above)
        return [pw, pw, ph, ph]

    def _float_conv(self, x, w, b):
        if self.padding_mode != "zeros":
            return F.conv2d(
                F.pad(x, self._pads(), mode=self.padding_mode), w, b, self.stride, 0, self.dilation, self.groups
            )
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def padded_codes(self, x: torch.Tensor) -> torch.Tensor:
        """Input codes with the conv's padding applied (code 0 is real 0; other modes pad the codes)."""
        q = self.input_codes(x)
        pads = self._pads()
        if any(pads):
            q = F.pad(q, pads, mode="constant" if self.padding_mode == "zeros" else self.padding_mode)
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(self, x)
        if self.compute == "dequant":
            return self._float_conv(self.fake_quant_input(x), self.dequantized_weight(), self.bias)
        kernel = self._get_kernel(
            lambda w, s: int8_gemm.Conv2dKernel(w, s, self.stride, self.dilation, self.groups, self.backend)
        )
        q = self.padded_codes(x)
        nan = torch.isnan(q)
        has_nan = bool(nan.any())
        if has_nan:
            q = torch.nan_to_num(q, nan=0.0)
        y = kernel(q, self.current_input_scale(), self.bias, self.unsigned_input)
        if has_nan:  # an output sees NaN when its receptive field holds one (as the float conv would)
            ones = torch.ones(self.spec["weight_shape"], dtype=torch.float32, device=q.device)
            hit = F.conv2d(nan.float(), ones, None, self.stride, 0, self.dilation, self.groups) > 0
            y = y.masked_fill(hit, float("nan"))
        return y.to(x.dtype)

    def abs_terms(self, x: torch.Tensor) -> torch.Tensor:
        """float64 ``sum |x_hat * w_hat| + |bias|`` per output element (the scale of the rounding error)."""
        q = self.padded_codes(x).double().abs()
        t = F.conv2d(q, self.weight_codes.double().abs(), None, self.stride, 0, self.dilation, self.groups)
        t = t * (self.current_input_scale().double() * self.weight_scale.double().reshape(-1)).view(1, -1, 1, 1)
        return t + self.bias.double().abs().view(1, -1, 1, 1) if self.bias is not None else t

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Bound on ``|forward(x) - fake_quant_module(x)|`` per output (0 for the bit-identical dequant path)."""
        if self.compute == "dequant":
            return torch.zeros_like(
                self._float_conv(x, self.dequantized_weight().to(x.dtype), None), dtype=torch.float64
            )
        k = self.spec["weight_shape"][1] * self.kernel_size[0] * self.kernel_size[1]
        return int8_gemm.error_bound(self.abs_terms(x), k, x.dtype)
