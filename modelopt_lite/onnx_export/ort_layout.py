"""Exact graph rewrites that let ONNX Runtime's CPU provider run real int8 kernels (target="onnxruntime").

1. **int8 activations -> uint8 with zero point + 128.** ``Q_uint8(x, s, z + 128) = Q_int8(x, s, z) + 128`` and
   ``DQ(q + 128, s, z + 128) = DQ(q, s, z)`` exactly, so every int8 activation Q/DQ is stored as uint8 (ORT's int8
   GEMM and convolution kernels take unsigned activations). The weights (``weights=``):

   - ``"int8"``: weights stay signed (ORT's own ``quantize_static`` layout). ORT then runs its u8 x s8 kernels: the
     fast ones (``vpdpbusd`` on AVX512-VNNI / AVX-VNNI / AMX CPUs, 2.4x faster than u8 x u8 on the MLP of
     ``bench/bench_onnx.py``), exact there. On x86 CPUs *without* VNNI the u8 x s8 kernel uses ``vpmaddubsw``,
     whose int16 pair sums saturate (255 * 127 * 2 > 32767): results change there.
   - ``"uint8"``: weights stored as uint8 + 128 too: ORT's u8 x u8 kernels, exact on every CPU, slower.
   - ``"auto"`` (default): ``"int8"`` when this machine's CPU has VNNI (or AMX), else ``"uint8"``; the report's
     notes say which was chosen. Export with the value of the machine that will run the file.
2. **Bias after the int8 product.** ``Gemm(DQ(a), DQ(w), bias)`` becomes ``Gemm(DQ(a), DQ(w)) + bias``: ORT then
   fuses the Gemm into QGemm with a float output and adds the float bias exactly as torch does, instead of
   re-quantizing the bias to int32 (which moves outputs by up to half an int32 step and flips roundings of a
   following quantizer). Conv keeps its bias (QLinearConv needs ``Conv -> Q``).
3. **Relu between two quantizers of one grid as a uint8 clip.** ``Q(Relu(DQ(q, s, z)), s, z) = max(q, z)`` exactly
   (``(q - z) * s / s`` rounds back to ``q - z``), so ``DQ -> Relu -> Q`` with the same scale and zero point becomes
   ``Clip(q, min=z)`` on the uint8 codes: three float passes become one byte pass between ORT's int8 kernels.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import Graph, attr


def _shift_uint8(g: Graph, name: str, cache: dict) -> str | None:
    """Name of a uint8 copy (+128) of an int8 initializer, or None when ``name`` is not one."""
    if name in cache:
        return cache[name]
    t = g.inits.get(name)
    if t is None or t.data_type != TensorProto.INT8:
        return None
    arr = numpy_helper.to_array(t).astype(np.int16) + 128
    new = g.add_init(f"{name}.u8", arr.astype(np.uint8))
    cache[name] = new
    return new


WEIGHT_DTYPES = ("auto", "int8", "uint8")


@functools.cache
def host_has_vnni() -> bool:
    """True when this machine's x86 CPU has VNNI (AVX512-VNNI or AVX-VNNI) or AMX-INT8 (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    except OSError:
        pass
    return False


def resolve_weights(weights: str) -> str:
    """``"int8"`` or ``"uint8"`` for a ``weights=`` argument (``"auto"`` looks at this machine's CPU)."""
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"ort_weights must be one of {WEIGHT_DTYPES}, got {weights!r}")
    if weights == "auto":
        return "int8" if host_has_vnni() else "uint8"
    return weights


def _explicit_zero_point(g: Graph, n) -> None:
    """Give an int8 weight's DequantizeLinear an explicit int8 zero point of 0 (ORT's QDQ fusions want one)."""
    t = g.inits.get(n.input[0])
    if t is None or t.data_type != TensorProto.INT8 or (len(n.input) > 2 and n.input[2]):
        return
    shape = list(g.inits[n.input[1]].dims)
    zp = g.add_init(f"{n.input[0]}.zero_point", np.zeros(shape, np.int8))
    while len(n.input) < 3:
        n.input.append("")
    n.input[2] = zp


def int8_to_uint8(g: Graph, weights: bool = True) -> int:
    """Rewrite every int8 Q/DQ (and, with ``weights``, every int8 DQ input initializer) as uint8 (zero point
    + 128); returns the count."""
    cache: dict[str, str] = {}
    count = 0
    for n in g.nodes:
        if n.domain not in ("", "ai.onnx") or n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        has_zp = len(n.input) > 2 and bool(n.input[2])
        if n.op_type == "DequantizeLinear" and n.input[0] in g.inits:  # a stored weight
            if not weights:
                _explicit_zero_point(g, n)
                continue
            q = _shift_uint8(g, n.input[0], cache)
            if q is None:
                continue
            if has_zp:
                zp = _shift_uint8(g, n.input[2], cache)
                if zp is None:
                    continue
            else:  # zero point 0 left out: it becomes 128
                shape = list(g.inits[n.input[1]].dims)
                zp = g.add_init(f"{n.input[0]}.zero_point_u8", np.full(shape, 128, np.uint8))
            n.input[0] = q
            while len(n.input) < 3:
                n.input.append("")
            n.input[2] = zp
            count += 1
        elif has_zp:
            zp = _shift_uint8(g, n.input[2], cache)
            if zp is not None:
                n.input[2] = zp
                count += 1
    return count


