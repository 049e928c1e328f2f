"""Exact graph rewrites that let ONNX Runtime's CPU provider run real int8 kernels (target="onnxruntime").

1. **int8 activations -> uint8 with zero point + 128.** ``Q_uint8(x, s, z + 128) = Q_int8(x, s, z) + 128`` and
   ``DQ(q + 128, s, z + 128) = DQ(q, s, z)`` exactly, so every int8 activation Q/DQ is stored as uint8 (ORT's int8
   GEMM and convolution kernels take unsigned activations). The weights (``weights=``):

   - ``"auto"`` (default): each weight on its own, from its codes only, so the file does not depend on the
     machine that exports it: signed int8 when every code lies in ``[-64, 64]`` (7-bit weights, as the
     ``INT8_ORT_REDUCED_RANGE_CFG`` preset quantizes them, or ORT's own ``reduce_range``), else uint8. Both are
     exact on every CPU. Signed weights run ORT's u8 x s8 kernels, which on x86 CPUs without VNNI multiply with
     ``vpmaddubsw``: its int16 sums of two products saturate beyond 32767, and ``255 * 64 * 2 = 32640`` does not
     get there, while full-range 8-bit codes can (``255 * 127 * 2 = 64770``).
   - ``"int8"``: every weight signed (ORT's own ``quantize_static`` layout): the fast u8 x s8 kernels
     (``vpdpbusd`` on AVX512-VNNI / AVX-VNNI / AMX CPUs, 2.4x faster than u8 x u8 on the MLP of
     ``bench/bench_onnx.py`` on a Xeon), exact there. With codes beyond ``[-64, 64]`` (8-bit weights) the file is
     **exact only on CPUs with VNNI or AMX**: on other x86 CPUs ORT's results change (saturated sums). Such an
     export warns (``UserWarning``) and its report says so. A VNNI-only choice, for files that will only ever run
     on such CPUs.
   - ``"uint8"``: every weight stored as uint8 + 128 too: ORT's u8 x u8 kernels, exact on every CPU, slower.
2. **Biases.** A ``Conv``/``Gemm`` of two DequantizeLinear inputs whose output goes to one QuantizeLinear (ORT
   fuses it into ``QLinearConv``/``QGemm`` with an int8 output) gets its float bias stored as int32 on the
   accumulator's grid, ``DQ(rint(b / float32(sx * sw)), sx * sw)``, computed exactly as the torch layer does with
   ``requant="integer"`` (:mod:`modelopt_lite.functional.requant`): ORT's fused kernel and torch then agree bit for
   bit. A Gemm whose output stays float becomes ``Gemm(DQ(a), DQ(w)) + bias`` (QGemm with a float output, then the
   float bias added exactly as torch does).
3. **Relu between two quantizers of one grid as a uint8 clip.** ``Q(Relu(DQ(q, s, z)), s, z) = max(q, z)`` exactly
   (``(q - z) * s / s`` rounds back to ``q - z``), so ``DQ -> Relu -> Q`` with the same scale and zero point becomes
   ``Clip(q, min=z)`` on the uint8 codes: three float passes become one byte pass between ORT's int8 kernels. A
   ``Flatten``/``Reshape`` between the Relu and the Q (a CNN's head) moves onto the codes.
4. **Flatten in channels-last order.** ORT runs ``QLinearConv`` on NHWC tensors and transposes back to NCHW in
   front of a ``Flatten``. When a Conv's output reaches a Flatten (through per-tensor Q/DQ/Relu/Clip) that feeds
   only int8 Gemms, the graph flattens ``Transpose(x, [0, 2, 3, 1])`` instead and the Gemm weights' columns are
   permuted to match: ORT cancels the two transposes. The integer products are the same, only summed in another
   order, which integer accumulation does not see: results are unchanged, bit for bit.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..functional import requant
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

#: the largest |weight code| that ORT's u8 x s8 kernels without VNNI multiply exactly: the int16 sum of two
#: products of a uint8 activation and a signed weight, 2 * 255 * 64 = 32640, stays below 32767
SAFE_INT8_WEIGHT = 64


@functools.cache
def host_has_vnni() -> bool:
    """True when this machine's x86 CPU has VNNI (AVX512-VNNI or AVX-VNNI) or AMX-INT8 (Linux /proc/cpuinfo).

    Only for checks and tests that run a file here: the layout written by :func:`apply` never depends on it."""
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
    """Check a ``weights=`` argument (one of ``WEIGHT_DTYPES``) and return it."""
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"ort_weights must be one of {WEIGHT_DTYPES}, got {weights!r}")
    return weights


def fits_reduced_range(t: onnx.TensorProto) -> bool:
    """True when an INT8 weight initializer's codes all lie within ``[-SAFE_INT8_WEIGHT, SAFE_INT8_WEIGHT]``."""
    arr = numpy_helper.to_array(t)
    return arr.size == 0 or int(np.abs(arr.astype(np.int16)).max()) <= SAFE_INT8_WEIGHT


