"""The GPU-first GEMM paths of ``QuantizedLinear``, built on torch's own quantized kernels.

Paths (``backend=`` of :func:`~.convert.fake2real` forces one on any device; ``"auto"`` picks them only for CUDA
inputs in bfloat16/float16 and keeps the exact paths of :mod:`.modules` for CPU and float32):

- ``"scaled_mm"`` (FP8 E4M3 W8A8): activation codes (static scale, or dynamic per tensor / per row; see
  :mod:`.fp8`), then ``torch._scaled_mm(a, w.t(), scale_a, scale_b, bias, out_dtype=x.dtype)`` on the row-major
  ``(N, K)`` E4M3 weight (so the second operand is column-major). Per-channel weight scales use the row-wise
  form (``scale_a (M, 1)``, ``scale_b (1, N)``); a static per-tensor activation scale is folded into ``scale_b``.
- ``"int_mm"`` with 16-bit inputs (INT8 W8A8): codes ``clamp(rint(x / s))`` (one chain), ``torch._int_mm(a, w.t())``
  (column-major second operand, zero-copy), one epilogue ``addcmul(bias, acc, sa * sw)`` written straight into the
  output dtype. Float32 inputs keep the exact integer path of :mod:`.int8_gemm`.
- ``"int4pack"`` (INT4 blocks, weight-only): torch's int4 GEMM (:mod:`.int4pack`).
- ``"int8pack"`` (INT8 per-tensor/per-channel, weight-only): ``torch._weight_int8pack_mm`` (CPU's fast path; on CUDA
  ``"auto"`` dequantizes into the input dtype instead: torch's CUDA kernel is ~0.15x bf16).

aten ops of one forward after the first (views excluded; asserted exactly in ``tests/test_real_fast_contract.py``),
pure torch (CPU, or CUDA without the extension): scaled_mm static per tensor: div, clamp_, _to_copy, _scaled_mm (4);
static with per-channel weights: the same 4; dynamic per row: linalg_vector_norm, threshold, div, div, nan_to_num,
_to_copy, _scaled_mm (7); int_mm (16-bit): div, round_, clamp_, _to_copy, _int_mm, empty, addcmul (7); int4pack: int4
mm (+ add for a bias); int8pack: _weight_int8pack_mm (+ add). With the fused CUDA kernels
(:mod:`modelopt_lite.functional.library_real`, used for CUDA tensors when the extension is loaded; asserted with the
kernels built for the host in ``tests/test_real_kernels_host.py`` and on a GPU in ``tests/gpu/test_cuda_real.py``):
scaled_mm real_fp8_static (or real_fp8_dynamic), _scaled_mm (2 ops; 2 launches, 3 for a dynamic per-tensor scale);
int_mm real_int8_codes (padding rows included), _int_mm, real_int_mm_epilogue (3 ops, 3 launches). The fused ops equal
the pure-torch chains bit for bit. None reads a value back to the host (no ``.item()``, no ``bool(tensor)``), the
first call included: the weight-side preparation (packing, scale products, a dead static scale's +Inf divisor) runs
on the device once per device/dtype/step and is cached.

On CUDA, ``_int_mm`` needs M > 16 and K, N multiples of 8 (small M is padded: one ``constant_pad_nd``);
``_scaled_mm`` needs K, N multiples of 16. Modules that do not fit are refused (forced) or keep their exact path
(``"auto"``).
"""

from __future__ import annotations

import torch

from ..formats import E4M3_MAX, int_range
from ..functional import blocks, library_real
from . import fp8, int4pack

