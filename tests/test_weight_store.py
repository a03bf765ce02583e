"""The weight store shares tensors across engines by content: a graph whose initializer names
are another graph's names shifted (a skip configuration renumbers the exporter's constants)
must still point every node at its own bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from adaptive_export.exporter.weights import WeightStore, externalize


def graph_of(tensors: dict[str, np.ndarray]) -> onnx.ModelProto:
    """y_<name> = x + <name> for every named [N] tensor."""
    inits = [numpy_helper.from_array(array, name) for name, array in tensors.items()]
    nodes = [helper.make_node("Add", ["x", name], [f"y_{name}"]) for name in tensors]
    n = len(next(iter(tensors.values())))
    outputs = [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [n]) for name in tensors]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])], outputs, inits)
    return helper.make_model(graph)


def wired_bytes(model: onnx.ModelProto, weights: Path) -> dict[str, np.ndarray]:
    """Each output's tensor as the engine reads it: the node's input name, then that initializer's bytes."""
    raw = weights.read_bytes()
    by_name = {}
    for init in model.graph.initializer:
        entry = {e.key: e.value for e in init.external_data}
        start, length = int(entry["offset"]), int(entry["length"])
        by_name[init.name] = np.frombuffer(raw[start : start + length], np.float32)
    return {node.output[0]: by_name[node.input[1]] for node in model.graph.node}


def test_shifted_names_keep_every_node_on_its_own_bytes(tmp_path: Path) -> None:
    a, b, c = (np.full(512, value, np.float32) for value in (1.0, 2.0, 3.0))
    first = graph_of({"add_81": a, "add_95": b, "add_109": c})
    second = graph_of({"add_95": a, "add_109": b, "add_123": c})  # the same bytes, names shifted by one
    with WeightStore(tmp_path / "weights.bin") as store:
        externalize(first, store, "weights.bin")
        externalize(second, store, "weights.bin")
    for model in (first, second):
        names = [init.name for init in model.graph.initializer]
        assert len(names) == len(set(names))
    got = wired_bytes(second, tmp_path / "weights.bin")
    assert [float(got[f"y_{name}"][0]) for name in ("add_95", "add_109", "add_123")] == [1.0, 2.0, 3.0]


def test_a_stored_name_that_another_graph_computes_is_moved_out_of_the_way(tmp_path: Path) -> None:
    """Gemma 3's adapted skip configuration: a constant stored as 'add_570' by the first engine,
    while the second engine's 'add_570' is a node output. Defining the name twice made ONNX Runtime
    refuse the engine ("Duplicate definition of name"); the computed value is renamed instead."""
    import onnxruntime as ort

    constant = np.full(512, 2.0, np.float32)
    first = graph_of({"add_570": constant})
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [512])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [512])
    nodes = [
        helper.make_node("Add", ["x", "x"], ["add_570"]),  # a computed value with the stored name
        helper.make_node("Mul", ["add_570", "scale"], ["y"]),  # scale has add_570's bytes
    ]
    second = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], [numpy_helper.from_array(constant, "scale")]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    with WeightStore(tmp_path / "weights.bin") as store:
        externalize(first, store, "weights.bin")
        externalize(second, store, "weights.bin")
    assert [init.name for init in second.graph.initializer] == ["add_570"]
    onnx.save(second, str(tmp_path / "second.onnx"))
    session = ort.InferenceSession(str(tmp_path / "second.onnx"), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": np.ones(512, np.float32)})
    assert np.array_equal(out, np.full(512, 4.0, np.float32))  # (1 + 1) * 2: each name on its own value
