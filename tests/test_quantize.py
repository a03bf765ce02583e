"""Quantized bundles: MatMulNBits engines, weights still stored once, quality reported by check."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from adaptive_export.commands.cli import main


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("q") / "int8"
    assert main(["build", str(tiny_model_dir), "-o", str(out), "--max-len", "96", "--quantize", "int8"]) == 0
    return out


def test_int8_engines_share_one_copy_of_quantized_weights(int8_bundle: Path, tiny_bundle: Path) -> None:
    manifest = json.loads((int8_bundle / "manifest.json").read_text())
    fp32 = json.loads((tiny_bundle / "manifest.json").read_text())
    onnx_entry = manifest["backends"]["onnx"]
    assert manifest["dtype"] == "int8" and onnx_entry["quantize"] == "int8"
    assert onnx_entry["weight_bytes"] < 0.6 * fp32["backends"]["onnx"]["weight_bytes"]
    stored = sum(t["bytes"] for t in onnx_entry["tensors"].values())
    assert stored <= onnx_entry["weight_bytes"]  # every tensor once (padding aside)
    used = [set(g["initializers"]) for g in onnx_entry["graphs"].values()]
    assert len(used) == 2 and used[0] & used[1], "prefill and decode should refer to the same quantized tensors"
    for engine in onnx_entry["graphs"].values():
        model = onnx.load(str(int8_bundle / engine["file"]), load_external_data=False)
        ops = {n.op_type for n in model.graph.node}
        assert "MatMulNBits" in ops and "Gemm" not in ops


def test_check_reports_quality_for_quantized_bundle(int8_bundle: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "q.json"
    assert main(["check", str(int8_bundle), "--model", str(tiny_model_dir), "--report", str(report)]) == 0
    results = json.loads(report.read_text())["results"]
    per_prompt = [r for r in results if r["check"].startswith("quality[") and r["check"] != "quality[mean]"]
    gate = [r for r in results if r["check"] == "quality[mean]"]
    assert len(per_prompt) == 3 and all(
        "top-1 agreement" in r["detail"] and "perplexity" in r["detail"] for r in per_prompt
    )
    assert len(gate) == 1 and gate[0]["passed"] and "mean top-1 agreement" in gate[0]["detail"]


def test_int8_run_generates(int8_bundle: Path) -> None:
    from adaptive_export.runtimes import Generator

    result = Generator(int8_bundle).generate("The quick brown fox", mode="ar", max_new_tokens=6, raw=True)
    assert len(result.tokens) == 6 or result.stats.stop_reason == "eos"


def test_quantize_weights_touches_only_the_named_linears() -> None:
    """A guessing head's linears (a Gemm over its own weight) become 4-bit MatMulNBits; a MatMul and
    a Gemm over other weights (a GGUF-exact graph's fp32 corrections, say) stay exactly as they were,
    though MatMulNBitsQuantizer quantizes every MatMul it is not told to exclude."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from adaptive_export.exporter.quantize import quantize_weights

    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in (
        ("guess.w", (64, 64)), ("correction", (64, 64)), ("head", (32, 64)))}  # fmt: skip
    nodes = [
        helper.make_node("Gemm", ["x", "guess.w"], ["a"], name="guess_gemm", transB=1),
        helper.make_node("MatMul", ["a", "correction"], ["b"], name="correction_matmul"),
        helper.make_node("Gemm", ["b", "head"], ["y"], name="head_gemm", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
        [numpy_helper.from_array(w, n) for n, w in weights.items()],
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    quantize_weights(model, ["guess.w"], bits=4)
    ops = [(n.op_type, n.name) for n in model.graph.node]
    assert ops[0][0] == "MatMulNBits" and ops[1:] == [("MatMul", "correction_matmul"), ("Gemm", "head_gemm")], ops
    kept = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert np.array_equal(kept["correction"], weights["correction"]) and np.array_equal(kept["head"], weights["head"])
    x = rng.standard_normal((2, 64)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = (x @ weights["guess.w"].T) @ weights["correction"] @ weights["head"].T
    got = session.run(None, {"x": x})[0]
    relative = np.sqrt(np.mean((got - expected) ** 2) / np.mean(expected**2))
    assert 0.0 < relative < 0.2, relative  # 4-bit blocks of normal weights: close (about 0.1), not equal