FAST_BACKENDS = ("scaled_mm", "int4pack", "int8pack")
LOWP = (torch.bfloat16, torch.float16)
#: ``"auto"`` on CUDA uses the int4 GEMM up to this many rows and dequantizes into a bf16 GEMM above. Measured with
#: ``bench/bench_real_gpu.py`` on an H200 (2026-11-26, K = N = 4096 / 8192): the int4pack layer took 0.062 / 0.056 ms
#: at M = 1, 0.055 / 0.112 at M = 16, 0.197 / 0.640 at M = 128 and 0.642 / 2.401 at M = 512, dequantize-then-bf16
#: 0.37-0.38 / 1.33-1.38 ms at every M up to 512: the int4 GEMM wins up to M = 128 and loses from M = 512.
INT4PACK_MAX_M = 128
_CACHE_MAX = 8


def _block_group(spec: dict) -> int | None:
    bs = spec["weight"]["block_sizes"]
    sizes = blocks.normalize({int(k): v for k, v in bs.items()}, tuple(spec["weight_shape"]))
    return sizes.get(1) if set(sizes) == {1} else None


def kind_of(spec: dict) -> str:
    """``"fp8"`` (E4M3 W8A8), ``"w8a8"`` (integer W8A8), ``"w4"`` / ``"w8"`` (INT4 blocks / INT8 weight-only),
    ``"fp8_weight"`` (E4M3 weights, other inputs) or ``"other"``."""
    w, inp = spec["weight"], spec.get("input")
    if "format" in w or (inp is not None and "format" in inp):
        return "other"  # NVFP4 / MX: dequantized (see .microscaling)
    if fp8.is_fp8_weight(w):
        return "fp8" if fp8.is_fp8_input(inp) else "fp8_weight"
    per_row = w["layout"] == "tensor" or (w["layout"] == "channel" and [a % 2 for a in w["axis"]] == [0])
    if spec["type"] != "QuantizedLinear" and inp is not None:
        return "other"
    if inp is None:
        if w["storage"] == "int4" and w["layout"] == "block":
            return "w4"
        return "w8" if w["storage"] == "int8" and per_row else "other"
    int8 = per_row and w["storage"] == "int8" and not spec.get("force_dequant", False)
    return "w8a8" if int8 and not fp8.is_fp8_input(inp) else "other"


def describe(spec: dict) -> str:
    """A short name of a module's format for messages: ``"FP8 E4M3 W8A8"``, ``"INT4 blocks of 128, weight-only"``..."""
    w, inp = spec["weight"], spec.get("input")
    if "format" in w:
        wname = str(w["scheme"]).upper()
    elif fp8.is_fp8_weight(w):
        wname = "FP8 E4M3"
    else:
        bs = w["block_sizes"]
        wname = f"INT{w['num_bits']}" + ("" if not bs else f" blocks of {','.join(str(v) for v in bs.values())}")
    if inp is None:
        return f"{wname}, weight-only"
    aname = (
        str(inp["scheme"]).upper() if "format" in inp else "E4M3" if fp8.is_fp8_input(inp) else f"INT{inp['num_bits']}"
    )
    return f"{wname} weights, {aname} activations"


def why_not(spec: dict, backend: str) -> str | None:
    """Why ``backend`` cannot compute a module with this spec (None: it can)."""
    kind, linear = kind_of(spec), spec["type"] == "QuantizedLinear"
    n, k = spec["weight_shape"][:2]
    if backend == "scaled_mm":
        if kind != "fp8":
            return "'scaled_mm' needs FP8 E4M3 weights and E4M3 activations (FP8_DEFAULT_CFG)"
        if not linear:
            return "'scaled_mm' computes Linear layers only"
        if n % 16 or k % 16:
            return f"'scaled_mm' needs in/out features that are multiples of 16, got {k} -> {n}"
        return None
    if backend == "int4pack":
        if kind != "w4" or not linear:
            return "'int4pack' needs a Linear with INT4 block weights and no input quantizer (weight-only)"
        why = int4pack.why_not((n, k), _block_group(spec))
        return None if why is None else f"'int4pack': {why}"
    if backend == "int8pack":
        if kind != "w8" or not linear:
            return "'int8pack' needs a Linear with INT8 per-tensor/per-channel weights and no input quantizer"
        return None
    if kind in ("fp8", "fp8_weight") and backend != "auto":
        return f"FP8 E4M3 weights have no integer GEMM; use backend 'scaled_mm' or 'auto', not {backend!r}"
    return None


