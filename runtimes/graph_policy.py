"""What an engine graph may contain, checked before any backend sees it.

Graphs are code: an ONNX file can loop (Loop, Scan, If), call functions, or read any
file through `external_data`. A bundle may come from an untrusted source, so an engine is
accepted only when it looks like what the exporter emits for its graph kind:

- every node's (domain, op_type) is in ALLOWED_OPS (no subgraph ops: attributes of type
  GRAPH/GRAPHS are refused whatever the op), no model-local functions, no training info,
  no sparse initializers;
- no tensor anywhere (initializers, Constant attributes) holds external data, except the
  initializers the runtime supplies itself from the bundle's weights file (the engine's
  `initializers` list in the manifest) whose `location` is that file's name; their ONNX
  dtype and shape must equal the weight table's, and their `offset` and `length` the table's
  byte range (the runtime binds the table's bytes: the engine's reference must name the same);
- shape-producing ops (ConstantOfShape, Expand, Range) take their sizes only from the graph's
  own shapes and small constants (runtimes/shape_policy.py);
- the project's ops over GGUF rows (domain ai.adaptive_export, version 1: MatMulPacked,
  GatherPacked) exactly as the exporter writes them: a ggml type the kernels read, rows that are
  a uint8 [N, row_bytes(type, K)] weight from the table, accuracy level 1 or 4, two inputs;
- graph inputs and outputs are exactly the manifest graph entry's `inputs` and
  `outputs`; element types and ranks (and the dimensions the manifest fixes: KV heads,
  head size, hidden size, vocabulary, layer count) follow IO_RULES, keyed by name prefix.

`checked_model_bytes` parses the bytes the caller read (and hashed) once, without loading
external data, and returns them for the backend to create its session from, so there is
no path for the backend to resolve and nothing changes between check and use.

To allow a new op or a new input: add it to ALLOWED_OPS or IO_RULES (one place each).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.bundle import Bundle, read_listed
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import BackendEntry, EngineEntry, GraphEntry, ModelDims
from adaptive_export.runtimes.packed_ops import (
    ACCURACY_LEVELS,
    GGML_TYPES,
    PACKED_DOMAIN,
    PACKED_OPS,
    PACKED_OPSET,
    row_bytes,
)
from adaptive_export.runtimes.shape_policy import check_shape_ops

# domain -> op types. "" is the default ONNX domain (also spelled "ai.onnx").
ALLOWED_OPS: dict[str, frozenset[str]] = {
    "": frozenset(
        {
            # emitted by exporter/onnx_export.py (torch.export, opset 18) for every graph kind
            "Add",
            "Cast",
            "Concat",
            "Cos",
            "Gather",
            "Gemm",
            "LessOrEqual",
            "MatMul",
            "Mul",
            "Neg",
            "Pow",
            "Range",
            "Reciprocal",
            "ReduceMean",
            "Reshape",
            "Shape",
            "Sigmoid",
            "Sin",
            "Slice",
            "Softmax",
            "Sqrt",
            "Squeeze",
            "Transpose",
            "Unsqueeze",
            "Where",
            # elementwise and shape ops the same decomposition emits for other Llama-family variants
            "Constant",
            "ConstantOfShape",
            "Div",
            "Equal",
            "Exp",
            "Expand",
            "Greater",
            "GreaterOrEqual",
            "Identity",
            "Less",
            "Max",
            "Min",
            "ReduceMax",
            "ReduceSum",
            "Split",
            "Sub",
            "Tanh",
            "Erf",
            "Not",
            "And",
            "Or",
            "Trilu",
            "Log",
            "Abs",
            # a draft source's guessing head (graphs/drafts/eagle.py): the row's choice, the head's choice
            "ArgMax",
            # the ONNX Runtime flavour (ORT registers it in the default domain)
            "SimplifiedLayerNormalization",
        }
    ),
    "com.microsoft": frozenset(
        {
            "MatMulNBits",  # exporter/quantize.py (int8 / int4)
            "GroupQueryAttention",
            "SkipSimplifiedLayerNormalization",
            "GatherBlockQuantized",
            "RotaryEmbedding",
            "SimplifiedLayerNormalization",
            "FastGelu",
        }
    ),
    # the project's ops over a GGUF's rows (--native-form packed; runtimes/packed_ops.py), each node
    # checked against the weight table below (_check_packed_nodes)
    PACKED_DOMAIN: PACKED_OPS,
}
_DOMAIN_ALIASES = {"ai.onnx": ""}

# ONNX TensorProto element types
FLOAT, INT32, INT64 = 1, 6, 7
_NAMES = {FLOAT: "float32", INT32: "int32", INT64: "int64"}
_ONNX_OF_DTYPE = {"<f4": 1, "<f2": 10, "|u1": 2, "|i1": 3, "<i8": 7, "<i4": 6, "<u2": 4}

# name prefix -> (allowed element types, allowed shapes). A shape is a tuple of: an int
# (that static size), a key of the dims dict below (the manifest's size), or None (any
# size, e.g. the dynamic T and P). An ONNX dim with a symbolic name matches anything; a
# static one must match. The first matching prefix wins, so list longer prefixes first.
IO_RULES: list[tuple[str, frozenset[int], tuple[tuple[Any, ...], ...]]] = [
    ("input_ids", frozenset({INT64, INT32}), ((1, None),)),
    ("exit_hidden", frozenset({FLOAT}), ((1, None, "hidden"),)),
    ("past_key_", frozenset({FLOAT}), ((None, "kv_heads", "head_dim"), (1, "kv_heads", "max_len", "head_dim"))),
    ("past_value_", frozenset({FLOAT}), ((None, "kv_heads", "head_dim"), (1, "kv_heads", "max_len", "head_dim"))),
    ("new_key_", frozenset({FLOAT}), ((None, "kv_heads", "head_dim"), (1, "kv_heads", None, "head_dim"))),
    ("new_value_", frozenset({FLOAT}), ((None, "kv_heads", "head_dim"), (1, "kv_heads", None, "head_dim"))),
    # the fused flavour binds each layer's whole [1, kv, max_len, hd] arena block as past and present
    ("present_key_", frozenset({FLOAT}), ((1, "kv_heads", "max_len", "head_dim"),)),
    ("present_value_", frozenset({FLOAT}), ((1, "kv_heads", "max_len", "head_dim"),)),
    ("logit_rows", frozenset({INT64}), ((None,),)),
    ("logits", frozenset({FLOAT}), ((1, "logit_rows", "vocab"),)),
    ("router_scores", frozenset({FLOAT}), (("layers",),)),
    ("guesses", frozenset({INT64}), ((1, "logit_rows"),)),
    ("seqlens_k", frozenset({INT32, INT64}), ((1,),)),
    ("total_sequence_length", frozenset({INT32, INT64}), ((), (1,))),
    ("last_n", frozenset({INT32, INT64}), ((), (1,))),
    ("attention_mask", frozenset({INT32, INT64}), ((1, None),)),
    ("position_ids", frozenset({INT32, INT64}), ((1, None),)),
]
_ALLOWED_ELEM_TYPES = frozenset({FLOAT, INT64, INT32})
# Sizes that must be static in the graph, not only compatible: a prefill engine (logits of the
# last row only) swapped for a decode engine (every row) must be refused before it runs.
_STATIC_KEYS = frozenset({"logit_rows"})


def _refuse(where: str, problem: str) -> UsageError:
    return UsageError(
        f"engine {where} is refused: {problem}",
        "rebuild the bundle with `adaptive-export build`; engines may only hold the ops and inputs the exporter emits",
    )


def io_rule(name: str) -> tuple[frozenset[int], tuple[tuple[Any, ...], ...]] | None:
    """(element types, shapes) an input or output of this name may have, or None if unknown."""
    for prefix, types, shapes in IO_RULES:
        if name == prefix or (prefix.endswith("_") and name.startswith(prefix) and name[len(prefix) :].isdigit()):
            return types, shapes
    return None


def _dims_of(graph_entry: GraphEntry, model: ModelDims, max_len: int | None) -> dict[str, int | None]:
    # fused ("ort") graphs choose their logit rows with the `logit_rows` input: dynamic for every kind
    fixed_rows = graph_entry.logits == "last" and graph_entry.flavour != "ort"
    return {
        "kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "hidden": model.hidden_size,
        "vocab": graph_entry.logits_width(model.vocab_size),
        "layers": len(graph_entry.layers),
        "max_len": max_len,
        "logit_rows": 1 if fixed_rows else None,
    }


def _check_value(where: str, value: Any, dims: dict[str, int | None]) -> None:
    rule = io_rule(value.name)
    if rule is None:
        raise _refuse(where, f"input/output {value.name!r} is not one the runtime knows (graph_policy.IO_RULES)")
    types, shapes = rule
    if not value.type.HasField("tensor_type"):
        raise _refuse(where, f"{value.name!r} is not a tensor")
    tensor = value.type.tensor_type
    if tensor.elem_type not in _ALLOWED_ELEM_TYPES or tensor.elem_type not in types:
        allowed = ", ".join(sorted(_NAMES[t] for t in types))
        raise _refuse(where, f"{value.name!r} has element type {tensor.elem_type}, expected {allowed}")
    if not tensor.HasField("shape"):
        raise _refuse(where, f"{value.name!r} has no shape")
    actual = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    for shape in shapes:
        if len(shape) != len(actual):
            continue
        expected = [dims.get(s) if isinstance(s, str) else s for s in shape]
        strict = [isinstance(s, str) and s in _STATIC_KEYS and e is not None for s, e in zip(shape, expected)]
        if any(st and a is None for st, a in zip(strict, actual)):
            continue
        if all(
            a is None or (e is not None and a == e) or (e is None and s is None)
            for a, e, s in zip(actual, expected, shape)
        ):
            # a static size where the runtime varies it (T, P, logits of every row) is refused too
            if all(not (e is None and a is not None) for a, e in zip(actual, expected)):
                return
    want = " or ".join(
        str([dims.get(s, s) if isinstance(s, str) else ("dynamic" if s is None else s) for s in shape])
        for shape in shapes
    )
    shown = ["dynamic" if a is None else a for a in actual]
    raise _refuse(where, f"{value.name!r} has shape {shown}, the manifest implies {want}")


def _tensors_in_attributes(node: Any) -> list[Any]:
    import onnx

    found = []
    for attribute in node.attribute:
        if (
            attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            or attribute.HasField("g")
            or len(attribute.graphs)
        ):
            raise ValueError(f"node {node.op_type!r} carries a subgraph (attribute {attribute.name!r})")
        if attribute.HasField("t"):
            found.append(attribute.t)
        found.extend(attribute.tensors)
        if attribute.HasField("sparse_tensor") or len(attribute.sparse_tensors):
            raise ValueError(f"node {node.op_type!r} carries a sparse tensor")
    return found


@dataclass(frozen=True)
class CheckedEngine:
    """An engine's policy-checked bytes and what the backend needs to know of them: the operator
    domains it imports (the packed ops' library is registered only for an engine importing theirs)
    and the weights only packed ops read (they read them in place: no prepacked copy)."""

    data: bytes
    domains: frozenset[str]
    packed_only: frozenset[str] = frozenset()

    @property
    def uses_packed_ops(self) -> bool:
        return PACKED_DOMAIN in self.domains


def checked_model(
    data: bytes,
    where: str,
    graph_entry: GraphEntry,
    engine_entry: EngineEntry,
    onnx_entry: BackendEntry,
    model: ModelDims,
    max_len: int | None = None,
) -> CheckedEngine:
    """Parse one engine's bytes (external data is never loaded), refuse anything outside the
    policy above, and return the bytes to create the session from with what they use."""
    proto = _parse(data, where)
    _check_ops(proto, where)
    check_shape_ops(proto.graph, model, max_len, lambda problem: _refuse(where, problem))
    _check_external_data(proto.graph, where, engine_entry, onnx_entry)
    packed_only = _check_packed_nodes(proto.graph, where, onnx_entry)
    _check_io(proto.graph, where, graph_entry, _dims_of(graph_entry, model, max_len))
    domains = frozenset(_DOMAIN_ALIASES.get(o.domain, o.domain) for o in proto.opset_import)
    if any(o.domain == PACKED_DOMAIN and o.version != PACKED_OPSET for o in proto.opset_import):
        raise _refuse(where, f"it imports {PACKED_DOMAIN!r} at a version other than {PACKED_OPSET}")
    return CheckedEngine(data, domains, packed_only)


def checked_model_bytes(
    data: bytes,
    where: str,
    graph_entry: GraphEntry,
    engine_entry: EngineEntry,
    onnx_entry: BackendEntry,
    model: ModelDims,
    max_len: int | None = None,
) -> bytes:
    """checked_model's bytes: the engine, refused unless it passes the policy above."""
    return checked_model(data, where, graph_entry, engine_entry, onnx_entry, model, max_len).data


# op type -> (input count, index of the rows input, the attributes it must carry)
_PACKED_SIGNATURES = {
    "MatMulPacked": (2, 1, ("packed_type", "K", "N", "accuracy_level")),
    "GatherPacked": (2, 0, ("packed_type", "K")),
}


def _check_packed_nodes(graph: Any, where: str, onnx_entry: BackendEntry) -> frozenset[str]:
    """Every MatMulPacked / GatherPacked node exactly as the exporter writes it: its ggml type one
    the kernels read, its rows a uint8 [N, row_bytes(type, K)] weight from the bundle's table, its
    accuracy level 1 or 4, its input count exact. Returns the weights only such nodes read."""
    import onnx
    from onnx import helper

    external = {init.name for init in graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL}
    rows_read: set[str] = set()
    other_reads: set[str] = set()
    for node in graph.node:
        if _DOMAIN_ALIASES.get(node.domain, node.domain) != PACKED_DOMAIN:
            other_reads.update(node.input)
            continue
        count, rows_at, needed = _PACKED_SIGNATURES[node.op_type]  # _check_ops allowed only these
        label = node.name or (node.output[0] if node.output else "?")
        name = f"{node.op_type} {label!r}"
        if len(node.input) != count or len(node.output) != 1 or not all(node.input):
            raise _refuse(
                where, f"{name} has {len(node.input)} inputs and {len(node.output)} outputs, expected {count} and 1"
            )
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        unknown = sorted(set(attributes) - set(needed))
        if unknown or any(not isinstance(attributes.get(a), int) for a in needed):
            problem = f"attribute {unknown[0]!r} is not one it takes" if unknown else "lacks an integer attribute"
            raise _refuse(where, f"{name}: {problem} (it takes {', '.join(needed)})")
        type_id, k = attributes["packed_type"], attributes["K"]
        if type_id not in GGML_TYPES:
            raise _refuse(where, f"{name} reads packed_type {type_id}, not a ggml type the kernels read")
        block = GGML_TYPES[type_id][1]
        if k <= 0 or k % block:
            raise _refuse(where, f"{name}: K={k} is not a positive multiple of {GGML_TYPES[type_id][0]}'s {block}")
        if node.op_type == "MatMulPacked" and attributes["accuracy_level"] not in ACCURACY_LEVELS:
            raise _refuse(where, f"{name} has accuracy_level {attributes['accuracy_level']}, not 1 or 4")
        rows = node.input[rows_at]
        meta = onnx_entry.tensors.get(rows)
        expected = [attributes["N"] if node.op_type == "MatMulPacked" else None, row_bytes(type_id, k)]
        if rows not in external or meta is None:
            raise _refuse(where, f"{name} reads rows {rows!r}, which are not a weight of the bundle's table")
        shape = list(meta.shape)
        if meta.dtype != "|u1" or len(shape) != 2 or any(e is not None and a != e for a, e in zip(shape, expected)):
            shown = [("N" if e is None else e) for e in expected]
            raise _refuse(where, f"{name} reads {rows!r} as uint8 {shown}, the weight table says {meta.dtype} {shape}")
        rows_read.add(rows)
        other_reads.update(n for i, n in enumerate(node.input) if i != rows_at)
    return frozenset(rows_read - other_reads)


def _parse(data: bytes, where: str) -> Any:
    import onnx
    from google.protobuf.message import DecodeError

    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise _refuse(where, f"it is not an ONNX model ({type(exc).__name__})") from None
    if not proto.graph.node or not proto.graph.output:
        raise _refuse(where, "it has no nodes or no outputs")
    if len(proto.functions):
        raise _refuse(where, "it defines model-local functions")
    if len(proto.training_info):
        raise _refuse(where, "it carries training graphs")
    return proto


def _check_ops(proto: Any, where: str) -> None:
    """Allowed ops only, no subgraphs, no sparse or external constants."""
    import onnx

    for opset in proto.opset_import:
        if _DOMAIN_ALIASES.get(opset.domain, opset.domain) not in ALLOWED_OPS:
            raise _refuse(where, f"it imports operator domain {opset.domain!r}")
    constants: list[Any] = []
    for node in proto.graph.node:
        domain = _DOMAIN_ALIASES.get(node.domain, node.domain)
        if node.op_type not in ALLOWED_OPS.get(domain, frozenset()):
            raise _refuse(where, f"op {node.op_type!r} of domain {node.domain or 'ai.onnx'!r} is not allowed")
        try:
            constants += _tensors_in_attributes(node)
        except ValueError as exc:
            raise _refuse(where, str(exc)) from None
    if len(proto.graph.sparse_initializer):
        raise _refuse(where, "it has sparse initializers")
    for tensor in constants:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.external_data):
            raise _refuse(where, "a constant refers to external data")


