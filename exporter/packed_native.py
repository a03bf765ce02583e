"""GGUF-exact quantization, rows as stored: every quantized linear reads the GGUF's own bytes.

The `packed` weight form of `--quantize native` bundles (`--native-form packed`). Where
exporter/native_quant.py re-expresses each GGUF tensor as MatMulNBits' codes, scales and block-sum
corrections, this form keeps the file's rows verbatim (uint8 [N, row_bytes]) and hands them to
the project's op library (runtimes/packed_ops.py, domain ai.adaptive_export):

* a linear becomes `MatMulPacked(x, rows)`, one node per run of equal ggml types within a
  stacked linear (Gemma's q/k/v: Q5_0, Q5_0, Q8_0) joined by a Concat on the last axis;
* the embedding Gather becomes `GatherPacked(rows, ids)`; a tied table is ONE initializer,
  `token_embd.packed`, read by the gather and by the LM head;
* transformers' row order (llama's q/k permutation) is applied to whole rows.

At accuracy level 1 the kernel multiplies fp32 activations by the exactly dequantized weights
(gguf.quants.dequantize, bit for bit), at 4 by int8 activations per block. There are no block
sums, corrections or float copies of 8-bit tables: the engines hold the GGUF's bytes and nothing
else for these weights.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from adaptive_export.exporter.gguf_native import _linear_shape, _tensor, unique_initializers
from adaptive_export.exporter.native_quant import EMBEDDING, Emit, NativeWeights, embedding_gather, linear_target
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.packed_ops import ACCURACY_LEVELS, PACKED_DOMAIN, PACKED_OPSET, TYPE_IDS

Runs = tuple[list[tuple[str, int, int]], int]  # ([(initializer, ggml type id, rows N)], K)


def unpacked_types(weights: NativeWeights) -> list[str]:
    """The GGUF types among the bundle's quantized tensors that the op library does not read (Q5_1)."""
    return sorted({t for types in weights.types.values() for t in types if t not in TYPE_IDS})


def check_packed_types(weights: NativeWeights) -> None:
    """Refuse, in one line, a GGUF whose quantized tensors use a type the op library does not read."""
    missing = unpacked_types(weights)
    if missing:
        pairs = ((g, t) for name, names in weights.sources.items() for g, t in zip(names, weights.types[name]))
        tensor = next(g for g, t in pairs if t == missing[0])
        readable = ", ".join(TYPE_IDS)
        raise UsageError(
            f"GGUF tensor {tensor!r} is {missing[0]}, which --native-form packed does not read (it reads {readable})",
            "build with --native-form nbits (or auto), which converts it to MatMulNBits",
        )


def packed_names(prefix: str, runs: int) -> list[str]:
    """The rows' initializer names of one linear: `{prefix}.packed`, or `{prefix}.packed_{i}` per run."""
    return [f"{prefix}.packed"] if runs == 1 else [f"{prefix}.packed_{i}" for i in range(runs)]


def apply_packed(model: onnx.ModelProto, weights: NativeWeights, accuracy_level: int, emit: Emit | None = None) -> None:
    """Replace float linears (MatMul, the LM head's Gemm) and the embedding Gather with the
    project's ops over the GGUF's rows. `emit` sees each linear's new initializers as they are
    made and returns what to keep in their place (the lean build writes them out at once).
    Deterministic: the same graph and GGUF give the same nodes and initializer names."""
    if accuracy_level not in ACCURACY_LEVELS:
        raise UsageError(
            f"the packed weight form runs at accuracy level 1 or 4, not {accuracy_level}",
            "use --quant-accuracy 1 (fp32 activations, exact) or 4 (int8 activations)",
        )
    check_packed_types(weights)
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    made: dict[str, Runs] = {}  # prefix -> its runs, made once per graph
    uses: dict[str, int] = {}
    for node in model.graph.node:
        start = len(added)
        replaced = _replacement(node, weights, accuracy_level, made, uses, nodes, added)
        if not replaced:
            nodes.append(node)
        elif emit is not None and len(added) > start:
            added[start:] = emit(added[start:])
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(unique_initializers(keep + added))
    if any(node.domain == PACKED_DOMAIN for node in nodes) and not any(
        o.domain == PACKED_DOMAIN for o in model.opset_import
    ):
        model.opset_import.append(helper.make_opsetid(PACKED_DOMAIN, PACKED_OPSET))


def _rows(name: str, prefix: str, weights: NativeWeights, made: dict[str, Runs], added: list[onnx.TensorProto]) -> Runs:
    """One weight's runs and K; its initializers are added on its first use in the graph only
    (a tied table read by the gather and the LM head is converted and stored once)."""
    if prefix not in made:
        runs = weights.rows(name)
        names = packed_names(prefix, len(runs))
        added.extend(numpy_helper.from_array(data, init_name) for init_name, (_, data) in zip(names, runs))
        first = weights.sources[name][0]
        k = _linear_shape(_tensor(weights.reader, first), first)[0]
        made[prefix] = ([(n, TYPE_IDS[t], data.shape[0]) for n, (t, data) in zip(names, runs)], k)
    return made[prefix]


def _scope(uses: dict[str, int], key: str) -> str:
    """'' for a weight's first use in the graph, then '_2', '_3', ...: node names stay unique."""
    uses[key] = uses.get(key, 0) + 1
    return "" if uses[key] == 1 else f"_{uses[key]}"


def _replacement(
    node: onnx.NodeProto,
    weights: NativeWeights,
    accuracy_level: int,
    made: dict[str, Runs],
    uses: dict[str, int],
    nodes: list[onnx.NodeProto],
    added: list[onnx.TensorProto],
) -> bool:
    """Append the packed form of `node` to nodes/added; False when the node stays as it is."""
    if embedding_gather(node, weights):
        runs, k = _rows(EMBEDDING, "token_embd", weights, made, added)
        if len(runs) != 1:
            raise ValueError("the embedding table is one GGUF tensor: one type")
        (table, type_id, _), scope = runs[0], _scope(uses, "token_embd/gather")
        nodes.append(
            helper.make_node(
                "GatherPacked",
                [table, node.input[1]],
                [node.output[0]],
                name=f"token_embd/gather{scope}/GatherPacked",
                domain=PACKED_DOMAIN,
                packed_type=type_id,
                K=k,
            )
        )
        return True
    target = linear_target(node, weights)
    if target is None:
        return False
    x, name = target
    prefix = "token_embd" if name == EMBEDDING else name
    runs, k = _rows(name, prefix, weights, made, added)
    scope = _scope(uses, prefix)
    outputs = [node.output[0]] if len(runs) == 1 else [f"{prefix}/run_{i}{scope}" for i in range(len(runs))]
    for i, ((rows, type_id, n), out) in enumerate(zip(runs, outputs)):
        suffix = "" if len(runs) == 1 else f"_{i}"
        nodes.append(
            helper.make_node(
                "MatMulPacked",
                [x, rows],
                [out],
                name=f"{prefix}/MatMulPacked{suffix}{scope}",
                domain=PACKED_DOMAIN,
                packed_type=type_id,
                K=k,
                N=n,
                accuracy_level=accuracy_level,
            )
        )
    if len(runs) > 1:
        nodes.append(helper.make_node("Concat", outputs, [node.output[0]], name=f"{prefix}/Concat{scope}", axis=-1))
    return True
