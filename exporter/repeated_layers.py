"""A plain graph of N alike layers, written from its traces over two and four (issue #40).

torch.export of the portable flavour costs about a second per decoder layer (two dynamic
dimensions: 32 s per SmolLM2 graph on Zen 4), so `check`'s cold rebuild was 6x its old time.
A trace of a uniform stack is a prefix, one block of nodes per layer and a suffix, and the
blocks differ only in their own layer's names (weights, past and new KV) and in which block they
read (their own, the one before, or the first: values the optimizer computes once). So the rebuild
traces the graph over layers 0-1 and 0-3 (3-5 s each), finds that decomposition (the fourth layer
tells reads of the first block from reads of the one before), proves it by writing both traces
again from it, and writes the N-layer graph. Its values get fresh names
(names compute nothing: exporter/check_structure.py compares graphs up to them), its weights
the names the full trace gives them. Anything that does not decompose returns None, and the
caller traces the whole graph.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import onnx

# names that carry a layer index: model weights ("model.layers.3.mlp.up_proj.weight", the
# graph's own "layers.3.input_norm.weight") and the KV inputs and outputs ("past_key_3")
_LAYER_NAMES = (re.compile(r"(?:^|(?<=\.))layers\.(\d+)\."), re.compile(r"^(?:past|new)_(?:key|value)_(\d+)$"))
TRACED_LAYERS = (2, 4)  # the short traces: 4 tells a block's reads of the first block from the previous one's
_TEMPLATE = 2  # the large trace's block that layers 1.. are written from


class NotRepeating(Exception):
    """The traces do not decompose into a prefix, identical blocks and a suffix."""


@dataclass(frozen=True)
class Layout:
    """Where a trace of `layers` layers puts its blocks: prefix [0, start), block k at
    start + k * size, suffix from start + layers * size."""

    layers: int
    start: int
    size: int

    def segment(self, node: int) -> tuple[str, int]:
        """("prefix", 0), ("block", k) or ("suffix", 0) for a node index."""
        if node < self.start:
            return "prefix", 0
        block = (node - self.start) // self.size
        return ("block", block) if block < self.layers else ("suffix", 0)

    def block_start(self, block: int) -> int:
        return self.start + block * self.size


def layer_name(name: str) -> tuple[str, int] | None:
    """(the name with its layer index as "{}", the index), or None for a name without one."""
    for pattern in _LAYER_NAMES:
        found = pattern.search(name)
        if found is not None:
            start, end = found.span(1)
            return name[:start].replace("{", "{{") + "{}" + name[end:].replace("}", "}}"), int(found.group(1))
    return None


class GraphNames:
    """A graph's name table: which node output, graph input or output, or initializer each name
    is, and each inline constant's content key (cached: the decomposition search reads them often)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.producer = {out: (i, k) for i, n in enumerate(self.nodes) for k, out in enumerate(n.output) if out}
        self.inputs = {v.name for v in graph.input}
        self.input_types = {v.name: v.type.SerializeToString() for v in graph.input}
        self.outputs = {v.name for v in graph.output}
        self.initializers = {t.name: t for t in graph.initializer}
        self._constants: dict[str, tuple[Any, ...]] = {}

    def constant_key(self, name: str) -> tuple[Any, ...]:
        """An inline initializer as what it holds: type, shape and the sha256 of its values."""
        if name not in self._constants:
            tensor = self.initializers[name]
            data = onnx.numpy_helper.to_array(tensor).tobytes()
            self._constants[name] = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(data).hexdigest())
        return self._constants[name]


class _Trace(GraphNames):
    """A traced graph's names, and which of its initializers are the model's weights."""

    def __init__(self, model: onnx.ModelProto, is_weight: Callable[[str], bool]) -> None:
        super().__init__(model)
        self.is_weight = is_weight