def _check_external_data(graph: Any, where: str, engine_entry: EngineEntry, onnx_entry: BackendEntry) -> None:
    """External data only for the weights the manifest supplies, from the weights file, typed as its table says."""
    import onnx

    supplied = set(engine_entry.initializers or ())
    weights_name = PurePosixPath(onnx_entry.weights or "").name
    external = set()
    for init in graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and not len(init.external_data):
            continue
        if init.name not in supplied:
            raise _refuse(where, f"initializer {init.name!r} refers to external data the runtime does not supply")
        info = {entry.key: entry.value for entry in init.external_data}
        if info.get("location") != weights_name:
            raise _refuse(
                where, f"initializer {init.name!r} refers to {info.get('location')!r}, not the bundle's weights file"
            )
        meta = onnx_entry.tensors[init.name]
        # the runtime binds the table's bytes (backends/onnxruntime_backend.py `_tensor`); the engine's own
        # reference must name the same bytes, or what a check reads from the engine is not what runs
        if (info.get("offset", "0"), info.get("length")) != (str(meta.offset), str(meta.bytes)):
            raise _refuse(
                where,
                f"initializer {init.name!r} refers to bytes {info.get('offset', '0')}+{info.get('length', '?')} of "
                f"the weights file, the weight table (what the runtime binds) to {meta.offset}+{meta.bytes}",
            )
        if _ONNX_OF_DTYPE[meta.dtype] != init.data_type or list(init.dims) != list(meta.shape):
            raise _refuse(
                where,
                f"initializer {init.name!r} is type {init.data_type} of shape {list(init.dims)}, "
                f"the weight table says {meta.dtype} of shape {list(meta.shape)}",
            )
        external.add(init.name)
    missing = supplied - external
    if missing:
        raise _refuse(
            where,
            f"the manifest supplies weight {sorted(missing)[0]!r}, which the graph does not take from the weights file",
        )


