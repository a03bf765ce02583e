"""TensorRT: the static parser-compatibility check runs everywhere; engines need TensorRT + a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from adaptive_export.commands.cli import main
from adaptive_export.exporter.trt_compat import check_bundle, check_model
from adaptive_export.runtimes import load_bundle


def test_every_portable_graph_is_tensorrt_parsable_and_fused_ones_are_not(
    tiny_model_dir: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    """TensorRT builds from the portable flavour; the fused ONNX Runtime graphs use contrib ops."""
    assert (
        main(["build", str(tiny_model_dir), "-o", str(tmp_path / "p"), "--max-len", "96", "--onnx-flavour", "portable"])
        == 0
    )
    bundle = load_bundle(tmp_path / "p")
    reports = check_bundle(bundle.root, bundle.manifest.backends["onnx"].to_json())
    assert len(reports) == len(bundle.manifest.graphs)
    for report in reports:
        assert report.ok, (report.graph, report.problems)
        assert "Gemm" in report.ops and "Softmax" in report.ops
    fused = load_bundle(tiny_bundle)
    assert fused.manifest.backends["onnx"].flavour == "ort"
    assert not any(r.ok for r in check_bundle(fused.root, fused.manifest.backends["onnx"].to_json()))


def test_unsupported_operator_and_custom_domain_are_reported() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph(
        [
            helper.make_node("Hardmax", ["x"], ["h"]),
            helper.make_node("MatMulNBits", ["h"], ["y"], domain="com.microsoft"),
        ],
        "bad",
        [x],
        [y],
    )
    report = check_model("bad", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert not report.ok
    assert any("Hardmax" in p for p in report.problems) and any(
        "com.microsoft::MatMulNBits" in p for p in report.problems
    )


def test_quantized_bundle_is_refused_for_tensorrt(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "build",
                str(tiny_model_dir),
                "-o",
                str(tmp_path / "q"),
                "--quantize",
                "int8",
                "--backend",
                "onnx,tensorrt",
            ]
        )
        == 2
    )
    assert "MatMulNBits" in capsys.readouterr().err


def test_build_records_tensorrt_profile_and_compat(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert (
        main(["build", str(tiny_model_dir), "-o", str(tmp_path / "t"), "--max-len", "96", "--backend", "onnx,tensorrt"])
        == 0
    )
    entry = json.loads((tmp_path / "t" / "manifest.json").read_text())["backends"]["tensorrt"]
    assert set(entry["graphs"]) == {"prefill", "decode_full"} and entry["precision"] == "fp16"
    assert entry["built_at_export"] == (importlib.util.find_spec("tensorrt") is not None)
    bundle = load_bundle(tmp_path / "t")  # the tensorrt entry's "weights" describes the refit; it is no file
    assert "tensorrt" in bundle.manifest.backends


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt") is None,
    reason="TensorRT is not installed (its PyPI packages download libraries from a host these machines cannot reach)",
)
def test_tensorrt_greedy_matches_onnx(tiny_model_dir: Path, tmp_path: Path) -> None:
    from adaptive_export.runtimes import Generator

    out = tmp_path / "trt"
    assert (
        main(
            [
                "build",
                str(tiny_model_dir),
                "-o",
                str(out),
                "--max-len",
                "96",
                "--backend",
                "onnx,tensorrt",
                "--trt-precision",
                "fp32",
            ]
        )
        == 0
    )
    reference = Generator(out).generate("The quick brown fox", mode="ar", max_new_tokens=8, raw=True).tokens
    assert (
        Generator(out, backend="tensorrt").generate("The quick brown fox", mode="ar", max_new_tokens=8, raw=True).tokens
        == reference
    )