def reads_input_shape(node: onnx.NodeProto, input_types: dict[str, bytes]) -> bool:
    """Whether the node is a Shape of a graph input. Which input torch.export reads a shared
    dynamic dimension from (past_key_0 in one trace, past_value_6 in another) follows no rule we
    can write; every input of the same declared type, named dimensions included, has the same
    shape whenever the runtime feeds it, so such a read is compared by that type."""
    return node.op_type == "Shape" and node.domain == "" and len(node.input) == 1 and node.input[0] in input_types


def _relative_name(name: str, where: tuple[str, int], layout: Layout) -> tuple[Any, ...]:
    """A layer-indexed name relative to its place: a block's own layer, or the first or last."""
    found = layer_name(name)
    if found is None:
        return ("name", name)
    template, index = found
    kind, block = where
    if kind == "block":
        return ("own", template, index - block)
    if index == layout.layers - 1:
        return ("last", template)
    return ("absolute", template, index)


def _relative_ref(trace: _Trace, name: str, where: tuple[str, int], layout: Layout) -> tuple[Any, ...]:
    """What one node input reads, independent of value names and of how many layers there are."""
    if not name:
        return ("none",)
    if name in trace.producer:
        node, output = trace.producer[name]
        kind, block = layout.segment(node)
        if kind == "prefix":
            return ("prefix", node, output)
        if kind == "suffix":
            return ("suffix", node - layout.block_start(layout.layers), output)
        offset = node - layout.block_start(block)
        reader = where[1] if where[0] == "block" else layout.layers
        if block == reader:
            return ("own block", offset, output)
        if block == 0:  # layer 1 cannot tell the first block from the one before
            return ("first block", offset, output) if reader > 1 else ("first or previous block", offset, output)
        return ("block back", reader - block, offset, output)
    if name in trace.inputs:
        return ("input", _relative_name(name, where, layout))
    if name in trace.initializers:
        if trace.is_weight(name):
            return ("weight", _relative_name(name, where, layout))
        return ("constant", trace.constant_key(name))
    raise NotRepeating(f"value {name!r} is read but never defined")


def _records(trace: _Trace, layout: Layout) -> list[tuple[Any, ...]]:
    """Each node as what it computes from what, in the layout's relative terms."""
    records = []
    for index, node in enumerate(trace.nodes):
        where = layout.segment(index)
        inputs = tuple(_relative_ref(trace, name, where, layout) for name in node.input)
        if reads_input_shape(node, trace.input_types):
            inputs = (("shape of", trace.input_types[node.input[0]]),)
        outputs = tuple(
            _relative_name(name, where, layout) if name in trace.outputs else ("value",) if name else ("none",)
            for name in node.output
        )
        attributes = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
        records.append((node.domain, node.op_type, attributes, inputs, outputs))
    return records


def find_layout(small: onnx.ModelProto, large: onnx.ModelProto, is_weight: Callable[[str], bool]) -> Layout:
    """The prefix length under which the short traces are the same prefix and first block, the
    same later blocks (layer 1's reads of the first block are also reads of the previous one) and
    the same suffix."""
    a, b = _Trace(small, is_weight), _Trace(large, is_weight)
    extra = TRACED_LAYERS[1] - TRACED_LAYERS[0]
    size, rest = divmod(len(b.nodes) - len(a.nodes), extra)
    if size <= 0 or rest:
        raise NotRepeating(f"the traces differ by {len(b.nodes) - len(a.nodes)} nodes, not {extra} equal blocks")
    for start in range(len(a.nodes) - TRACED_LAYERS[0] * size + 1):
        short, long = Layout(TRACED_LAYERS[0], start, size), Layout(TRACED_LAYERS[1], start, size)
        ra, rb = _records(a, short), _records(b, long)
        template = _block(rb, long, _TEMPLATE)
        second = [_as_layer_one(record) for record in template]
        if (
            ra[: short.block_start(1)] == rb[: long.block_start(1)]
            and all(_block(rb, long, k) == template for k in range(_TEMPLATE, long.layers))
            and _block(rb, long, 1) == second
            and _block(ra, short, 1) == second
            and ra[short.block_start(short.layers) :] == rb[long.block_start(long.layers) :]
        ):
            return long
    raise NotRepeating("no prefix length makes the blocks repeat")