def split_gemm_bias(g: Graph) -> int:
    """``Gemm(DQ, DQ, C)`` -> ``Gemm(DQ, DQ) + C`` for a float bias C (alpha = beta = 1); returns the count."""
    prod = g.producers()
    count = 0
    for n in list(g.nodes):
        if n.op_type != "Gemm" or len(n.input) < 3 or not n.input[2]:
            continue
        a, b, c = (prod.get(i) for i in n.input[:3])
        if not (a is not None and a.op_type == "DequantizeLinear" and b is not None
                and b.op_type == "DequantizeLinear") or (c is not None and c.op_type == "DequantizeLinear"):
            continue
        if attr(n, "alpha", 1.0) != 1.0 or attr(n, "beta", 1.0) != 1.0:
            continue
        bias = n.input[2]
        product = g.fresh(f"{n.output[0]}_nobias")
        out = n.output[0]
        del n.input[2]
        n.output[0] = product
        idx = g.nodes.index(n)
        g.nodes.insert(idx + 1, helper.make_node("Add", [product, bias], [out], name=g.fresh(f"{n.name}_bias")))
        count += 1
    return count


def relu_to_clip(g: Graph) -> tuple[int, int]:
    """``DQ(q, s, z) -> Relu -> Q(s, z)`` (uint8, same grid, nothing else reading the float tensors) ->
    ``Clip(q, min=z)``; returns ``(rewritten, left alone because the two grids differ)``."""
    prod, cons = g.producers(), g.consumers()
    count = mismatched = 0
    for relu in list(g.nodes):
        if relu.op_type != "Relu" or relu.output[0] in g.outputs:
            continue
        dq = prod.get(relu.input[0])
        users = cons.get(relu.output[0], [])
        if dq is None or dq.op_type != "DequantizeLinear" or len(users) != 1 or users[0].op_type != "QuantizeLinear":
            continue
        q = users[0]
        if len(cons.get(dq.output[0], [])) != 1 or dq.output[0] in g.outputs or len(dq.input) < 3 or len(q.input) < 3:
            continue
        if attr(dq, "axis", 1) != attr(q, "axis", 1):
            continue
        grid = [g.array(n) for n in (dq.input[1], q.input[1], dq.input[2], q.input[2])]
        if any(a is None for a in grid) or grid[2].dtype != np.uint8 or grid[2].ndim != 0:
            continue
        if not (np.array_equal(grid[0], grid[1]) and grid[0].dtype == grid[1].dtype
                and np.array_equal(grid[2], grid[3]) and grid[2].dtype == grid[3].dtype):
            mismatched += 1
            continue
        clip = helper.make_node("Clip", [dq.input[0], dq.input[2]], [q.output[0]], name=g.fresh(f"{relu.name}_u8"))
        g.nodes[g.nodes.index(q)] = clip
        g.nodes.remove(relu)
        g.nodes.remove(dq)
        count += 1
    return count, mismatched


def apply(model: onnx.ModelProto, weights: str = "auto") -> tuple[onnx.ModelProto, list[str]]:
    """The three rewrites (weights stored as ``weights``: see the module docstring); returns the model and notes."""
    chosen = resolve_weights(weights)
    g = Graph(model)
    n_u8 = int8_to_uint8(g, weights=chosen == "uint8")
    n_bias = split_gemm_bias(g)
    n_clip, n_mismatched = relu_to_clip(g)
    g.prune()
    notes = []
    why = f" (auto: this CPU has{'' if chosen == 'int8' else ' no'} VNNI)" if weights == "auto" else ""
    if chosen == "int8":
        notes.append(f"onnxruntime layout: int8 weights{why}: ORT's fast u8 x s8 kernels, exact on CPUs with VNNI "
                     "or AMX; on x86 CPUs without VNNI they saturate: export with ort_weights='uint8' for those")
    else:
        notes.append(f"onnxruntime layout: uint8 weights{why}: ORT's u8 x u8 kernels, exact on every CPU (slower "
                     "than u8 x s8 on CPUs with VNNI)")
    if n_u8:
        notes.append(f"onnxruntime layout: {n_u8} int8 Q/DQ node(s) stored as uint8 with zero point +128 (exact)")
    if n_bias:
        notes.append(f"onnxruntime layout: {n_bias} Gemm bias(es) added after the int8 product (exact float bias)")
    if n_mismatched:
        notes.append(f"onnxruntime layout: {n_mismatched} DequantizeLinear -> Relu -> QuantizeLinear "
                     "chain(s) join two grids and stay float; modelopt_lite.share_relu_grids(model, forward_loop) "
                     "before export runs them as uint8 Clips between the int8 kernels")
    if n_clip:
        notes.append(f"onnxruntime layout: {n_clip} DequantizeLinear -> Relu -> QuantizeLinear chain(s) on one grid "
                     "run as a uint8 Clip (exact)")
    return g.commit(), notes