def wide_int8_weights(model: onnx.ModelProto) -> list[str]:
    """The INT8 weight initializers read by a DequantizeLinear whose codes go beyond the reduced range: exact in
    ORT's fused u8 x s8 kernels only on CPUs with VNNI or AMX (see the module docstring)."""
    inits = {t.name: t for t in model.graph.initializer if t.data_type == TensorProto.INT8}
    names = {n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    return sorted(name for name in names if not fits_reduced_range(inits[name]))


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


def int8_to_uint8(g: Graph, weights: str = "uint8") -> tuple[int, int]:
    """Rewrite every int8 Q/DQ as uint8 (zero point + 128), and the int8 weights (DQ input initializers) as
    ``weights`` says (module docstring); returns ``(activation Q/DQ rewritten, weights stored as uint8)``."""
    cache: dict[str, str] = {}
    count = n_weights = 0
    for n in g.nodes:
        if n.domain not in ("", "ai.onnx") or n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        has_zp = len(n.input) > 2 and bool(n.input[2])
        if n.op_type == "DequantizeLinear" and n.input[0] in g.inits:  # a stored weight
            t = g.inits[n.input[0]]
            if t.data_type != TensorProto.INT8:
                continue
            if weights == "int8" or (weights == "auto" and fits_reduced_range(t)):
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
            n_weights += 1
        elif has_zp:
            zp = _shift_uint8(g, n.input[2], cache)
            if zp is not None:
                n.input[2] = zp
                count += 1
    return count, n_weights


def _per_channel_scale(g: Graph, dq, out_axis: int, channels: int) -> np.ndarray | None:
    """The weight DQ's float32 scale as one value per output channel (None when it is not per tensor or per
    output channel, or not a stored weight with zero point 0)."""
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.inits:
        return None
    s = g.array(dq.input[1])
    zp = g.array(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    symmetric = zp is None or (zp.dtype == np.int8 and not zp.any()) or (zp.dtype == np.uint8 and (zp == 128).all())
    if s is None or s.dtype != np.float32 or not symmetric:  # uint8 weights are stored + 128
        return None
    if s.size == 1:
        return np.full(channels, s.reshape(()), np.float32)
    rank = len(g.inits[dq.input[0]].dims)
    if s.ndim != 1 or s.size != channels or attr(dq, "axis", 1) % rank != out_axis:
        return None
    return s


def quantize_biases(g: Graph) -> int:
    """Float biases of ``DQ -> Conv/Gemm -> Q`` stored as int32 DQs (rewrite 2 above); returns the count."""
    prod, cons = g.producers(), g.consumers()
    count = 0
    for n in list(g.nodes):
        if n.op_type not in ("Conv", "Gemm") or len(n.input) < 3 or not n.input[2] or n.input[2] not in g.inits:
            continue
        users = cons.get(n.output[0], [])
        if len(users) != 1 or users[0].op_type != "QuantizeLinear" or n.output[0] in g.outputs:
            continue
        bias = g.array(n.input[2])
        a = prod.get(n.input[0])
        if bias is None or bias.dtype != np.float32 or bias.ndim != 1 or a is None or a.op_type != "DequantizeLinear":
            continue
        sx = g.array(a.input[1])
        if sx is None or sx.size != 1 or sx.dtype != np.float32:
            continue
        if n.op_type == "Gemm":
            if attr(n, "alpha", 1.0) != 1.0 or attr(n, "beta", 1.0) != 1.0 or attr(n, "transA", 0):
                continue
            out_axis = 0 if attr(n, "transB", 0) else 1
        else:
            out_axis = 0
        sw = _per_channel_scale(g, prod.get(n.input[1]), out_axis, bias.size)
        if sw is None:
            continue
        st = requant.bias_scale(torch.tensor(sx), torch.tensor(sw))  # the functions the torch layers use
        q = requant.bias_codes(torch.tensor(bias), st).numpy().astype(np.int32)
        scale = st.numpy()
        qname = g.add_init(f"{n.input[2]}.int32", q)
        sname = g.add_init(f"{n.input[2]}.scale", scale)
        out = g.fresh(f"{n.input[2]}_dq")
        g.nodes.insert(
            g.nodes.index(n),
            helper.make_node("DequantizeLinear", [qname, sname], [out], axis=0, name=g.fresh(f"{n.name}_bias_dq")),
        )
        n.input[2] = out
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
        if not (
            a is not None and a.op_type == "DequantizeLinear" and b is not None and b.op_type == "DequantizeLinear"
        ) or (c is not None and c.op_type == "DequantizeLinear"):
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
        between = []  # Flatten/Reshape nodes from the Relu to the Q: they move onto the uint8 codes
        while len(users) == 1 and users[0].op_type in ("Flatten", "Reshape") and users[0].output[0] not in g.outputs:
            between.append(users[0])
            users = cons.get(users[0].output[0], [])
        if dq is None or dq.op_type != "DequantizeLinear" or len(users) != 1 or users[0].op_type != "QuantizeLinear":
            continue
        q = users[0]
        if len(cons.get(dq.output[0], [])) != 1 or dq.output[0] in g.outputs or len(dq.input) < 3 or len(q.input) < 3:
            continue
        if attr(dq, "axis", 1) != attr(q, "axis", 1):
            continue
        found = [g.array(n) for n in (dq.input[1], q.input[1], dq.input[2], q.input[2])]
        grid = [a for a in found if a is not None]
        if len(grid) < len(found) or grid[2].dtype != np.uint8 or grid[2].ndim != 0:
            continue
        if not (
            np.array_equal(grid[0], grid[1])
            and grid[0].dtype == grid[1].dtype
            and np.array_equal(grid[2], grid[3])
            and grid[2].dtype == grid[3].dtype
        ):
            mismatched += 1
            continue
        clipped = q.output[0] if not between else g.fresh(f"{relu.output[0]}_u8")
        clip = helper.make_node("Clip", [dq.input[0], dq.input[2]], [clipped], name=g.fresh(f"{relu.name}_u8"))
        g.nodes[g.nodes.index(relu)] = clip
        if between:  # Clip -> Flatten/Reshape on the codes, the last one writing what the Q wrote
            between[0].input[0] = clipped
            between[-1].output[0] = q.output[0]
        g.nodes.remove(q)
        g.nodes.remove(dq)
        count += 1
    return count, mismatched


_PASS = ("QuantizeLinear", "DequantizeLinear", "Clip", "Relu")  # per-tensor element-wise: commute with transposes


def _passes(g: Graph, n) -> bool:
    if n.op_type in ("Clip", "Relu"):
        return True
    s = g.array(n.input[1]) if n.op_type in _PASS[:2] else None
    return s is not None and s.size == 1


def _flatten_gemms(g: Graph, flat, prod, cons) -> list | None:
    """The Gemms that read ``flat``'s output as A through per-tensor element-wise nodes, each with a stored weight
    (DQ of an initializer used nowhere else, transB=1); None when anything else reads it."""
    gemms, frontier = [], [flat.output[0]]
    while frontier:
        t = frontier.pop()
        if t in g.outputs:
            return None
        for u in cons.get(t, []):
            if u.input[0] != t:
                return None
            if u.op_type in _PASS and _passes(g, u):
                frontier.append(u.output[0])
                continue
            if u.op_type != "Gemm" or attr(u, "transA", 0) or not attr(u, "transB", 0):
                return None
            dq = prod.get(u.input[1])
            if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.inits:
                return None
            if len(cons.get(dq.output[0], [])) != 1 or len(cons.get(dq.input[0], [])) != 1:
                return None
            gemms.append((u, dq))
    return gemms


def nhwc_flatten(g: Graph, shapes: dict[str, list]) -> int:
    """Rewrite 4 above; returns the number of Flatten nodes rewritten."""
    prod, cons = g.producers(), g.consumers()
    count = 0
    for flat in list(g.nodes):
        if flat.op_type != "Flatten" or attr(flat, "axis", 1) != 1:
            continue
        dims = shapes.get(flat.input[0])
        src = prod.get(flat.input[0])
        while src is not None and src.op_type in _PASS and _passes(g, src):  # element-wise: same shape
            dims = dims or shapes.get(src.input[0])
            src = prod.get(src.input[0])
        if src is None or src.op_type != "Conv":
            continue
        dims = dims or shapes.get(src.output[0])
        if (
            not dims
            or len(dims) != 4
            or not all(isinstance(d, int) and d > 0 for d in dims[1:])
            or dims[2] * dims[3] == 1
        ):
            continue
        gemms = _flatten_gemms(g, flat, prod, cons)
        if not gemms:
            continue
        _, c, h, w = dims
        for _, dq in gemms:
            t = g.inits[dq.input[0]]
            arr = numpy_helper.to_array(t)
            if arr.ndim != 2 or arr.shape[1] != c * h * w:
                break
        else:
            for _, dq in gemms:
                arr = numpy_helper.to_array(g.inits[dq.input[0]])
                perm = arr.reshape(arr.shape[0], c, h, w).transpose(0, 2, 3, 1).reshape(arr.shape[0], -1)
                dq.input[0] = g.add_init(f"{dq.input[0]}.nhwc", np.ascontiguousarray(perm))
            out = g.fresh(f"{flat.input[0]}_nhwc")
            g.nodes.insert(
                g.nodes.index(flat),
                helper.make_node(
                    "Transpose", [flat.input[0]], [out], perm=[0, 2, 3, 1], name=g.fresh(f"{flat.name}_nhwc")
                ),
            )
            flat.input[0] = out
            count += 1
    return count


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Static dims (ints, or None for symbolic ones) of every tensor shape inference can type."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - shapes are only an optimization hint here
        return {}
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return out


def _weight_notes(weights: str, n_int8: int, n_uint8: int, wide: list[str]) -> list[str]:
    notes = []
    if n_int8:
        where = (
            f"exact only on CPUs with VNNI or AMX ({len(wide)} with codes beyond +-{SAFE_INT8_WEIGHT}, first: "
            f"{wide[0]!r}; on x86 CPUs without VNNI ORT's kernels saturate there: export with "
            "ort_weights='auto' or 'uint8' for those, or quantize the weights to 7 bits, INT8_ORT_REDUCED_RANGE_CFG)"
            if wide
            else f"codes within +-{SAFE_INT8_WEIGHT}: exact on every CPU"
        )
        notes.append(
            f"onnxruntime layout (ort_weights={weights!r}): {n_int8} int8 weight(s), ORT's u8 x s8 kernels, " + where
        )
    if n_uint8:
        why = f" (codes beyond +-{SAFE_INT8_WEIGHT})" if weights == "auto" else ""
        notes.append(
            f"onnxruntime layout (ort_weights={weights!r}): {n_uint8} uint8 weight(s){why}, ORT's u8 x u8 kernels, "
            "exact on every CPU (slower than u8 x s8; 7-bit weights, INT8_ORT_REDUCED_RANGE_CFG, run as int8 "
            "exactly everywhere)"
        )
    return notes


def apply(model: onnx.ModelProto, weights: str = "auto") -> tuple[onnx.ModelProto, list[str]]:
    """The rewrites (weights stored as ``weights``: see the module docstring); returns the model and notes.

    ``weights="int8"`` with weights beyond the reduced range warns (``UserWarning``): that file is exact only on
    CPUs with VNNI or AMX."""
    resolve_weights(weights)
    g = Graph(model)
    n_weights = sum(
        1
        for n in g.nodes
        if n.op_type == "DequantizeLinear"
        and n.input[0] in g.inits
        and g.inits[n.input[0]].data_type == TensorProto.INT8
    )
    n_u8, n_uint8_w = int8_to_uint8(g, weights=weights)
    n_qbias = quantize_biases(g)
    n_bias = split_gemm_bias(g)
    n_clip, n_mismatched = relu_to_clip(g)
    n_nhwc = nhwc_flatten(g, _shapes(model))
    g.prune()
    out = g.commit()
    wide = wide_int8_weights(out)
    if wide:
        warnings.warn(
            f"export_onnx(target='onnxruntime', ort_weights={weights!r}): {len(wide)} int8 weight(s) with codes "
            f"beyond +-{SAFE_INT8_WEIGHT} (first: {wide[0]!r}): exact in ONNX Runtime only on CPUs with VNNI or "
            "AMX; on other x86 CPUs its u8 x s8 kernels saturate and results change. Use ort_weights='auto' "
            "(exact everywhere) or 7-bit weights (INT8_ORT_REDUCED_RANGE_CFG) unless the file only runs on such CPUs",
            UserWarning,
            stacklevel=3,
        )
    notes = _weight_notes(weights, n_weights - n_uint8_w, n_uint8_w, wide)
    if n_u8:
        notes.append(f"onnxruntime layout: {n_u8} int8 Q/DQ node(s) stored as uint8 with zero point +128 (exact)")
    if n_qbias:
        notes.append(
            f"onnxruntime layout: {n_qbias} Conv/Gemm bias(es) stored as int32 on the accumulator's grid "
            "(the int8 kernels' integer requantization, as torch layers with requant='integer')"
        )
    if n_bias:
        notes.append(f"onnxruntime layout: {n_bias} Gemm bias(es) added after the int8 product (exact float bias)")
    if n_mismatched:
        notes.append(
            f"onnxruntime layout: {n_mismatched} DequantizeLinear -> Relu -> QuantizeLinear "
            "chain(s) join two grids and stay float; modelopt_lite.share_relu_grids(model, forward_loop) "
            "before export runs them as uint8 Clips between the int8 kernels"
        )
    if n_clip:
        notes.append(
            f"onnxruntime layout: {n_clip} DequantizeLinear -> Relu -> QuantizeLinear chain(s) on one grid "
            "run as a uint8 Clip (exact)"
        )
    if n_nhwc:
        notes.append(
            f"onnxruntime layout: {n_nhwc} Flatten(s) after a Conv flatten in channels-last order (ORT's "
            "NHWC int8 convolution needs no transpose back; exact)"
        )
    return out, notes
