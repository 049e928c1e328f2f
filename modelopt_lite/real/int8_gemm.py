"""Exact integer matrix products for the real INT8 modules, with one backend per platform.

Every backend computes ``acc = sum_k qx[m, k] * qw[n, k]`` EXACTLY (an integer) and returns
``y = float32(acc) * (sx * sw[n]) + bias`` in float32, where ``qx`` are activation codes (signed int8 or
unsigned 8-bit, per-tensor scale ``sx``) and ``qw`` are int8 weight codes with per-output-channel scales ``sw``.

Backends (``backend=`` of the real modules and of :func:`modelopt_lite.fake2real`):

- ``"int_mm"``: ``torch._int_mm`` (int8 x int8 -> int32). The real int8 tensor-core path on CUDA (shapes are padded
  to its M > 16, K % 8 == 0, N % 8 == 0 rules). On a CPU build it exists but is a naive fallback (~170x slower
  than float32 at 512x4096x4096), so it is only the default on CUDA.
- ``"onednn"``: ``torch.ops.onednn.qlinear_pointwise`` / ``qconv2d_pointwise`` (the ops torch's x86 inductor
  lowering uses) with uint8 activations, int8 weights and a float32 output. On CPUs with VNNI/AMX the integer
  dot product is exact and one call is made (``u = q + 128``, zero point 128). On AVX2-only CPUs oneDNN (like
  fbgemm) multiplies u8 x s8 pairs with ``vpmaddubsw``, which SATURATES at int16: ``255*127 + 255*127`` overflows
  and results are silently wrong. A probe detects this once per process; then the activations are split into two
  parts that can never saturate (``min(q, 0) + 128`` with zero point 128, and ``max(q, 0)``; for unsigned codes
  ``min(q, 128)`` and ``max(q - 128, 0)``) and two exact int8 products are summed. That costs two int8 GEMMs, about
  the time of one float32 GEMM on such a CPU (measured in ``bench/bench_real_int8.py``).
- ``"float_exact"``: the integer product evaluated by a float32 GEMM on integer-valued tensors. Every partial sum
  is an integer of magnitude ``<= max|qx| * sum_k |qw[n, k]|``; K is cut into chunks keeping that below 2**24, so
  every float32 partial sum is exact in ANY accumulation order; chunks are summed in float64. Portable fallback.
- ``"reference"``: float64 products (exact, slow); used by tests.
- ``"auto"``: ``int_mm`` on CUDA; ``onednn`` on CPU when torch has it; else ``float_exact``.

Rounding: only the final ``float32(acc)``, the scale product, the multiply and the bias add round, so the real
output differs from the fake-quant output (a float32 GEMM of dequantized values) by float32 accumulation-order
rounding only; :func:`linear_error_bound` gives a rigorous bound for tests.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

#: every backend name; the last three are the GPU-first paths of :mod:`.fast_gemm` (their modules never reach here)
BACKENDS = ("auto", "int_mm", "onednn", "float_exact", "reference", "scaled_mm", "int4pack", "int8pack")
_EXACT_F32 = 2.0**24


def check_backend(backend: str) -> str:
    """Validate a backend name (ValueError naming the bad value)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def onednn_available() -> bool:
    """True when this torch build has the oneDNN quantized linear/conv ops with float outputs."""
    ops = torch.ops.onednn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, n) for n in ("qlinear_prepack", "qlinear_pointwise", "qconv_prepack", "qconv2d_pointwise")
    )


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ``"auto"`` stands for on ``device``."""
    check_backend(backend)
    if backend != "auto":
        if backend == "onednn" and (device.type != "cpu" or not onednn_available()):
            raise ValueError(f"backend 'onednn' needs a CPU tensor and a torch build with oneDNN, got {device}")
        return backend
    if device.type == "cuda":
        return "int_mm"
    if device.type == "cpu" and onednn_available() and onednn_mode() != "unusable":
        return "onednn"
    return "float_exact"


def _float32_gemm_is_ieee() -> bool:
    mk = getattr(torch.backends.mkldnn, "matmul", None)
    return torch.get_float32_matmul_precision() == "highest" and getattr(mk, "fp32_precision", "none") in (
        "none",
        "ieee",
    )


def _float32_conv_is_ieee(device: torch.device) -> bool:
    if device.type == "cuda":
        return not torch.backends.cudnn.allow_tf32
    mk = getattr(torch.backends.mkldnn, "conv", None)
    return getattr(mk, "fp32_precision", "none") in ("none", "ieee")


# --- activation codes -> uint8 parts ---------------------------------------------------------------------------------
def split_codes(q: torch.Tensor, unsigned: bool, direct: bool) -> list[tuple[torch.Tensor, int]]:
    """Write integer codes ``q`` (float tensor) as parts ``(u8, zero_point)`` with ``sum(u8 - zp) == q``.

    ``direct``: one part (``q + 128`` / zp 128 for signed, ``q`` / zp 0 for unsigned). Otherwise two parts whose
    values never exceed 128, so ``u1 * w1 + u2 * w2`` always fits int16 (no ``vpmaddubsw`` saturation).
    """
    qi = q.to(torch.int16)
    if direct:
        return [((qi + 128).to(torch.uint8), 128)] if not unsigned else [(qi.to(torch.uint8), 0)]
    if unsigned:
        return [(qi.clamp(max=128).to(torch.uint8), 0), ((qi - 128).clamp_(min=0).to(torch.uint8), 0)]
    return [((qi.clamp(max=0) + 128).to(torch.uint8), 128), (qi.clamp_(min=0).to(torch.uint8), 0)]


@functools.lru_cache(maxsize=1)
def onednn_mode() -> str:
    """``"direct"`` (exact u8 x s8 products), ``"split"`` (saturating CPU; exact with split activations) or
    ``"unusable"``; probed once with a worst case (all activations 255, weights +-127/-128)."""
    if not onednn_available():
        return "unusable"
    k, n = 64, 16
    qx = torch.full((4, k), 127.0)
    qx[1] = -128.0
    qx[2, ::2] = -128.0
    qw = torch.full((n, k), 127.0)
    qw[::2] = -128.0
    qw[3, 1::2] = -7.0
    exact = qx.double() @ qw.double().T
    packed = torch.ops.onednn.qlinear_prepack(qw.to(torch.int8), None)
    ones, zp = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    for direct in (True, False):
        try:
            y = sum(_onednn_linear_call(u, z, 1.0, packed, ones, zp, None) for u, z in split_codes(qx, False, direct))
        except RuntimeError:  # pragma: no cover - depends on the torch build
            return "unusable"
        if torch.equal(y.double(), exact):
            return "direct" if direct else "split"
    return "unusable"  # pragma: no cover


def _onednn_linear_call(u, zp, x_scale, packed, w_scale, w_zp, bias):
    return torch.ops.onednn.qlinear_pointwise(
        u, float(x_scale), int(zp), packed, w_scale, w_zp, bias, 1.0, 0, torch.float32, "none", [], ""
    )


def _chunks_exact(col_max: torch.Tensor, x_max: int) -> list[tuple[int, int]]:
    """Contiguous K ranges whose worst partial sum ``x_max * sum(col_max)`` stays <= 2**24 (exact in float32)."""
    out, start, acc = [], 0, 0.0
    for k, m in enumerate(col_max.tolist()):
        v = m * x_max
        if acc + v > _EXACT_F32 and k > start:
            out.append((start, k))
            start, acc = k, 0.0
        acc += v
    out.append((start, len(col_max)))
    return out


def _finish(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias):
    """``float32(acc) * (sx * sw) + bias`` (the only roundings of the integer path)."""
    y = acc.float() * (x_scale.float() * w_scale)
    return y + bias.float() if bias is not None else y


def int_mm_acc(q: torch.Tensor, weight: torch.Tensor, cache: dict, unsigned: bool) -> torch.Tensor:
    """Exact int32 ``q @ weight.T`` through ``torch._int_mm`` (CUDA shape rules handled by zero padding).

    Unsigned codes ``[0, 255]`` are shifted to ``q - 128`` (int8) and ``128 * rowsum(weight)`` is added back in
    int32, which is exact. ``cache`` keeps the transposed/padded weight between calls.
    """
    m, k = q.shape
    n = weight.shape[0]
    cuda = q.device.type == "cuda"
    kp, np_ = (-(-k // 8) * 8, -(-n // 8) * 8) if cuda else (k, n)
    if "wt" not in cache:
        w = F.pad(weight, (0, kp - k, 0, np_ - n)) if (kp, np_) != (k, n) else weight
        # mat2 column-major (what cuBLASLt wants on CUDA); plain transpose copy on CPU
        cache["wt"] = w.contiguous().T if cuda else w.T.contiguous()
        cache["rowsum"] = weight.sum(1, dtype=torch.int32)
    a = ((q - 128.0) if unsigned else q).to(torch.int8)
    mp = max(m, 17) if cuda else m
    if (mp, kp) != (m, k):
        a = F.pad(a, (0, kp - k, 0, mp - m))
    acc = torch._int_mm(a, cache["wt"])[:m, :n]
    return acc + 128 * cache["rowsum"] if unsigned else acc


# --- Linear --------------------------------------------------------------------------------------------------------
class LinearKernel:
    """An exact ``(M, K) codes x (N, K) int8 weights`` product with a cached, backend-specific packed weight.

    Args:
        weight: int8 codes ``(N, K)``. w_scale: float32 ``(N,)``. backend: see the module docstring.
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, backend: str = "auto"):
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise TypeError(
                f"LinearKernel needs 2-D int8 weight codes, got {weight.dtype} of shape {tuple(weight.shape)}"
            )
        self.weight, self.w_scale = weight, w_scale.float().reshape(-1).expand(weight.shape[0]).contiguous()
        self.backend = resolve_backend(backend, weight.device)
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def __call__(self, q: torch.Tensor, x_scale: torch.Tensor, bias, unsigned: bool = False) -> torch.Tensor:
        """``q``: float tensor of integer codes ``(M, K)``; returns float32 ``(M, N)``."""
        return getattr(self, f"_{self.backend}")(q, x_scale, bias, unsigned)

    def _reference(self, q, x_scale, bias, unsigned):
        return _finish(q.double() @ self.weight.double().T, x_scale, self.w_scale, bias)

    def _float_exact(self, q, x_scale, bias, unsigned):
        if not _float32_gemm_is_ieee():
            return self._reference(q, x_scale, bias, unsigned)
        x_max = 255 if unsigned else 128
        wf = self._get("wf", lambda: self.weight.float())
        chunks = self._get(("chunks", x_max), lambda: _chunks_exact(wf.abs().amax(0), x_max))
        if len(chunks) == 1:
            return _finish(q.float() @ wf.T, x_scale, self.w_scale, bias)
        acc = sum((q[:, a:b].float() @ wf[:, a:b].T).double() for a, b in chunks)
        return _finish(acc, x_scale, self.w_scale, bias)

    def _int_mm(self, q, x_scale, bias, unsigned):
        return _finish(int_mm_acc(q, self.weight, self._cache, unsigned), x_scale, self.w_scale, bias)

    def _onednn(self, q, x_scale, bias, unsigned):
        packed = self._get("packed", lambda: torch.ops.onednn.qlinear_prepack(self.weight, None))
        w_zp = self._get("w_zp", lambda: torch.zeros(self.weight.shape[0], dtype=torch.int64))
        parts = split_codes(q, unsigned, onednn_mode() == "direct")
        # one float output per part; the bias enters once (with the last part)
        y = None
        for i, (u, zp) in enumerate(parts):
            b = bias.float() if (bias is not None and i == len(parts) - 1) else None
            part = _onednn_linear_call(u, zp, x_scale.item(), packed, self.w_scale, w_zp, b)
            y = part if y is None else y.add_(part)
        return y


