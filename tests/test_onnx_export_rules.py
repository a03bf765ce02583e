"""The optimizer rules the export leaves out (exporter/onnx_export.py SKIPPED_REWRITES) change no
graph: a bundle exported with onnxscript's whole default rule set has the same engines."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from adaptive_export.commands.cli import main
from adaptive_export.exporter import onnx_export
from tests.conftest import make_tiny_model


def engine_graphs(bundle: Path) -> dict[str, bytes]:
    """Each engine's graph (nodes, interface, initializer names and shapes), weights left out."""
    graphs = {}
    for path in sorted((bundle / "onnx").glob("*.onnx")):
        model = onnx.load(str(path), load_external_data=False)
        graphs[path.name] = model.graph.SerializeToString()
    assert graphs
    return graphs


@pytest.mark.parametrize("flavour", ["ort", "portable"])
def test_skipped_rewrites_change_no_graph(flavour: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2's form (the coder models'), with early-exit draft and verify engines."""
    model = make_tiny_model(tmp_path / "model", "qwen2_gqa", layers=2)
    flags = ["--max-len", "64", "--onnx-flavour", flavour, "--speculate", "1:1"]
    assert main(["build", str(model), "-o", str(tmp_path / "lean"), *flags]) == 0
    monkeypatch.setattr(onnx_export, "SKIPPED_REWRITES", ())
    assert main(["build", str(model), "-o", str(tmp_path / "whole"), *flags]) == 0
    assert engine_graphs(tmp_path / "lean") == engine_graphs(tmp_path / "whole")
