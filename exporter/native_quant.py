"""GGUF-exact quantization of the fused graphs: the file's own blocks, not a re-quantization.

A quantized GGUF (SmolLM2's Q4_1 linears and Q8_0 embedding, Gemma's Q4_K/Q5_0/Q6_K/Q8_0)
already holds the integers and scales the model was published with. `--quantize native`
hands exactly those to ONNX Runtime: every packed linear of graphs/fused_graph.py becomes
MatMulNBits over the file's blocks (exporter/gguf_native.py does the conversion, bit exact),
plus `blocksum(x) @ correction` where the format has mins; the tied embedding table is read
by GatherBlockQuantized from the same initializers as the LM head's MatMulNBits, so it is
stored once. The fp32 reference model is the same file dequantized, so at accuracy level 1
(fp32 activations) the engines compute what PyTorch computes, within float rounding.
The other weight form, the file's rows as stored (`--native-form packed`), is
exporter/packed_native.py; both find the linears through `linear_target` / `embedding_gather`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from adaptive_export.exporter.gguf_native import (
    EIGHT_BIT_TYPES,
    FLOAT_TYPES,
    FOUR_BIT_TYPES,
    NativeLinear,
    _linear_shape,
    _tensor,
    blocksum_nodes,
    gather_block_quantized_nodes,
    hf_to_gguf_tensor_names,
    matmul_nbits_nodes,
    native_linear,
    transformers_row_permutation,
    unique_initializers,
)
from adaptive_export.graphs.fused_graph import PackedWeights
from adaptive_export.graphs.spec import ModelSpec
from adaptive_export.loading.gguf_tensors import MappedGGUF
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.packed_ops import TYPE_IDS, row_bytes

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


# GGUF types with a per-block min: their MatMulNBits form carries a correction term
TYPES_WITH_MIN = ("Q4_1", "Q4_K", "Q5_1", "Q5_K")


@dataclass
class NativeWeights:
    """Every quantized linear of the fused graphs as the GGUF's own blocks, converted when a graph
    asks for it (one linear at a time: a 1.5B model's blocks are 1 GB, its build's budget 3 GB).

    `sources` maps a graph initializer name to the GGUF tensors it stacks (quantized ones only);
    `types` gives their GGUF type names, from which bits and the accuracy-1 rule follow unconverted."""

    reader: Any
    sources: dict[str, list[str]] = field(default_factory=dict)
    types: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_gguf(cls, path: Path, spec: ModelSpec) -> NativeWeights:
        reader = MappedGGUF(path)  # the checked header's tensors, not gguf's reader (which parses every array)
        names = hf_to_gguf_tensor_names(spec.model_type, spec.num_layers, spec.tie_word_embeddings)
        wanted = dict(PackedWeights.sources(spec.num_layers))
        wanted[EMBEDDING] = [EMBEDDING]
        if not spec.tie_word_embeddings:
            wanted[LM_HEAD] = [LM_HEAD]
        kinds = {t.name: t.tensor_type.name for t in reader.tensors}
        out = cls(reader)
        for packed, hf_names in wanted.items():
            gguf_names = [names[n] for n in hf_names]
            types = tuple(kinds.get(n, "") for n in gguf_names)
            if any(t in FLOAT_TYPES for t in types):
                continue  # a float tensor in a quantized file stays float, as the file has it
            unsupported = [n for n, t in zip(gguf_names, types) if t not in FOUR_BIT_TYPES + EIGHT_BIT_TYPES]
            if unsupported:
                raise UsageError(
                    f"GGUF tensor {unsupported[0]!r} uses a format native quantization does not read "
                    f"({kinds.get(unsupported[0], 'missing')})",
                    "build with --quantize int4 or int8 (re-quantization) or --quantize none",
                )
            out.sources[packed], out.types[packed] = gguf_names, types
        if not out.sources:
            raise UsageError(
                f"{str(path)!r} holds no quantized tensors, so there is no native grid to keep",
                "build it with --quantize none, int8 or int4",
            )
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def linear(self, name: str) -> NativeLinear:
        """The blocks of one graph initializer, converted anew at each call (a tied table's two
        uses sit at the graph's two ends: keeping it would hold it while every layer converts)."""
        gguf_names = self.sources[name]
        permutations = [transformers_row_permutation(self.reader, n) for n in gguf_names]
        linear = native_linear(self.reader, gguf_names, permutations)
        for gguf_name in gguf_names:
            self.reader.release(gguf_name)
        return linear

    def rows(self, name: str) -> list[tuple[str, np.ndarray]]:
        """The GGUF's rows of one graph initializer as stored, uint8 [n, row_bytes]: one
        (type name, rows) per run of equal types among the tensors it stacks, transformers' row
        order applied to whole rows (llama's q/k), each read anew at each call like `linear`."""
        gguf_names, types = self.sources[name], self.types[name]
        runs: list[tuple[str, list[np.ndarray]]] = []
        for gguf_name, type_name in zip(gguf_names, types):
            tensor = _tensor(self.reader, gguf_name)
            k, n = _linear_shape(tensor, gguf_name)
            data = np.asarray(tensor.data).reshape(n, row_bytes(TYPE_IDS[type_name], k))
            permutation = transformers_row_permutation(self.reader, gguf_name)
            part = data[permutation] if permutation is not None else data
            if runs and runs[-1][0] == type_name:
                runs[-1][1].append(part)
            else:
                runs.append((type_name, [part]))
        out = [
            (type_name, np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0]))
            for type_name, parts in runs
        ]
        for gguf_name in gguf_names:
            self.reader.release(gguf_name)
        return out

    def bits_of(self, name: str) -> int:
        return 4 if all(t in FOUR_BIT_TYPES for t in self.types[name]) else 8

    def without_slow_at_accuracy_1(self) -> NativeWeights:
        """Accuracy 1 keeps the float weights of 8-bit blocks without a min (see SLOW_AT_ACCURACY_1)."""
        keep = [
            n
            for n, types in self.types.items()
            if not (self.bits_of(n) == SLOW_AT_ACCURACY_1 and not any(t in TYPES_WITH_MIN for t in types))
        ]
        return NativeWeights(self.reader, {n: self.sources[n] for n in keep}, {n: self.types[n] for n in keep})

    @property
    def bits(self) -> set[int]:
        return {self.bits_of(name) for name in self.sources}

    @property
    def dtype(self) -> str:
        """The manifest's precision label: the narrowest grid the linears use."""
        return "int4" if 4 in self.bits else "int8"


