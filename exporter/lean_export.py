"""The memory-lean export: graphs traced over FakeTensor weights, weights streamed from the file.

`build` of a .gguf into ONNX Runtime engines needs the model's fp32 weights only to trace the
graphs and to write weights.bin. Traced over FakeTensors (loading/lean_model.py), each graph's
large initializers arrive with a shape and no data; they become placeholders named after the
model parameter they are (by identity, not content: fakes have none), and `LazyWeights` reads
each from the file only if the bundle keeps it as floats. A GGUF-exact build replaces every
quantized linear with the file's blocks (exporter/native_quant.py), converted and written one
at a time, so no placeholder of a quantized tensor is ever read. Peak memory: torch, the
graph, and one tensor (measured in docs/quantization.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx

from adaptive_export.exporter.graph_cache import cacheable, graph_cache, trace_key
from adaptive_export.exporter.onnx_export import trace_graph
from adaptive_export.exporter.weights import rename_initializers
from adaptive_export.graphs.fused_graph import PackedWeights
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts
from adaptive_export.loading.gguf_weights import GGUFWeights
from adaptive_export.loading.lean_model import is_fake

log = logging.getLogger(__name__)

# the location a placeholder initializer names until its bytes are written to weights.bin
LAZY_LOCATION = "<lazy>"


@dataclass
class LazyWeights:
    """A placeholder's bytes, computed from the file when the bundle keeps the tensor as floats:
    a model parameter as transformers loads it, or a packed tensor (QKV, gate/up) stacked from them."""

    weights: GGUFWeights
    num_layers: int

    def __post_init__(self) -> None:
        self._packed = PackedWeights.sources(self.num_layers)

    def array(self, name: str) -> np.ndarray:
        if name in self._packed:  # PackedWeights' rule: the sources stacked along N, transposed
            stacked = np.concatenate([self.weights.array(n) for n in self._packed[name]], axis=0)
            return np.ascontiguousarray(stacked.T)
        return self.weights.array(name)


def fake_names(parts: ModelParts, packed: PackedWeights | None) -> dict[int, str]:
    """Each fake tensor's canonical name (what the weight store would name it by content)."""
    names: dict[int, str] = {}
    for name, tensor in parts.hf_model.named_parameters():
        names.setdefault(id(tensor), name)
    for name, tensor in packed.named() if packed is not None else ():
        names.setdefault(id(tensor), name)
    return names


def cached_lean_graph(
    parts: ModelParts,
    graph: GraphSpec,
    packed: PackedWeights | None,
    names: dict[int, str],
    max_len: int,
    repeat_layers: bool = False,
) -> onnx.ModelProto:
    """`export_lean_graph`, read from the graph cache where this machine traced the same graph
    before (exporter/graph_cache.py), written to it otherwise. With `repeat_layers` (check's
    rebuild), a cache miss on a uniform stack writes the graph from short traces instead."""
    cache = graph_cache() if cacheable(graph) else None
    key = trace_key(parts, graph, max_len) if cache is not None else ""
    model = cache.get(key) if cache is not None else None
    if model is None and repeat_layers:
        model = repeated_lean_graph(parts, graph, packed, names)
        if model is not None:
            return model  # not cached: the cache holds traces
    if model is None:
        model = export_lean_graph(parts, graph, packed, names)
        if cache is not None:
            cache.put(key, model)
    return model


def repeated_lean_graph(
    parts: ModelParts, graph: GraphSpec, packed: PackedWeights | None, names: dict[int, str]
) -> onnx.ModelProto | None:
    """The graph written from its traces over two and four layers (exporter/repeated_layers.py),
    or None where its layers are not alike or the traces do not repeat."""
    from adaptive_export.exporter.repeated_layers import TRACED_LAYERS, NotRepeating, write_layers
    from adaptive_export.graphs.architectures import architecture
    from adaptive_export.graphs.span_graph import SpanGraph

    arch, config = architecture(parts.spec.model_type), parts.hf_model.config
    alike = len({arch.layer_attention(config, i) for i in graph.layers}) == 1
    whole_stack = graph.layers == tuple(range(parts.spec.num_layers))
    if not (repeatable(graph) and alike and whole_stack and len(graph.layers) > TRACED_LAYERS[-1]):
        return None  # a stack no longer than the large trace is traced whole
    module = SpanGraph(parts, graph)
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    weights = set(names.values()) | set(tensors)

    def weight_for(name: str, template: onnx.TensorProto) -> onnx.TensorProto:
        """A weight of a layer the short traces lack: a placeholder like its template's, or the
        module's real tensor (a norm weight: small parameters are read for real)."""
        if template.data_location == onnx.TensorProto.EXTERNAL:
            if name not in weights:
                raise NotRepeating(f"{name!r} is no model weight")
            tensor = onnx.TensorProto()
            tensor.CopyFrom(template)
            tensor.name = name
            return tensor
        real = tensors.get(name)
        if real is None or is_fake(real):
            raise NotRepeating(f"{name!r} has no value in the graph's module")
        tensor = onnx.numpy_helper.from_array(real.detach().numpy(), name)
        if (tensor.data_type, list(tensor.dims)) != (template.data_type, list(template.dims)):
            raise NotRepeating(f"{name!r} differs in type or shape from its layer-1 template")
        return tensor

    short = [replace(graph, layers=tuple(range(n))) for n in TRACED_LAYERS]
    small, large = (export_lean_graph(parts, spec, packed, names) for spec in short)
    try:
        return write_layers(small, large, len(graph.layers), weights.__contains__, weight_for)
    except NotRepeating as reason:
        log.info("tracing all %d layers of %s: %s", len(graph.layers), graph.name, reason)
        return None


def repeatable(graph: GraphSpec) -> bool:
    """Portable graphs whose layers carry nothing but the model's own weights."""
    return graph.flavour == "portable" and not (graph.router_scores or graph.exit_adapter or graph.skip_adapters)


def export_lean_graph(
    parts: ModelParts, graph: GraphSpec, packed: PackedWeights | None, names: dict[int, str]
) -> onnx.ModelProto:
    """Trace over fake weights; each fake initializer becomes an external placeholder that names
    its parameter and records its size, so nothing reads it unless the bundle keeps it."""
    import onnx_ir as ir

    program = trace_graph(parts, graph, packed)
    renames: dict[str, str] = {}
    for value in list(program.model.graph.initializers.values()):
        tensor = getattr(value.const_value, "raw", None)
        if tensor is None or not is_fake(tensor):
            continue
        name = names.get(id(tensor))
        if name is None:
            raise ValueError(f"initializer {value.name!r} of graph {graph.name!r} is no model weight")
        nbytes = tensor.numel() * tensor.element_size()
        dtype = value.const_value.dtype
        value.const_value = ir.ExternalTensor(LAZY_LOCATION, 0, nbytes, dtype, shape=value.shape, name=name)
        renames[value.name] = name
    proto = ir.serde.serialize_model(program.model)
    rename_initializers(proto, renames)
    return proto


def placeholder_array(init: onnx.TensorProto, lazy: Any) -> np.ndarray:
    """A placeholder's bytes from the file, checked against the shape the graph traced."""
    array = lazy.array(init.name)
    if tuple(array.shape) != tuple(init.dims):
        raise ValueError(f"tensor {init.name!r} reads as {array.shape} from the file, the graph has {tuple(init.dims)}")
    return array
