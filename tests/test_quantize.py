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
