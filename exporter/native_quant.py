"""GGUF-exact quantization of the fused graphs: the file's own blocks, not a re-quantization.

A quantized GGUF (SmolLM2's Q4_1 linears and Q8_0 embedding, Gemma's Q4_K/Q5_0/Q6_K/Q8_0)
already holds the integers and scales the model was published with. `--quantize native`
hands exactly those to ONNX Runtime: every packed linear of graphs/fused_graph.py becomes
MatMulNBits over the file's blocks (exporter/gguf_native.py does the conversion, bit exact),
plus `blocksum(x) @ correction` where the format has mins; the tied embedding table is read
by GatherBlockQuantized from the same initializers as the LM head's MatMulNBits, so it is
stored once. The fp32 reference model is the same file dequantized, so at accuracy level 1
(fp32 activations) the engines compute what PyTorch computes, within float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from adaptive_export.exporter.gguf_native import (
    NativeLinear,
    NotQuantizedError,
    UnsupportedGGUFTypeError,
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

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclass
class NativeWeights:
    """Every linear of the fused graphs as the GGUF's own blocks, converted once per build."""

    linears: dict[str, NativeLinear] = field(default_factory=dict)  # graph initializer name -> blocks
    bits: set[int] = field(default_factory=set)

    @classmethod
    def from_gguf(cls, path: Path, spec: ModelSpec) -> NativeWeights:
        reader = MappedGGUF(path)  # the checked header's tensors, not gguf's reader (which parses every array)
        names = hf_to_gguf_tensor_names(spec.model_type, spec.num_layers, spec.tie_word_embeddings)
        wanted = dict(PackedWeights.sources(spec.num_layers))
        wanted[EMBEDDING] = [EMBEDDING]
        if not spec.tie_word_embeddings:
            wanted[LM_HEAD] = [LM_HEAD]
        out = cls()
        for packed, hf_names in wanted.items():
            gguf_names = [names[n] for n in hf_names]
            try:
                linear = native_linear(
                    reader, gguf_names, [transformers_row_permutation(reader, n) for n in gguf_names]
                )
            except NotQuantizedError:
                continue  # a float tensor in a quantized file stays float, as the file has it
            except UnsupportedGGUFTypeError as exc:
                raise UsageError(
                    f"GGUF tensor {gguf_names[0]!r} uses a format native quantization does not read: {exc}",
                    "build with --quantize int4 or int8 (re-quantization) or --quantize none",
                ) from exc
            out.linears[packed] = linear
            out.bits.add(linear.bits)
        if not out.linears:
            raise UsageError(
                f"{str(path)!r} holds no quantized tensors, so there is no native grid to keep",
                "build it with --quantize none, int8 or int4",
            )
        return out

    @property
    def dtype(self) -> str:
        """The manifest's precision label: the narrowest grid the linears use."""
        return "int4" if 4 in self.bits else "int8"


# ONNX Runtime 1.32 (CPU) has no fp32-activation kernel for 8-bit MatMulNBits: measured on a
# 576x1536 linear, 9.8 ms per call at accuracy 1 (it dequantizes every call) against 0.1 ms at
# accuracy 4. An 8-bit block without a min (Q8_0, Q5_0, Q6_K) is d * q, exact in fp32, so at
# accuracy 1 those tensors keep the float graph's weights, which are that dequantization.
SLOW_AT_ACCURACY_1 = 8


def apply_native(model: onnx.ModelProto, weights: NativeWeights, accuracy_level: int) -> None:
    """Replace float linears (MatMul, the LM head's Gemm) and the embedding Gather with the
    GGUF's blocks; one block-sum per activation serves every linear that reads it."""
    if accuracy_level == 1:
        weights = NativeWeights(
            {
                name: linear
                for name, linear in weights.linears.items()
                if not (linear.bits == SLOW_AT_ACCURACY_1 and linear.correction is None)
            },
            weights.bits,
        )
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    blocksums: dict[str, str] = {}
    for node in model.graph.node:
        replaced = _replacement(node, weights, accuracy_level, blocksums, nodes, added)
        if not replaced:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(unique_initializers(keep + added))


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _replacement(
    node: onnx.NodeProto,
    weights: NativeWeights,
    accuracy_level: int,
    blocksums: dict[str, str],
    nodes: list[onnx.NodeProto],
    added: list[onnx.TensorProto],
) -> bool:
    """Append the native form of `node` to nodes/added; False when the node stays as it is."""
    if (
        node.op_type == "Gather"
        and node.input[0] == EMBEDDING
        and EMBEDDING in weights.linears
        and _attrs(node).get("axis", 0) == 0
    ):
        new, inits = gather_block_quantized_nodes(
            node.input[1], node.output[0], "token_embd", weights.linears[EMBEDDING]
        )
        nodes.extend(new)
        added.extend(inits)
        return True
    if node.op_type == "MatMul" and node.input[1] in weights.linears:
        x, name = node.input[0], node.input[1]
    elif (
        node.op_type == "Gemm"
        and len(node.input) == 2
        and node.input[1] in (EMBEDDING, LM_HEAD)
        and _attrs(node) == {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 1}
    ):
        x, name = node.input[0], (LM_HEAD if node.input[1] == LM_HEAD and LM_HEAD in weights.linears else EMBEDDING)
        if name not in weights.linears:
            return False
    else:
        return False
    linear = weights.linears[name]
    prefix = "token_embd" if name == EMBEDDING else name
    blocksum = None
    if linear.correction is not None:
        blocksum = blocksums.get(x)
        if blocksum is None:
            blocksum = blocksums[x] = f"{x}/blocksum"
            new, inits = blocksum_nodes(x, blocksum, linear.k, f"{x}.blocksum")
            nodes.extend(new)
            added.extend(inits)
    new, inits = matmul_nbits_nodes(x, node.output[0], prefix, linear, accuracy_level, blocksum)
    nodes.extend(new)
    added.extend(inits)
    return True