def _int_mm_fits(spec: dict) -> bool:
    n, k = spec["weight_shape"]
    return spec["type"] == "QuantizedLinear" and n % 8 == 0 and k % 8 == 0


def route(module, x: torch.Tensor) -> str | None:
    """The fast path this forward takes, or None for the module's exact path (host metadata only)."""
    backend, kind = module.backend, module.fast_kind
    if backend in FAST_BACKENDS:
        return backend
    lowp = x.dtype in LOWP
    if kind == "w8a8" and lowp and _int_mm_fits(module.spec):
        if backend == "int_mm" or (backend == "auto" and x.device.type == "cuda"):
            return "int_mm"
    if backend != "auto" or x.device.type != "cuda" or not lowp:
        return None
    if kind == "fp8" and why_not(module.spec, "scaled_mm") is None:
        return "scaled_mm"
    if kind == "w4" and x.dtype in int4pack.CUDA_DTYPES and why_not(module.spec, "int4pack") is None:
        if x.numel() <= INT4PACK_MAX_M * x.shape[-1]:
            return "int4pack"
    return None


# --- weight-side preparation (once per device / dtype / step; may read values back) -------------------------------
def _prepare_scaled_mm(m, x) -> dict:
    inp, n = m.spec["input"], m.out_features
    sw = m.weight_scale.float()
    per_channel = sw.dim() == 1
    p: dict = {"w_t": m.weight.t(), "dynamic": inp["dynamic"], "rowwise": per_channel}
    p["bound"] = torch.full((1,), E4M3_MAX, dtype=torch.float32, device=x.device)
    if inp["dynamic"] is None:
        s = m.input_scale[m.step].reshape(1).float()
        p["divisor"] = _live_divisor(s)  # on the device: no host read of the scale
        if per_channel:
            p["scale_b"] = (s * sw).reshape(1, n).contiguous()
            p["ones"] = torch.ones(0, 1, dtype=torch.float32, device=x.device)
        else:
            p["scale_a"], p["scale_b"] = s.reshape(()), sw.reshape(())
    else:
        p["rowwise"] = per_channel or inp["dynamic"] == "row"
        p["scale_b"] = sw.expand(n).reshape(1, n).contiguous() if p["rowwise"] else sw.reshape(())
    _prepare_bias(m, x, p, fuse=x.dtype in LOWP)
    return p


def _live_divisor(s: torch.Tensor) -> torch.Tensor:
    """The divisor of a static scale: the scale, or +Inf where it is dead (0): ``x / inf`` gives +-0 codes."""
    return torch.where(s == 0, torch.full_like(s, float("inf")), s)


def _prepare_bias(m, x, p: dict, fuse: bool) -> None:
    b = m.bias
    p["bias"] = None if b is None or not fuse else b.to(x.dtype)
    p["bias_after"] = None if b is None or fuse else b.to(x.dtype)


def _prepare_int_mm(m, x) -> dict:
    inp = m.spec["input"]
    s = m.input_scale[m.step].reshape(1).float()
    sw = m.weight_scale.float().reshape(-1)
    scale_row = (s * sw).expand(m.out_features).reshape(1, -1).contiguous()
    _, qmin, qmax = int_range(inp["num_bits"], inp["unsigned"], inp["narrow_range"])
    shift = 128 if inp["unsigned"] else 0
    bias = None if m.bias is None else m.bias.float()
    if shift:  # codes q - 128 in int8; 128 * rowsum(w) * sa * sw goes into the bias
        extra = (128 * m.weight.sum(1, dtype=torch.int32)).float().reshape(1, -1) * scale_row
        bias = extra.reshape(-1) if bias is None else bias + extra.reshape(-1)
    return {
        "w_t": m.weight.t(),
        "divisor": _live_divisor(s),
        "scale_row": scale_row,
        "bias": bias,
        "qmin": qmin,
        "qmax": qmax,
        "shift": shift,
    }


