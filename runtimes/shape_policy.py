"""Shape-producing ops only with sizes the graph's own shapes bound (a part of runtimes/graph_policy.py).

ConstantOfShape, Expand and Range make a tensor whose size is an input's value, so one node with
a constant 1.3e9 allocates 5 GB. What the exporter emits (listed with `onnx` over tiny bundles of
both flavours): the fused flavour has none of these ops; the portable flavour has Range, three per
graph, from `Shape` of its own inputs (P and P + T), with a constant step of 1. So each size input
of these ops must be computable from the graph's shapes: its producers, followed back through
arithmetic and shape plumbing, end in `Shape` nodes (whose values are at most the bundle's
`largest_dimension`) or in small constants, and an upper bound of its values, propagated along
the way, stays within SIZE_FACTOR times that dimension. Range's step must be a constant of magnitude >= 1. Anything else
(a size read from a tensor's values, an unknown op on the way) is refused. A dynamic tensor
that grows anyway (a Concat that doubles) is stopped at run time by ONNX Runtime's arena
ceiling (runtimes/backends/run_guard.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adaptive_export.runtimes.manifest import ModelDims

SIZE_INPUTS = {"ConstantOfShape": (0,), "Expand": (1,), "Range": (0, 1, 2)}
_FIRST_INPUT_ONLY = frozenset({"Cast", "Squeeze", "Unsqueeze", "Reshape", "Slice", "Gather", "Identity", "Neg", "Abs"})
_SUM = frozenset({"Add", "Sub"})
_LARGEST = frozenset({"Concat", "Max", "Where"})
_MAX_WALK = 256  # producers followed back from one size input


SIZE_FACTOR = 4  # a size may be a few shapes added (P + T), never a product of them


def largest_dimension(model: ModelDims, max_len: int | None) -> int:
    """The largest dimension the bundle declares: what a `Shape` of any legitimate tensor holds at most."""
    intermediate = model.extra.get("intermediate_size")
    widest = max(
        max_len or 0,
        model.vocab_size,
        model.hidden_size,
        model.num_layers,
        model.num_heads * model.head_dim,
        intermediate if isinstance(intermediate, int) else 0,
    )
    return widest


class _Producers:
    """Where each value comes from: a node, an initializer or a Constant node's tensor."""

    def __init__(self, graph: Any) -> None:
        from onnx import numpy_helper

        self.nodes = {output: node for node in graph.node for output in node.output}
        self.constants: dict[str, np.ndarray] = {}
        for init in graph.initializer:
            if not len(init.external_data) and int(np.prod(init.dims, dtype=np.int64)) <= 64:
                self.constants[init.name] = numpy_helper.to_array(init)
        for node in graph.node:
            value = next((a.t for a in node.attribute if node.op_type == "Constant" and a.name == "value"), None)
            if value is not None and int(np.prod(value.dims, dtype=np.int64)) <= 64:
                self.constants[node.output[0]] = numpy_helper.to_array(value)


def _bound_of(name: str, producers: _Producers, dimension: int, budget: list[int]) -> float | None:
    """An upper bound of |values| of `name`, or None when it does not follow from shapes and constants."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    if name in producers.constants:
        values = producers.constants[name]
        return float(np.max(np.abs(values))) if values.size else 0.0
    node = producers.nodes.get(name)
    if node is None:
        return None  # a graph input's values (a token id, a length) never size a tensor
    if node.op_type == "Shape":
        return float(dimension)
    sources = node.input[:1] if node.op_type in _FIRST_INPUT_ONLY else list(node.input)
    if node.op_type == "Where":
        sources = node.input[1:]
    if node.op_type == "Div":  # only by a constant of magnitude >= 1, which cannot grow the value
        divisor = producers.constants.get(node.input[1])
        if divisor is None or divisor.size == 0 or float(np.min(np.abs(divisor))) < 1:
            return None
        sources = node.input[:1]
    bounds = [_bound_of(source, producers, dimension, budget) for source in sources if source]
    if not bounds or any(b is None for b in bounds):
        return None
    known = [b for b in bounds if b is not None]
    if node.op_type == "Min":
        return min(known)
    if node.op_type in _FIRST_INPUT_ONLY or node.op_type in _LARGEST or node.op_type == "Div":
        return max(known)
    if node.op_type in _SUM:
        return sum(known)
    if node.op_type == "Mul":
        return float(np.prod(known))
    return None


def check_shape_ops(graph: Any, model: ModelDims, max_len: int | None, refuse: Callable[[str], Exception]) -> None:
    """Refuse a shape-producing node whose sizes are not bounded by the graph's own shapes."""
    shape_nodes = [node for node in graph.node if node.op_type in SIZE_INPUTS]
    if not shape_nodes:
        return
    dimension = largest_dimension(model, max_len)
    producers, limit = _Producers(graph), SIZE_FACTOR * dimension
    for node in shape_nodes:
        for index in SIZE_INPUTS[node.op_type]:
            if index >= len(node.input):
                continue
            bound = _bound_of(node.input[index], producers, dimension, [_MAX_WALK])
            if bound is None or bound > limit:
                shown = "does not follow from the graph's shapes" if bound is None else f"may reach {bound:.3g}"
                raise refuse(f"{node.op_type} size input {node.input[index]!r} {shown} (at most {limit} allowed)")
        if node.op_type == "Range" and len(node.input) == 3:
            step = producers.constants.get(node.input[2])
            if step is None or step.size != 1 or abs(float(step.reshape(-1)[0])) < 1:
                raise refuse(f"Range step {node.input[2]!r} is not a constant of magnitude >= 1")
