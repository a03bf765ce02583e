"""`check` as a CI gate: passes on a good bundle, exits 1 naming the engine on a broken one."""
from __future__ import annotations

import hashlib
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from exporter.cli import main


def test_check_passes_and_writes_reports(tiny_bundle: Path, tmp_path: Path) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    assert main(["check", str(tiny_bundle), "--report", str(report), "--junit", str(junit)]) == 0
    data = json.loads(report.read_text())
    assert data["schema"] == "adaptive-export-check/1" and data["passed"]
    engines = {r["engine"] for r in data["results"] if r["check"] == "parity"}
    assert engines == set(json.loads((tiny_bundle / "manifest.json").read_text())["graphs"])
    suite = ET.parse(junit).getroot()
    assert int(suite.get("tests")) == len(data["results"]) and suite.get("failures") == "0"


def perturb_weight(bundle: Path, tensor: str) -> None:
    """A broken conversion, not a corrupt copy: change a weight and re-sign the manifest."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    meta = manifest["backends"]["onnx"]["tensors"][tensor]
    weights = bundle / manifest["backends"]["onnx"]["weights"]
    data = bytearray(weights.read_bytes())
    values = np.frombuffer(data, dtype=np.float32, count=meta["bytes"] // 4, offset=meta["offset"]).copy()
    values[:16] += 0.5
    data[meta["offset"]: meta["offset"] + 64] = values[:16].tobytes()
    weights.write_bytes(bytes(data))
    entry = manifest["files"][manifest["backends"]["onnx"]["weights"]]
    entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def test_broken_engine_fails_the_gate(tiny_bundle: Path, tmp_path: Path, capsys) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_bundle, broken)
    last_layer = json.loads((broken / "manifest.json").read_text())["model"]["num_layers"] - 1
    tensors = json.loads((broken / "manifest.json").read_text())["backends"]["onnx"]["tensors"]
    perturb_weight(broken, next(n for n in tensors if n.startswith(f"model.layers.{last_layer}.mlp.down_proj.weight")))
    report = tmp_path / "r.json"
    assert main(["check", str(broken), "--report", str(report), "--junit", str(tmp_path / "r.xml")]) == 1
    data = json.loads(report.read_text())
    failed = {r["engine"] for r in data["results"] if not r["passed"]}
    assert "decode_full" in failed and "prefill" in failed
    out = capsys.readouterr().out
    assert "FAIL onnx     decode_full" in out