def _check_io(graph: Any, where: str, graph_entry: GraphEntry, dims: dict[str, int | None]) -> None:
    """Graph inputs and outputs exactly the manifest's, each as IO_RULES allows."""
    initializer_names = {init.name for init in graph.initializer}
    inputs = [value for value in graph.input if value.name not in initializer_names]
    if [v.name for v in inputs] != list(graph_entry.inputs):
        raise _refuse(
            where,
            f"its inputs {[v.name for v in inputs][:6]} differ from the manifest's {list(graph_entry.inputs)[:6]}",
        )
    if [v.name for v in graph.output] != list(graph_entry.outputs):
        raise _refuse(
            where,
            f"its outputs {[v.name for v in graph.output][:6]} differ from the manifest's "
            f"{list(graph_entry.outputs)[:6]}",
        )
    for value in [*inputs, *graph.output]:
        _check_value(where, value, dims)


def checked_engine_bytes(bundle: Bundle, graph: str, backend: str = "onnx") -> bytes:
    """The policy-checked bytes of `graph`'s engine in `bundle` (read once, hashed, checked)."""
    return checked_engine(bundle, graph, backend).data


def checked_engine(bundle: Bundle, graph: str, backend: str = "onnx") -> CheckedEngine:
    """`graph`'s engine in `bundle`, read once, hashed and checked, with the domains it uses."""
    entry = bundle.backend_entry(backend)
    engine = entry.engine(graph)
    if engine.file is None:
        raise UsageError(f"the {backend} backend has no engine file for graph {graph!r}", "rebuild the bundle")
    data = read_listed(bundle, engine.file, limits.MAX_ENGINE_BYTES)
    onnx_entry = bundle.backend_entry("onnx")
    return checked_model(data, repr(engine.file), bundle.graph(graph), engine, onnx_entry, bundle.model, bundle.max_len)
