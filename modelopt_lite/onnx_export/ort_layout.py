"""Exact graph rewrites that let ONNX Runtime's CPU provider run real int8 kernels (target="onnxruntime").

1. **int8 -> uint8 with zero point + 128.** ``Q_uint8(x, s, z + 128) = Q_int8(x, s, z) + 128`` and
   ``DQ(q + 128, s, z + 128) = DQ(q, s, z)`` exactly, so every int8 Q/DQ and int8 weight initializer is stored as
   uint8. Why: on x86 CPUs without VNNI, ORT's u8 x s8 GEMM uses ``vpmaddubsw``, whose int16 pair sums saturate
   (255 * 127 * 2 > 32767) and give wrong results for full-range int8 weights; the u8 x u8 kernel does not.
2. **Bias after the int8 product.** ``Gemm(DQ(a), DQ(w), bias)`` becomes ``Gemm(DQ(a), DQ(w)) + bias``: ORT then
   fuses the Gemm into QGemm with a float output and adds the float bias exactly as torch does, instead of
   re-quantizing the bias to int32 (which moves outputs by up to half an int32 step and flips roundings of a
   following quantizer). Conv keeps its bias (QLinearConv needs ``Conv -> Q``).
"""

from __future__ import annotations

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


def int8_to_uint8(g: Graph) -> int:
    """Rewrite every int8 Q/DQ and int8 DQ input initializer as uint8 (zero point + 128); returns the count."""
    cache: dict[str, str] = {}
    count = 0
    for n in g.nodes:
        if n.domain not in ("", "ai.onnx") or n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        has_zp = len(n.input) > 2 and bool(n.input[2])
        if n.op_type == "DequantizeLinear" and n.input[0] in g.inits:  # a stored weight
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


def apply(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """Both rewrites; returns the model and report notes."""
    g = Graph(model)
    n_u8 = int8_to_uint8(g)
    n_bias = split_gemm_bias(g)
    g.prune()
    notes = []
    if n_u8:
        notes.append(f"onnxruntime layout: {n_u8} int8 Q/DQ node(s) stored as uint8 with zero point +128 (exact; "
                     "avoids the saturating u8 x s8 kernel on CPUs without VNNI)")
    if n_bias:
        notes.append(f"onnxruntime layout: {n_bias} Gemm bias(es) added after the int8 product (exact float bias)")
    return g.commit(), notes
