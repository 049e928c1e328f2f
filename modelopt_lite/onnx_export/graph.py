"""A small mutable view of an ONNX graph for the post-export passes (producers, consumers, constants, names).

Only what the passes need: nodes are kept in a Python list (written back by :meth:`Graph.commit`), initializers in
a dict, and :meth:`Graph.constants` evaluates the constant sub-graphs feeding given tensors (e.g. the
``Where(amax <= eps, 0, amax / bound)`` chain that computes a scale) with ONNX's reference evaluator.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Ops whose output is not a pure function of their inputs, or that carry sub-graphs: never constant-folded.
_NOT_FOLDABLE = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "If",
    "Loop",
    "Scan",
    "SequenceConstruct",
}


class OpsetTooLow(ValueError):
    """The graph needs a higher opset than requested (``required``); export_onnx retries when opset was None."""

    def __init__(self, message: str, required: int):
        super().__init__(message)
        self.required = required


class Graph:
    """Mutable wrapper of ``model.graph`` (main graph only; sub-graphs are left untouched)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.nodes: list[onnx.NodeProto] = list(model.graph.node)
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in model.graph.initializer}
        self.inputs = {i.name for i in model.graph.input} - set(self.inits)
        self.outputs = [o.name for o in model.graph.output]
        self._counter = itertools.count()
        self._names = self._all_names()

    # --- structure -------------------------------------------------------------------------------------------------
    def _all_names(self) -> set[str]:
        names = set(self.inits) | self.inputs | set(self.outputs)
        for n in self.nodes:
            names.update(n.input)
            names.update(n.output)
            names.add(n.name)
        return names

    def fresh(self, base: str) -> str:
        """A tensor/node name not used anywhere in the graph yet."""
        base = base.lstrip("/") or "t"
        name = base
        while name in self._names:
            name = f"{base}_{next(self._counter)}"
        self._names.add(name)
        return name

    def producers(self) -> dict[str, onnx.NodeProto]:
        return {o: n for n in self.nodes for o in n.output if o}

    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        out: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for i in n.input:
                if i:
                    out.setdefault(i, []).append(n)
        return out

    def rename_uses(self, old: str, new: str) -> None:
        """Make every consumer of ``old`` (and graph outputs) read ``new`` instead."""
        for n in self.nodes:
            for k, i in enumerate(n.input):
                if i == old:
                    n.input[k] = new
        if old in self.outputs:  # keep the graph output name: alias it
            self.nodes.append(helper.make_node("Identity", [new], [old], name=self.fresh(f"{old}_alias")))

    # --- constants -------------------------------------------------------------------------------------------------
    def array(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a ``Constant`` node output, else None."""
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        prod = self.producers().get(name)
        if prod is not None and prod.op_type == "Constant" and prod.domain in ("", "ai.onnx"):
            for a in prod.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        return None

    def add_init(self, base: str, value) -> str:
        """Add an initializer (ndarray or TensorProto) under a fresh name; returns the name."""
        name = self.fresh(base)
        t = value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(np.asarray(value), name)
        t.name = name
        self.inits[name] = t
        return name

    def shared_zero(self, np_type) -> str:
        """One scalar zero-point initializer of ``np_type`` (value 0) shared by every per-tensor Q/DQ."""
        key = f"zero.{np.dtype(np_type).name}"
        if key not in self.inits:
            self._names.add(key)
            self.inits[key] = numpy_helper.from_array(np.zeros((), np_type), key)
        return key

    def constants(self, names) -> dict[str, np.ndarray]:
        """Values of those ``names`` that depend only on initializers/constants (others are left out)."""
        prod = self.producers()
        memo: dict[str, bool] = {}

        def is_const(name: str) -> bool:
            if name in memo:
                return memo[name]
            if not name or name in self.inits:
                memo[name] = True
                return True
            node = prod.get(name)
            ok = (
                node is not None
                and node.domain in ("", "ai.onnx")
                and node.op_type not in _NOT_FOLDABLE
                and all(is_const(i) for i in node.input)
            )
            memo[name] = ok
            return ok

        wanted = [n for n in dict.fromkeys(names) if is_const(n)]
        out = {n: numpy_helper.to_array(self.inits[n]) for n in wanted if n in self.inits}
        todo = [n for n in wanted if n not in out]
        if not todo:
            return out
        needed: list[onnx.NodeProto] = []
        seen: set[int] = set()

        def collect(name: str) -> None:
            node = prod.get(name)
            if node is None or id(node) in seen or name in self.inits:
                return
            seen.add(id(node))
            for i in node.input:
                collect(i)
            needed.append(node)

        for n in todo:
            collect(n)
        used = {i for node in needed for i in node.input}
        graph = helper.make_graph(
            needed,
            "const",
            [],
            [helper.make_value_info(n, onnx.TypeProto()) for n in todo],
            [self.inits[i] for i in used if i in self.inits],
        )
        sub = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        from onnx.reference import ReferenceEvaluator

        values = ReferenceEvaluator(sub).run(None, {})
        out.update({n: np.asarray(v) for n, v in zip(todo, values)})
        return out

    def constants_with(self, values: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
        """:meth:`constants` with the tensors in ``values`` replaced by those arrays (the graph is left as it was)."""
        saved = {k: self.inits.get(k) for k in values}
        try:
            for k, v in values.items():
                self.inits[k] = numpy_helper.from_array(np.asarray(v), k)
            return self.constants(names)
        finally:
            for k, t in saved.items():
                if t is None:
                    del self.inits[k]
                else:
                    self.inits[k] = t

    # --- clean-up --------------------------------------------------------------------------------------------------
    def prune(self) -> None:
        """Drop nodes whose outputs nobody reads, and unused initializers."""
        while True:
            used = set(self.outputs)
            for n in self.nodes:
                used.update(n.input)
                used.update(_subgraph_inputs(n))
            keep = [n for n in self.nodes if any(o in used for o in n.output if o)]
            if len(keep) == len(self.nodes):
                break
            self.nodes = keep
        self.inits = {k: v for k, v in self.inits.items() if k in used}

    def tidy_names(self) -> None:
        """Shorten the exporter's names: ``/a/b/Op_output_0`` -> ``a/b/Op`` (tensors) and ``/a/b/Op`` -> ``a/b/Op``
        (nodes), where the short name is free. Graph inputs, outputs and initializers keep their names."""
        keep = set(self.inits) | self.inputs | set(self.outputs)
        taken = set(keep)
        mapping = {}
        for n in self.nodes:
            for o in n.output:
                if not o or o in keep or o in mapping:
                    continue
                short = o.lstrip("/")
                short = short.removesuffix("_output_0")
                if short != o and short and short not in taken and short not in self._names:
                    mapping[o] = short
                    taken.add(short)
                else:
                    taken.add(o)
        for n in self.nodes:
            n.name = n.name.lstrip("/")
            for k, i in enumerate(n.input):
                if i in mapping:
                    n.input[k] = mapping[i]
            for k, o in enumerate(n.output):
                if o in mapping:
                    n.output[k] = mapping[o]

    def commit(self) -> onnx.ModelProto:
        """Write nodes and initializers back into the model (topologically sorted) and return it."""
        g = self.model.graph
        del g.node[:]
        g.node.extend(self._toposort())
        del g.initializer[:]
        g.initializer.extend(self.inits.values())
        kept_inputs = [i for i in g.input if i.name in self.inputs or i.name in self.inits]
        del g.input[:]
        g.input.extend(kept_inputs)
        del g.value_info[:]  # stale after the rewrites; shape inference recomputes it
        return self.model

    def _toposort(self) -> list[onnx.NodeProto]:
        available = set(self.inits) | self.inputs | {""}
        pending = list(self.nodes)
        ordered: list[onnx.NodeProto] = []
        while pending:
            rest = []
            for n in pending:
                if all(i in available for i in n.input) and set(_subgraph_inputs(n)) <= available:
                    ordered.append(n)
                    available.update(n.output)
                else:
                    rest.append(n)
            if len(rest) == len(pending):  # a cycle or an unknown input: keep the remaining order as is
                ordered.extend(rest)
                break
            pending = rest
        return ordered


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope names read by the sub-graphs of a node (If/Loop/Scan bodies)."""
    names: list[str] = []
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for g in graphs:
            inner = {o for n in g.node for o in n.output} | {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                names += [i for i in n.input if i and i not in inner]
    return names


def attr(node: onnx.NodeProto, name: str, default=None):
    """An attribute value of a node (a string attribute as ``str``), or ``default``."""
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default