def _block(records: list[tuple[Any, ...]], layout: Layout, block: int) -> list[tuple[Any, ...]]:
    return records[layout.block_start(block) : layout.block_start(block + 1)]


def _as_layer_one(record: tuple[Any, ...]) -> tuple[Any, ...]:
    """A later block's record as layer 1's: its first block is also the previous one."""
    domain, op, attributes, inputs, outputs = record
    first = ("first block", "block back")
    inputs = tuple(
        ("first or previous block", *ref[-2:]) if ref[0] in first and (ref[0] == "first block" or ref[1] == 1) else ref
        for ref in inputs
    )
    return domain, op, attributes, inputs, outputs


@dataclass(frozen=True)
class _Place:
    """Where a written node sits: in layer `layer`'s block, copied from the trace's block
    `template` (0 for layer 0, _TEMPLATE for the others), or (layer -1) in the prefix or suffix."""

    layer: int = -1
    template: int = -1


@dataclass
class _Writer:
    """Writes the N-layer graph from the large trace and its layout."""

    trace: _Trace
    layout: Layout
    layers: int
    weight_for: Callable[[str, onnx.TensorProto], onnx.TensorProto]

    def __post_init__(self) -> None:
        self.names: dict[tuple[int, int], str] = {}  # (written node, output) -> its value name
        self.weights: dict[str, onnx.TensorProto] = {}
        self.suffix = self.layout.start + self.layers * self.layout.size  # the written suffix's first node

    def plan(self) -> Iterator[tuple[int, _Place]]:
        """(node in the trace, where it is written), in the written graph's order."""
        layout = self.layout
        yield from ((node, _Place()) for node in range(layout.start))
        for layer in range(self.layers):
            template = _TEMPLATE if layer else 0
            for offset in range(layout.size):
                yield layout.block_start(template) + offset, _Place(layer, template)
        yield from ((node, _Place()) for node in range(layout.block_start(layout.layers), len(self.trace.nodes)))

    def write(self) -> list[onnx.NodeProto]:
        nodes = []
        for written, (source, place) in enumerate(self.plan()):
            node = onnx.NodeProto()
            node.CopyFrom(self.trace.nodes[source])
            del node.metadata_props[:]
            node.name = f"n{written}_{node.op_type}"
            node.input[:] = [self._input(name, place) for name in node.input]
            node.output[:] = [self._output(name, place, written, k) for k, name in enumerate(node.output)]
            nodes.append(node)
        return nodes

    def rename(self, name: str, place: _Place) -> str:
        """A layer-indexed name for its place in the written graph."""
        found = layer_name(name)
        if found is None:
            return name
        template, index = found
        if place.layer >= 0:
            return template.format(place.layer + index - place.template)
        return template.format(self.layers - 1) if index == self.layout.layers - 1 else name

    def _block_value(self, node: int, output: int, place: _Place) -> str:
        """A value of a block, read from the written graph: its own block's, the first block's, or
        the block as many layers back as in the trace."""
        layout = self.layout
        block = layout.segment(node)[1]
        reader, written = (place.template, place.layer) if place.layer >= 0 else (layout.layers, self.layers)
        layer = written if block == reader else 0 if block == 0 else written - (reader - block)
        if not 0 <= layer < self.layers:
            raise NotRepeating(f"a block reads layer {layer}'s values")
        return self.names[layout.start + layer * layout.size + node - layout.block_start(block), output]

    def _input(self, name: str, place: _Place) -> str:
        trace, layout = self.trace, self.layout
        if not name:
            return name
        if name in trace.producer:
            node, output = trace.producer[name]
            kind = layout.segment(node)[0]
            if kind == "prefix":
                return self.names[node, output]
            if kind == "suffix":
                return self.names[self.suffix + node - layout.block_start(layout.layers), output]
            return self._block_value(node, output, place)
        if name in trace.inputs:
            return self.rename(name, place)
        if name in trace.initializers and trace.is_weight(name):
            renamed = self.rename(name, place)
            if renamed not in self.weights:
                known = trace.initializers.get(renamed)
                template = trace.initializers[name]
                self.weights[renamed] = known if known is not None else self.weight_for(renamed, template)
            return renamed
        return name  # a constant: the trace's own initializer, shared

    def _output(self, name: str, place: _Place, written: int, output: int) -> str:
        if not name:
            return name
        renamed = self.rename(name, place) if name in self.trace.outputs else f"v{written}_{output}"
        self.names[written, output] = renamed
        return renamed


