"""Weight-only quantization of exported graphs with ONNX Runtime's MatMulNBits quantizer.

The exporter emits linears as Gemm(x, W, transB=1) so fp32 graphs use the model's own
weights in place. ORT's quantizer handles MatMul with a constant [in, out] weight, so a
quantized build first rewrites those Gemms as MatMul(x, W^T) (+ bias). Quantization is
deterministic, so the same weight quantizes to the same bytes in every graph and the
content-addressed weight store still keeps one copy.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Container

import numpy as np
import onnx
from onnx import helper, numpy_helper

from adaptive_export.runtimes.errors import UsageError

QUANT_BITS = {"int8": 8, "int4": 4}


def gemm_to_matmul(model: onnx.ModelProto, weights: Container[str] | None = None) -> None:
    """Each plain Gemm over a constant weight as MatMul (+ Add), the form MatMulNBits quantizes;
    only those over `weights` where given."""
    inits = {i.name: i for i in model.graph.initializer}
    transposed: dict[str, str] = {}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
        chosen = weights is None or (len(node.input) > 1 and node.input[1] in weights)
        if node.op_type != "Gemm" or not plain or node.input[1] not in inits or not chosen:
            nodes.append(node)
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):
            if weight not in transposed:
                name = f"{weight}.T"
                array = np.ascontiguousarray(numpy_helper.to_array(inits[weight]).T)
                model.graph.initializer.append(numpy_helper.from_array(array, name))
                transposed[weight] = name
            weight = transposed[weight]
        has_bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}_matmul" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight], [product], name=f"{node.name}_MatMul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_Bias"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in model.graph.node for name in node.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


def validate_options(block_size: int, accuracy_level: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise UsageError(
            f"quantization block size {block_size} is not a power of two >= 16",
            "use --quant-block 32 (default), 64 or 128",
        )
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise UsageError(
            f"quantization accuracy level {accuracy_level} is not one of 0-4",
            "use --quant-accuracy 4 (int8 activations, fastest on CPU) or 0 (unset)",
        )


def quantize(model: onnx.ModelProto, scheme: str, block_size: int = 32, accuracy_level: int = 4) -> onnx.ModelProto:
    """Return `model` with every constant-weight MatMul as symmetric block-quantized MatMulNBits.

    Measured on SmolLM2 (docs/quantization.md): keeping the LM head at 8 bits in an int4 build gave the
    same top-1 agreement (0.731) at 25% slower decode, and asymmetric blocks did not help,
    so int4 quantizes everything symmetrically.
    """
    if scheme not in QUANT_BITS:
        raise UsageError(f"quantization {scheme!r} is unknown", f"choose one of: none, {', '.join(QUANT_BITS)}")
    validate_options(block_size, accuracy_level)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    gemm_to_matmul(model)
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=QUANT_BITS[scheme],
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=accuracy_level or None,
        op_types_to_quantize=("MatMul",),
    )
    quantizer.process()
    return quantizer.model.model


def quantize_weights(model: onnx.ModelProto, weights: Collection[str], bits: int, block_size: int = 32) -> None:
    """The linears over these float weights alone as symmetric block-quantized MatMulNBits at
    accuracy 4 (a lossless draft's own layers: their precision moves its acceptance, never the
    output), every other node and initializer left as it is."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    gemm_to_matmul(model, weights)
    names = {*weights, *(f"{w}.T" for w in weights)}  # gemm_to_matmul names a transposed weight <name>.T
    chosen = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1:2] and n.input[1] in names]
    if not chosen:
        return
    others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in chosen]
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    quantizer = MatMulNBitsQuantizer(  # it quantizes every MatMul it is not told to exclude
        model, bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=4, nodes_to_exclude=others,
        op_types_to_quantize=("MatMul",),
    )  # fmt: skip
    quantizer.process()
    if quantizer.model.model is not model:
        model.CopyFrom(quantizer.model.model)