# ONNX Runtime 1.32 (CPU) has no fp32-activation kernel for 8-bit MatMulNBits: measured on a
# 576x1536 linear, 9.8 ms per call at accuracy 1 (it dequantizes every call) against 0.1 ms at
# accuracy 4. An 8-bit block without a min (Q8_0, Q5_0, Q6_K) is d * q, exact in fp32, so at
# accuracy 1 those tensors keep the float graph's weights, which are that dequantization.
SLOW_AT_ACCURACY_1 = 8

Emit = Callable[[list[onnx.TensorProto]], list[onnx.TensorProto]]


def apply_native(model: onnx.ModelProto, weights: NativeWeights, accuracy_level: int, emit: Emit | None = None) -> None:
    """Replace float linears (MatMul, the LM head's Gemm) and the embedding Gather with the
    GGUF's blocks; one block-sum per activation serves every linear that reads it. `emit` sees
    each linear's new initializers as they are made and returns what to keep in their place (the lean
    build writes them out at once and keeps external references)."""
    if accuracy_level == 1:
        weights = weights.without_slow_at_accuracy_1()
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    blocksums: dict[str, str] = {}
    sums = _Sums(blocksums, _ranks(model.graph))
    for node in model.graph.node:
        start = len(added)
        replaced = _replacement(node, weights, accuracy_level, sums, nodes, added)
        if not replaced:
            nodes.append(node)
        elif emit is not None:
            added[start:] = emit(added[start:])
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(unique_initializers(keep + added))


@dataclass(frozen=True)
class _Sums:
    """The block sums made so far (activation -> its sums) and the ranks the graph declares."""

    made: dict[str, str]
    ranks: dict[str, int]


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """Rank of every value whose shape the graph declares (the exporters write value_info)."""
    declared = list(graph.input) + list(graph.value_info) + list(graph.output)
    return {v.name: len(v.type.tensor_type.shape.dim) for v in declared if v.type.tensor_type.HasField("shape")}


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def linear_target(node: onnx.NodeProto, weights: NativeWeights) -> tuple[str, str] | None:
    """(activation, weight name) of a float linear the GGUF holds: a MatMul over one of `weights`,
    or the LM head's Gemm (x @ table^T) over the tied embedding or an untied lm_head; None otherwise.
    Both weight forms (MatMulNBits here, exporter/packed_native.py's rows) match nodes through this."""
    if node.op_type == "MatMul" and node.input[1] in weights:
        return node.input[0], node.input[1]
    if (
        node.op_type == "Gemm"
        and len(node.input) == 2
        and node.input[1] in (EMBEDDING, LM_HEAD)
        and _attrs(node) == {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 1}
    ):
        name = LM_HEAD if node.input[1] == LM_HEAD and LM_HEAD in weights else EMBEDDING
        return (node.input[0], name) if name in weights else None
    return None


def embedding_gather(node: onnx.NodeProto, weights: NativeWeights) -> bool:
    """Whether `node` gathers rows (axis 0) of the embedding table the GGUF holds quantized."""
    return (
        node.op_type == "Gather"
        and node.input[0] == EMBEDDING
        and EMBEDDING in weights
        and _attrs(node).get("axis", 0) == 0
    )


def _replacement(
    node: onnx.NodeProto,
    weights: NativeWeights,
    accuracy_level: int,
    sums: _Sums,
    nodes: list[onnx.NodeProto],
    added: list[onnx.TensorProto],
) -> bool:
    """Append the native form of `node` to nodes/added; False when the node stays as it is."""
    if embedding_gather(node, weights):
        earlier = sum(1 for done in nodes if done.op_type == "GatherBlockQuantized")  # the same table gathered before
        scope = f"gather_{earlier + 1}" if earlier else "gather"
        new, inits = gather_block_quantized_nodes(
            node.input[1], node.output[0], "token_embd", weights.linear(EMBEDDING), scope
        )
        nodes.extend(new)
        added.extend(inits)
        return True
    target = linear_target(node, weights)
    if target is None:
        return False
    x, name = target
    linear = weights.linear(name)
    prefix = "token_embd" if name == EMBEDDING else name
    blocksum = None
    if linear.correction is not None:
        blocksum = sums.made.get(x)
        if blocksum is None:
            blocksum = sums.made[x] = f"{x}/blocksum"
            rank = 2 if node.op_type == "Gemm" else sums.ranks.get(x)
            new, inits = blocksum_nodes(x, blocksum, linear.k, f"{x}.blocksum", rank)
            nodes.extend(new)
            added.extend(inits)
    new, inits = matmul_nbits_nodes(x, node.output[0], prefix, linear, accuracy_level, blocksum)
    nodes.extend(new)
    added.extend(inits)
    return True