# --- Conv2d --------------------------------------------------------------------------------------------------------
class Conv2dKernel:
    """An exact int8 2-D convolution of (already padded) codes with int8 weights ``(Cout, Cin/g, kh, kw)``."""

    def __init__(self, weight, w_scale, stride, dilation, groups: int, backend: str = "auto"):
        if weight.dtype != torch.int8 or weight.dim() != 4:
            raise TypeError(
                f"Conv2dKernel needs 4-D int8 weight codes, got {weight.dtype} of shape {tuple(weight.shape)}"
            )
        self.weight = weight
        self.w_scale = w_scale.float().reshape(-1).expand(weight.shape[0]).contiguous()
        self.stride, self.dilation, self.groups = tuple(stride), tuple(dilation), int(groups)
        self.backend = resolve_backend(backend, weight.device)
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def __call__(self, q: torch.Tensor, x_scale: torch.Tensor, bias, unsigned: bool = False) -> torch.Tensor:
        """``q``: float codes ``(B, Cin, H, W)`` with the padding already applied; returns float32 NCHW."""
        return getattr(self, f"_{self.backend}")(q, x_scale, bias, unsigned)

    def _conv(self, q, w):
        return F.conv2d(q, w, None, self.stride, 0, self.dilation, self.groups)

    def _finish_nchw(self, acc, x_scale, bias):
        y = acc.float() * (x_scale.float() * self.w_scale).view(1, -1, 1, 1)
        return y + bias.float().view(1, -1, 1, 1) if bias is not None else y

    def _reference(self, q, x_scale, bias, unsigned):
        return self._finish_nchw(self._conv(q.double(), self.weight.double()), x_scale, bias)

    def _float_exact(self, q, x_scale, bias, unsigned):
        x_max = 255 if unsigned else 128
        worst = float(self.weight.float().abs().flatten(1).sum(1).max()) * x_max if self.weight.numel() else 0.0
        if worst > _EXACT_F32 or not _float32_conv_is_ieee(q.device):
            return self._reference(q, x_scale, bias, unsigned)
        wf = self._get("wf", lambda: self.weight.float())
        return self._finish_nchw(self._conv(q.float(), wf), x_scale, bias)

    def _int_mm(self, q, x_scale, bias, unsigned):
        cout, cin_g, kh, kw = self.weight.shape
        b, g, cout_g = q.shape[0], self.groups, cout // self.groups
        cols = F.unfold(q, (kh, kw), dilation=self.dilation, stride=self.stride)  # (B, Cin*kh*kw, L)
        oh = (q.shape[2] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        ow = (q.shape[3] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        cols = cols.view(b, g, cin_g * kh * kw, oh * ow)
        accs = []
        for gi in range(g):
            wg = self._get(
                ("w", gi), lambda gi=gi: self.weight[gi * cout_g : (gi + 1) * cout_g].reshape(cout_g, -1).contiguous()
            )
            a = cols[:, gi].transpose(1, 2).reshape(b * oh * ow, -1)
            accs.append(int_mm_acc(a, wg, self._cache.setdefault(("c", gi), {}), unsigned))
        acc = torch.cat(accs, 1) if g > 1 else accs[0]
        return self._finish_nchw(acc.view(b, oh, ow, cout).permute(0, 3, 1, 2), x_scale, bias).contiguous()

    def _onednn(self, q, x_scale, bias, unsigned):
        cout = self.weight.shape[0]
        w_zp = self._get("w_zp", lambda: torch.zeros(cout, dtype=torch.int64))
        sx = x_scale.item()
        y = None
        parts = split_codes(q, unsigned, onednn_mode() == "direct")
        for i, (u, zp) in enumerate(parts):
            packed = self._get(
                ("packed", sx, zp),
                lambda zp=zp: torch.ops.onednn.qconv_prepack(
                    self.weight, self.w_scale, sx, zp, list(self.stride), [0, 0], list(self.dilation), self.groups, None
                ),
            )
            b = bias.float() if (bias is not None and i == len(parts) - 1) else None
            part = torch.ops.onednn.qconv2d_pointwise(
                u.contiguous(memory_format=torch.channels_last),
                sx,
                zp,
                packed,
                self.w_scale,
                w_zp,
                b,
                list(self.stride),
                [0, 0],
                list(self.dilation),
                self.groups,
                1.0,
                0,
                torch.float32,
                "none",
                [],
                None,
            )
            y = part if y is None else y.add_(part)
        assert y is not None  # split_codes gives one or two parts
        return y.contiguous()


def error_bound(abs_terms: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bound on ``|real - fake|`` for one output of a K-term product (``abs_terms = sum|x_hat w_hat| + |bias|``).

    Fake quantization rounds each dequantized operand (``fl(q * s)``: 2u per product) and accumulates K + 1 terms
    in float (at most ``gamma_{K+1} = (K+1) u / (1 - (K+1) u)`` times ``abs_terms`` in ANY order, FMA or not); the
    integer path is exact up to its final roundings (accumulator to float, scale product, multiply, bias add and,
    for split oneDNN calls, one more add: <= 6u). Output casts to a 16-bit dtype add one rounding on each side.
    Hence ``|real - fake| <= (K + 10) * u * abs_terms * (1 + 2 (K + 2) u)`` with u the unit roundoff of float32 (or
    of the 16-bit input dtype). Never anywhere near a quantization step.
    """
    u = max(2.0**-24, torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0)
    return (k + 10) * u * abs_terms * (1 + 2 * (k + 2) * u)


def warn_slow_int_mm(device: torch.device) -> None:
    """Warn once when ``torch._int_mm`` is forced on a CPU (a naive fallback there)."""
    if device.type == "cpu":
        warnings.warn(
            "backend='int_mm' on CPU uses torch's naive int8 fallback (two orders of magnitude slower "
            "than float32); use 'auto'",
            RuntimeWarning,
            stacklevel=3,
        )