def _interface(values: Sequence[onnx.ValueInfoProto], layers: int, traced: int) -> list[onnx.ValueInfoProto]:
    """Graph inputs or outputs for `layers` layers: each run of one layer-indexed name over the
    traced layers becomes a run over all of them, typed as the trace's layer 1."""
    out: list[onnx.ValueInfoProto] = []
    index = 0
    while index < len(values):
        found = layer_name(values[index].name)
        if found is None:
            out.append(values[index])
            index += 1
            continue
        template = found[0]
        run = [v for v in values[index : index + traced]]
        if [layer_name(v.name) for v in run] != [(template, k) for k in range(traced)]:
            raise NotRepeating(f"graph values {[v.name for v in run]} are no run over the layers")
        model = bare_value(run[1])
        if any(bare_value(v).type != model.type for v in run):
            raise NotRepeating(f"the {template} values differ in type between layers")
        for layer in range(layers):
            value = onnx.ValueInfoProto()
            value.CopyFrom(model)
            value.name = template.format(layer)
            out.append(value)
        index += traced
    return out


def bare_value(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """A graph input or output without its metadata (which names the tracer's node: no meaning)."""
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    del copy.metadata_props[:]
    return copy


def write_layers(
    small: onnx.ModelProto,
    large: onnx.ModelProto,
    layers: int,
    is_weight: Callable[[str], bool],
    weight_for: Callable[[str, onnx.TensorProto], onnx.TensorProto],
) -> onnx.ModelProto:
    """The `layers`-layer graph from the short traces `small` and `large` (TRACED_LAYERS).

    `is_weight` says which initializer names are the model's (compared by name; the others are
    constants, compared by content); `weight_for(name, template)` gives a weight the large trace
    lacks, from the same tensor of the template's layer. Raises NotRepeating where the traces do not
    decompose or either is not written back exactly from the decomposition."""
    layout = find_layout(small, large, is_weight)
    for traced, model in zip(TRACED_LAYERS, (small, large)):
        again = _write(large, layout, traced, is_weight, weight_for)
        if _records(_Trace(again, is_weight), replace(layout, layers=traced)) != _records(
            _Trace(model, is_weight), replace(layout, layers=traced)
        ):
            raise NotRepeating(f"the {traced}-layer trace is not written back from its decomposition")
    return _write(large, layout, layers, is_weight, weight_for)


def _write(
    large: onnx.ModelProto,
    layout: Layout,
    layers: int,
    is_weight: Callable[[str], bool],
    weight_for: Callable[[str, onnx.TensorProto], onnx.TensorProto],
) -> onnx.ModelProto:
    trace = _Trace(large, is_weight)
    writer = _Writer(trace, layout, layers, weight_for)
    nodes = writer.write()
    graph = large.graph
    constants = [t for t in graph.initializer if not is_weight(t.name)]
    order = {t.name: position for position, t in enumerate(graph.initializer)}

    def traced_order(name: str) -> tuple[int, int]:  # the trace's: layer by layer, then the rest
        found = layer_name(name)
        if found is None:
            return layers, order.get(name, len(order))
        return found[1], order.get(found[0].format(0), len(order))

    written = onnx.helper.make_graph(
        nodes,
        graph.name,
        _interface(graph.input, layers, layout.layers),
        _interface(graph.output, layers, layout.layers),
        initializer=[*sorted(writer.weights.values(), key=lambda t: traced_order(t.name)), *constants],
    )
    model = onnx.ModelProto()
    model.CopyFrom(large)
    model.graph.CopyFrom(written)
    return model
