"""CoreML: conversion runs for real on Linux; functions, I/O names and flexible shapes, and
weight sharing are verified from the package; prediction needs macOS and skips elsewhere."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

ct = pytest.importorskip("coremltools", reason="coremltools is not installed (pip install adaptive-export[coreml])")

from adaptive_export.commands.cli import main  # noqa: E402
from adaptive_export.runtimes import Generator  # noqa: E402


def package_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def coreml_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("coreml") / "bundle"
    assert main(["build", str(tiny_model_dir), "-o", str(out), "--max-len", "96", "--backend", "onnx,coreml"]) == 0
    return out


def test_package_holds_every_graph_as_a_function(coreml_bundle: Path) -> None:
    manifest = json.loads((coreml_bundle / "manifest.json").read_text())
    entry = manifest["backends"]["coreml"]
    spec = ct.utils.load_spec(str(coreml_bundle / entry["package"]))
    functions = {f.name: f for f in spec.description.functions}
    assert set(functions) == set(manifest["graphs"]) == set(entry["graphs"])
    assert spec.description.defaultFunctionName == "prefill"
    model = manifest["model"]
    for name, function in functions.items():
        graph = entry["graphs"][name]  # CoreML functions keep the portable I/O contract
        assert graph["inputs"][0] == manifest["graphs"][name]["inputs"][0]
        assert [i.name for i in function.input] == graph["inputs"]
        assert [o.name for o in function.output] == graph["outputs"]
        for tensor in function.input[1:]:  # KV prefixes: [P flexible from 0, kv heads, head dim]
            ranges = [(r.lowerBound, r.upperBound) for r in tensor.type.multiArrayType.shapeRange.sizeRanges]
            assert ranges == [(0, manifest["max_len"]), (model["num_kv_heads"],) * 2, (model["head_dim"],) * 2]
        tokens = function.input[0].type.multiArrayType.shapeRange.sizeRanges[1]
        assert (tokens.lowerBound, tokens.upperBound) == (1, manifest["max_len"])


def test_weights_are_shared_between_functions(coreml_bundle: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """A package with 2 functions is far smaller than two single-function packages."""
    from adaptive_export.exporter.coreml_compile import convert_graph
    from adaptive_export.graphs.span_graph import GraphSpec, ModelParts
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(tiny_model_dir))
    single = convert_graph(
        ct,
        ModelParts(loaded.hf_model, loaded.spec),
        GraphSpec("decode_full", "decode", tuple(range(loaded.spec.num_layers))),
        96,
        "float16",
    )
    single.save(str(tmp_path / "one.mlpackage"))
    one = package_bytes(tmp_path / "one.mlpackage")
    multi = package_bytes(coreml_bundle / "coreml" / "model.mlpackage")
    fp16_weights = sum(p.numel() for p in loaded.hf_model.parameters()) * 2
    assert multi < 1.35 * one, (multi, one)
    assert one > fp16_weights * 0.9  # the single package does hold one fp16 copy


def test_check_reports_coreml_as_converted_not_executed(
    coreml_bundle: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    report = tmp_path / "r.json"
    assert main(["check", str(coreml_bundle), "--model", str(tiny_model_dir), "--report", str(report)]) == 0
    results = [r for r in json.loads(report.read_text())["results"] if r["backend"] == "coreml"]
    assert results
    if platform.system() != "Darwin":
        assert all(not r["executed"] and "needs macOS" in r["detail"] for r in results)


@pytest.mark.skipif(platform.system() != "Darwin", reason="CoreML prediction needs macOS")
def test_coreml_greedy_matches_onnx(coreml_bundle: Path) -> None:
    onnx_tokens = Generator(coreml_bundle).generate("The quick brown fox", mode="ar", max_new_tokens=8, raw=True).tokens
    coreml_tokens = (
        Generator(coreml_bundle, backend="coreml")
        .generate("The quick brown fox", mode="ar", max_new_tokens=8, raw=True)
        .tokens
    )
    assert coreml_tokens == onnx_tokens


def test_run_coreml_off_macos_is_a_clear_error(coreml_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if platform.system() == "Darwin":
        pytest.skip("CoreML runs here")
    assert main(["run", str(coreml_bundle), "-p", "hi", "--backend", "coreml"]) == 2
    assert "cannot execute on this machine" in capsys.readouterr().err
