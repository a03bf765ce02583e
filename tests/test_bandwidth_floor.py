"""benchmarks/bandwidth_floor.py's count of the bytes a decode pass reads (issue #36's floor): every
initializer a node reads whole, by its recorded external length, but not a table that only Gathers
read rows of, through a Reshape or directly."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from benchmarks.bandwidth_floor import engine_step_bytes


def _external(name: str, length: int) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.UINT8, dims=[length])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _graph(nodes: list, inits: list) -> object:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_graph(nodes, "g", [x], [y], inits)


def test_gathered_tables_are_left_out_and_read_weights_counted_by_their_length() -> None:
    inits = [
        _external("head.qweight", 1000),  # read whole by a matmul
        _external("embed.qweight", 5000),  # rows gathered
        _external("embed.scales", 700),  # reshaped, then rows gathered
        _external("unused", 99),
        numpy_helper.from_array(np.zeros(3, np.float32), "norm.weight"),  # inline, 12 bytes, read by a Mul
    ]
    nodes = [
        helper.make_node("MatMulNBits", ["x", "head.qweight"], ["h"], domain="com.microsoft"),
        helper.make_node("Gather", ["embed.qweight", "ids"], ["e"]),
        helper.make_node("Reshape", ["embed.scales", "shape"], ["s"]),
        helper.make_node("GatherBlockQuantized", ["e", "ids", "s"], ["g"]),
        helper.make_node("Mul", ["h", "norm.weight"], ["y"]),
    ]
    assert engine_step_bytes(_graph(nodes, inits)) == (1000 + 12, 2)


def test_a_table_both_gathered_and_multiplied_is_read_whole() -> None:
    # a tied embedding: the head's MatMulNBits reads the same blocks the Gather reads rows of
    inits = [_external("tied.qweight", 4000)]
    nodes = [
        helper.make_node("Gather", ["tied.qweight", "ids"], ["e"]),
        helper.make_node("MatMulNBits", ["x", "tied.qweight"], ["y"], domain="com.microsoft"),
    ]
    assert engine_step_bytes(_graph(nodes, inits)) == (4000, 1)


def test_gguf_rows_gathered_by_gather_packed_are_left_out_unless_the_head_reads_them() -> None:
    # --native-form packed: an untied table only gathered costs its rows; a tied one is read whole by the head
    untied = [_external("token_embd.packed", 3400), _external("lm_head.weight.packed", 2000)]
    nodes = [
        helper.make_node("GatherPacked", ["token_embd.packed", "ids"], ["e"], domain="ai.adaptive_export"),
        helper.make_node("MatMulPacked", ["x", "lm_head.weight.packed"], ["y"], domain="ai.adaptive_export"),
    ]
    assert engine_step_bytes(_graph(nodes, untied)) == (2000, 1)
    tied = [_external("token_embd.packed", 3400)]
    nodes[1] = helper.make_node("MatMulPacked", ["x", "token_embd.packed"], ["y"], domain="ai.adaptive_export")
    assert engine_step_bytes(_graph(nodes, tied)) == (3400, 1)