def _prepare_int4pack(m, x) -> dict:
    group = _block_group(m.spec)
    assert group is not None  # why_not(spec, "int4pack") admitted it: blocks along the last dim only
    packed, sz = int4pack.pack(m.weight_codes, m.weight_scale, group, x.dtype)
    p = {"packed": packed, "sz": sz, "group": group}
    _prepare_bias(m, x, p, fuse=False)
    return p


def _prepare_int8pack(m, x) -> dict:
    scales = m.weight_scale.float().reshape(-1).expand(m.out_features).to(x.dtype).contiguous()
    p = {"w": m.weight.contiguous(), "scales": scales}
    _prepare_bias(m, x, p, fuse=False)
    return p


_PREPARE = {
    "scaled_mm": _prepare_scaled_mm,
    "int_mm": _prepare_int_mm,
    "int4pack": _prepare_int4pack,
    "int8pack": _prepare_int8pack,
}


def own_buffers(module: torch.nn.Module):
    """The module's buffers; a real module has no children, so its own ``_buffers`` dict is all of them (walking
    ``buffers()`` cost ~10 us per forward, as much as a small GEMM on a GPU)."""
    return module._buffers.values() if not module._modules else module.buffers()


def prepared(m, path: str, x: torch.Tensor) -> dict:
    """The cached weight-side tensors of ``path`` for x's device and dtype (rebuilt when a buffer changes)."""
    bufs = [t for t in own_buffers(m) if t is not None]
    key = (path, x.device, x.dtype, m.step, tuple((t.data_ptr(), t._version) for t in bufs))
    cache = m.__dict__.setdefault("_fast_cache", {})
    if key not in cache:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        with torch.no_grad():
            cache[key] = _PREPARE[path](m, x)
    return cache[key]


# --- forward ----------------------------------------------------------------------------------------------------------
def int8_codes(x2d: torch.Tensor, divisor: torch.Tensor, qmin: int, qmax: int, shift: int) -> torch.Tensor:
    """int8 ``clamp(rint(x / s), qmin, qmax) - shift`` in one op chain (div, round_, clamp_, [sub_,] _to_copy;
    ``shift`` is 128 for unsigned codes). NaN inputs give unspecified codes (``validate=True`` rejects them)."""
    return library_real.int8_codes_reference(x2d, divisor, qmin, qmax, shift)


def _scaled_mm(m, x2, p):
    mrows, fused = x2.shape[0], library_real.available(x2)
    if p["dynamic"] is not None:
        per_row = p["dynamic"] == "row"
        if fused:
            codes, sa = library_real.real_fp8_dynamic(x2, per_row)
        else:
            codes, sa = fp8.dynamic_codes(x2, per_row, p["bound"])
        if p["rowwise"] and p["dynamic"] == "tensor":
            sa = sa.expand(mrows, 1).contiguous()
        elif not p["rowwise"]:
            sa = sa.reshape(())
    else:
        if fused:
            codes = library_real.real_fp8_static(x2, p["divisor"])
        else:
            codes = fp8.static_codes(x2, p["divisor"])
        if p["rowwise"]:
            if p["ones"].shape[0] < mrows:
                p["ones"] = torch.ones(mrows, 1, dtype=torch.float32, device=x2.device)
            sa = p["ones"][:mrows]
        else:
            sa = p["scale_a"]
    y = torch._scaled_mm(codes, p["w_t"], sa, p["scale_b"], bias=p["bias"], out_dtype=x2.dtype)
    return y


