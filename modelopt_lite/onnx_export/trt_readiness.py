"""TensorRT readiness of a Q/DQ ONNX graph: is Q/DQ where TensorRT's fusions need it, and which ops stay in float.

TensorRT (explicit quantization) runs a layer in INT8/FP8 only when Q/DQ tells it the precision of the layer's
inputs; it fuses the DequantizeLinear nodes into the consumer and propagates them through data-movement ops
(Reshape, Transpose, ...). Per pattern, what it needs:

- **Conv / ConvTranspose**: the data input dequantized and the weight a DequantizeLinear of a constant.
- **GEMM / MatMul with weights** (one operand constant): the weight a DequantizeLinear of a constant (or a
  Slice/Split/Gather of one: the Q/K/V rows of a packed in-projection weight, which TensorRT folds as constant
  data) and the activation dequantized (``ready``); a dequantized weight with a float activation is a weight-only GEMM
  (``weight-only``: TensorRT's INT4/INT8 weight-only kernels, activations in float/half).
- **attention MatMul** (both operands computed at run time: ``Q @ K^T``, ``P @ V``): both inputs dequantized.
- **residual Add** (an Add of two run-time tensors where one is a Conv/GEMM output, possibly through
  BatchNormalization or a bias Add, or one is dequantized): TensorRT fuses the Add into that layer when the *other*
  input is dequantized (``fused``); with both inputs dequantized it runs as a quantized element-wise layer
  (``ready``). Adds that feed a Softmax (attention masks) are not residual adds.

Status ``missing`` names the inputs without Q/DQ. ``float_ops`` counts by op type the floating-point compute ops
left unquantized: ops that are none of the above and whose run-time inputs are not all dequantized, except the
epilogues TensorRT fuses into a quantized Conv/GEMM (BatchNormalization, Relu, Clip, bias Add, ...); data-movement
and shape ops, and ops on integer/bool tensors (shape arithmetic, masks), are not counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

#: ops TensorRT propagates Q/DQ through (data movement only)
PASS_THROUGH = ("Cast", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Expand")
#: data-movement / shape ops: never counted as float compute
DATA_OPS = PASS_THROUGH + (
    "Shape",
    "Size",
    "Gather",
    "GatherElements",
    "GatherND",
    "Concat",
    "Split",
    "Slice",
    "Tile",
    "Pad",
    "ConstantOfShape",
    "Range",
    "Constant",
    "Where",
    "Dropout",
)
#: ops TensorRT fuses into the Conv/GEMM before them (a bias Add is handled separately)
EPILOGUE_OPS = ("BatchNormalization", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish")
Q_OPS = ("QuantizeLinear", "TRT_FP8QuantizeLinear")
DQ_OPS = ("DequantizeLinear", "TRT_FP8DequantizeLinear")
LAYER_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
#: ops taking part of a tensor: followed back from a weight operand only (a part of a constant is constant)
WEIGHT_SLICE_OPS = ("Slice", "Split", "Gather")
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}

PATTERNS = ("attention MatMul", "GEMM/MatMul with weights", "Conv", "residual Add")
#: statuses that count as "Q/DQ in place" for a pattern
OK_STATUSES = ("ready", "weight-only", "fused")


@dataclass
class PatternCheck:
    """One node of a TensorRT fusion pattern and whether its Q/DQ is in place."""

    pattern: str  # one of PATTERNS
    node: str
    status: str  # "ready", "weight-only", "fused" or "missing"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES


@dataclass
class TrtReadiness:
    """Per-pattern Q/DQ placement checks and the float ops left (see the module docstring)."""

    checks: list[PatternCheck] = field(default_factory=list)
    float_ops: dict[str, int] = field(default_factory=dict)

    def by_pattern(self, pattern: str) -> list[PatternCheck]:
        return [c for c in self.checks if c.pattern == pattern]

    @property
    def ready(self) -> bool:
        """Every pattern node has its Q/DQ in place (float ops elsewhere may remain)."""
        return all(c.ok for c in self.checks)

    def format(self) -> list[str]:
        """Printable lines (the ``TensorRT readiness`` section of :meth:`InspectReport.format`)."""
        lines = ["TensorRT readiness (Q/DQ where TensorRT's fusions need it):"]
        for p in PATTERNS:
            cs = self.by_pattern(p)
            if not cs:
                continue
            counts = Counter(c.status for c in cs)
            parts = ", ".join(f"{counts[s]} {s}" for s in (*OK_STATUSES, "missing") if counts[s])
            lines.append(f"  {p}: {sum(c.ok for c in cs)} of {len(cs)} in place ({parts})")
            lines += [f"    {c.node}: {c.detail}" for c in cs if not c.ok or c.status == "weight-only"]
        if not self.checks:
            lines.append("  (no Conv, GEMM, MatMul or residual Add)")
        if self.float_ops:
            lines.append("  float ops left: " + ", ".join(f"{k} {v}" for k, v in sorted(self.float_ops.items())))
        else:
            lines.append("  float ops left: none")
        return lines


class _View:
    """Producers, consumers, constants and element types of a graph."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.nodes = list(g.node)
        self.inits = {t.name for t in g.initializer}
        self.producers = {o: n for n in self.nodes for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.types = _elem_types(model)

    def source(self, name: str, depth: int = 0) -> tuple[str, onnx.NodeProto | None]:
        """Follow ``name`` back through pass-through ops: (tensor name, its producer or None)."""
        node = self.producers.get(name)
        if node is not None and node.op_type in PASS_THROUGH and depth < 16 and node.input:
            return self.source(node.input[0], depth + 1)
        return name, node

    def _unslice(self, name: str) -> str:
        """``name`` followed back through pass-through ops and Slice/Split/Gather of a constant operand."""
        for _ in range(4):
            _, node = self.source(name)
            if node is None or node.op_type not in WEIGHT_SLICE_OPS or not node.input:
                return name
            if not all(self.is_constant(i) for i in node.input[1:] if i):  # run-time slice bounds: not a weight
                return name
            name = node.input[0]
        return name

    def is_constant(self, name: str) -> bool:
        src, node = self.source(name)
        if node is not None and node.op_type in WEIGHT_SLICE_OPS and node.input:
            return all(self.is_constant(i) for i in node.input if i)
        return src in self.inits or (node is not None and node.op_type == "Constant")

    def is_dequantized(self, name: str) -> bool:
        _, node = self.source(name)
        return node is not None and node.op_type in DQ_OPS

    def is_weight_dq(self, name: str) -> bool:
        """A DequantizeLinear of a constant (a quantized weight), possibly transposed/reshaped/sliced afterwards."""
        _, node = self.source(self._unslice(name))
        return node is not None and node.op_type in DQ_OPS and self.is_constant(node.input[0])

    def layer_output(self, name: str, depth: int = 0) -> onnx.NodeProto | None:
        """The Conv/GEMM whose output ``name`` is, through BatchNormalization, bias Adds and pass-through ops."""
        _, node = self.source(name)
        if node is None or depth > 8:
            return None
        if node.op_type in LAYER_OPS:
            return node
        if node.op_type == "BatchNormalization":
            return self.layer_output(node.input[0], depth + 1)
        if node.op_type == "Add" and len(node.input) == 2:
            a, b = node.input
            if self.is_constant(b):
                return self.layer_output(a, depth + 1)
            if self.is_constant(a):
                return self.layer_output(b, depth + 1)
        return None

    def derives_from(self, name: str, target: str, depth: int = 0) -> bool:
        """``name`` is computed from ``target`` within a few ops (e.g. ``x + 0.044715 * x**3`` inside a GELU)."""
        if name == target:
            return True
        node = self.producers.get(name)
        if node is None or depth > 4:
            return False
        return any(self.derives_from(i, target, depth + 1) for i in node.input if i)

    def feeds_softmax(self, name: str, depth: int = 0) -> bool:
        for c in self.consumers.get(name, []):
            if c.op_type == "Softmax":
                return True
            if c.op_type in PASS_THROUGH + ("Where", "Div", "Mul") and depth < 4 and c.output:
                if self.feeds_softmax(c.output[0], depth + 1):
                    return True
        return False

    def is_float(self, name: str) -> bool:
        t = self.types.get(name)
        return t is None or t in _FLOAT_TYPES


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor shape inference can type (best effort: custom domains stay untyped)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - an uninferable graph: fall back to what the file declares
        inferred = model
    g = inferred.graph
    types = {t.name: t.data_type for t in g.initializer}
    for v in list(g.input) + list(g.value_info) + list(g.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    return types


def _label(n: onnx.NodeProto) -> str:
    return f"{n.op_type} {n.name or n.output[0]!r}"


def _missing(view: _View, n: onnx.NodeProto, idx) -> list[str]:
    return [f"input {i} ({n.input[i]})" for i in idx if not view.is_dequantized(n.input[i])]


def _check_weighted(view: _View, n: onnx.NodeProto) -> PatternCheck | None:
    """Conv/ConvTranspose, or a Gemm/MatMul with one constant operand; None for an activation x activation one."""
    if len(n.input) < 2:
        return None
    if n.op_type in ("Conv", "ConvTranspose"):
        pattern, w, a = "Conv", 1, 0
    else:
        const = [i for i in (0, 1) if view.is_constant(n.input[i]) or view.is_weight_dq(n.input[i])]
        if len(const) != 1:
            return None
        pattern, w, a = "GEMM/MatMul with weights", const[0], 1 - const[0]
    weight_ok, act_ok = view.is_weight_dq(n.input[w]), view.is_dequantized(n.input[a])
    if weight_ok and act_ok:
        return PatternCheck(pattern, _label(n), "ready", "weight and input dequantized")
    if weight_ok and pattern != "Conv":
        return PatternCheck(pattern, _label(n), "weight-only", f"input {a} ({n.input[a]}) in float (weight-only GEMM)")
    missing = ([] if weight_ok else [f"weight (input {w}, {n.input[w]}) has no DequantizeLinear"]) + (
        [] if act_ok else [f"input {a} ({n.input[a]}) has no Q/DQ"]
    )
    return PatternCheck(pattern, _label(n), "missing", "; ".join(missing))


def _check_attention(view: _View, n: onnx.NodeProto) -> PatternCheck:
    missing = _missing(view, n, (0, 1))
    if not missing:
        return PatternCheck("attention MatMul", _label(n), "ready", "both inputs dequantized")
    return PatternCheck("attention MatMul", _label(n), "missing", "no Q/DQ on " + ", ".join(missing))


def _check_add(view: _View, n: onnx.NodeProto) -> PatternCheck | None:
    """A residual Add, or None for a bias/constant Add, a mask Add (feeds Softmax) or an Add of two other tensors."""
    if len(n.input) != 2 or any(view.is_constant(i) for i in n.input) or view.feeds_softmax(n.output[0]):
        return None
    dq = [view.is_dequantized(i) for i in n.input]
    layers = [None if dq[i] else view.layer_output(x) for i, x in enumerate(n.input)]
    if not any(dq) and not any(layers):
        return None
    for i, layer in enumerate(layers):  # an element-wise function of one layer output (GELU's x + c * x**3)
        if layer is not None and view.derives_from(n.input[1 - i], n.input[i]):
            return None
    if all(dq):
        srcs = [view.source(view.source(i)[1].input[0]) for i in n.input]  # type: ignore[union-attr]
        requant = [view.layer_output(q.input[0]) for _, q in srcs if q is not None and q.op_type in Q_OPS]
        detail = "both inputs dequantized (quantized element-wise Add)"
        if any(requant):
            layer = next(x for x in requant if x is not None)
            detail += (
                f"; {_label(layer)}'s output is re-quantized: Q/DQ on the skip branch only would fuse the Add into it"
            )
        return PatternCheck("residual Add", _label(n), "ready", detail)
    if any(dq):
        other = dq.index(False)
        layer = layers[other]
        if layer is not None:
            return PatternCheck(
                "residual Add", _label(n), "fused", f"fused into {_label(layer)} (skip branch quantized)"
            )
        return PatternCheck("residual Add", _label(n), "missing", f"input {other} ({n.input[other]}) has no Q/DQ")
    skip = layers.index(None) if None in layers else 1
    return PatternCheck(
        "residual Add",
        _label(n),
        "missing",
        f"no Q/DQ on the skip input {skip} ({n.input[skip]}): TensorRT cannot fuse the Add into the layer",
    )


def _fused_epilogue(view: _View, n: onnx.NodeProto, fusers: set[int]) -> bool:
    """``n`` follows a quantized Conv/GEMM or residual Add (``fusers``) through epilogue ops and bias Adds, so
    TensorRT fuses it into that layer."""
    if n.op_type not in EPILOGUE_OPS and n.op_type != "Add":
        return False
    cur = n
    for _ in range(8):
        ins = [i for i in cur.input if i and not view.is_constant(i)]
        if len(ins) != 1:
            return False
        _, prev = view.source(ins[0])
        if prev is None:
            return False
        if id(prev) in fusers:
            return True
        if prev.op_type in LAYER_OPS or (prev.op_type not in EPILOGUE_OPS and prev.op_type != "Add"):
            return False
        cur = prev
    return False


def check_readiness(model: onnx.ModelProto) -> TrtReadiness:
    """Check the TensorRT fusion patterns of a Q/DQ graph (see the module docstring)."""
    view = _View(model)
    rep = TrtReadiness()
    ok_nodes: set[int] = set()
    checked: set[int] = set()
    fusers: set[int] = set()
    for n in view.nodes:
        if n.domain not in ("", "ai.onnx"):
            continue
        check = None
        if n.op_type in LAYER_OPS:
            check = _check_weighted(view, n)
            if check is None and n.op_type in ("MatMul", "Gemm"):
                check = _check_attention(view, n)
        elif n.op_type == "Add":
            check = _check_add(view, n)
        if check is not None:
            rep.checks.append(check)
            checked.add(id(n))
            if check.ok:
                ok_nodes.add(id(n))
                fusers.add(id(n))  # its epilogue (Relu, ...) runs fused into it
    floats: Counter = Counter()
    for n in view.nodes:
        if n.op_type in Q_OPS + DQ_OPS + DATA_OPS or id(n) in ok_nodes or n.domain not in ("", "ai.onnx"):
            continue
        if not n.output or not view.is_float(n.output[0]):
            continue
        if id(n) not in checked:  # a pattern node counts by its check; any other op by its inputs
            runtime = [i for i in n.input if i and not view.is_constant(i) and view.is_float(i)]
            if not runtime or all(view.is_dequantized(i) for i in runtime):
                continue
            if _fused_epilogue(view, n, fusers):
                continue
        floats[n.op_type] += 1
    rep.float_ops = dict(floats)
    return rep