def _int_mm(m, x2, p):
    mrows = x2.shape[0]
    rows = 17 if (x2.device.type == "cuda" and mrows <= 16) else mrows  # CUDA's _int_mm needs M > 16
    args = (p["divisor"], p["qmin"], p["qmax"], p["shift"], rows)
    if library_real.available(x2):  # three launches: codes, GEMM, epilogue
        acc = torch._int_mm(library_real.real_int8_codes(x2, *args), p["w_t"])
        return library_real.real_int_mm_epilogue(acc, p["scale_row"], p["bias"], mrows, x2.dtype)
    acc = torch._int_mm(library_real.int8_codes_reference(x2, *args), p["w_t"])
    return library_real.int_mm_epilogue_reference(acc, p["scale_row"], p["bias"], mrows, x2.dtype)


def _int4pack(m, x2, p):
    return int4pack.mm(x2.contiguous(), p["packed"], p["group"], p["sz"])


def _int8pack(m, x2, p):
    return torch._weight_int8pack_mm(x2.contiguous(), p["w"], p["scales"])


_FORWARD = {"scaled_mm": _scaled_mm, "int_mm": _int_mm, "int4pack": _int4pack, "int8pack": _int8pack}


def forward(m, path: str, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` through ``path`` (x of any rank, last dim ``in_features``)."""
    p = prepared(m, path, x)
    x2 = m._pre_scaled(x).reshape(-1, m.in_features)
    y = _FORWARD[path](m, x2, p)
    if p.get("bias_after") is not None:
        y = y + p["bias_after"]
    return y.reshape(*x.shape[:-1], m.out_features)


# --- error bounds -----------------------------------------------------------------------------------------------------
def _u(dtype: torch.dtype) -> float:
    return max(2.0**-24, torch.finfo(dtype).eps / 2)


def lowp_error_bound(abs_terms: torch.Tensor, k: int, in_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Bound on ``|fast path - fake-quant module|`` per output; ``abs_terms = sum_k |x_hat_k w_hat_k| + |bias|``.

    Both sides accumulate in float32 (torch's GEMMs in every dtype; on CUDA set
    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False`` for the fake side) over K + 1
    terms with a few extra roundings (scales, epilogue): ``gamma_{K+8}`` each. The fake side rounds each dequantized
    operand to the model dtype (2 u_in per product), the weight-only 16-bit paths round the block scale and the
    dequantized weight (2 u_in more), and each side rounds its output once (u_out). Hence
    ``((4 u_in + 2 gamma_{K+8}) (1 + u_in)^2 + 2 u_out) (1 + 2 u_out) * abs_terms``.
    """
    u_in, u_out, u32 = _u(in_dtype), _u(out_dtype), 2.0**-24
    gamma = (k + 8) * u32 / (1 - (k + 8) * u32)
    return ((4 * u_in + 2 * gamma) * (1 + u_in) ** 2 + 2 * u_out) * (1 + 2 * u_out) * abs_terms


def abs_terms(m, path: str, x: torch.Tensor) -> torch.Tensor:
    """float64 ``sum_k |x_hat_k * w_hat_nk| + |bias_n|`` per output of ``path`` (x_hat: the quantized input)."""
    xs = m._pre_scaled(x)
    if path == "scaled_mm":
        inp = m.spec["input"]
        scale = None if inp["dynamic"] else m.input_scale[m.step]
        codes, s = fp8.input_codes(xs, inp["dynamic"], scale)
        xa = codes.double().abs() * s.double()
    elif path == "int_mm":
        xa = m.input_codes(x).double().abs() * m.current_input_scale().double()
    else:
        xa = xs.double().abs()
    t = xa.reshape(-1, m.in_features) @ m.dequantized_weight().double().abs().T
    t = t + m.bias.double().abs() if m.bias is not None else t
    return t.reshape(*x.shape[:-1], m.out_features)


def error_bound(m, path: str, x: torch.Tensor) -> torch.Tensor:
    """Bound on ``|m(x) - fake_quant_module(x)|`` per output when ``path`` computes it."""
    return lowp_error_bound(abs_terms(m, path, x), m.in_features, x.dtype, x.dtype)
