"""`check` as a CI gate: passes on a good bundle, exits 1 naming the engine on a broken one."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.commands.cli import main
from tests.conftest import cli


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
    data[meta["offset"] : meta["offset"] + 64] = values[:16].tobytes()
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


def _fake_reference(margin: float, diverge_at: int = 2):
    """reference_greedy stand-in: the runtime's own tokens, except one at `diverge_at`, where
    the reference's top-1/top-2 logit margin is `margin`."""

    def reference(parts, prompt_ids, new_tokens, eos_ids, kept, real=None):
        tokens, steps = real(parts, prompt_ids, new_tokens, eos_ids, kept)
        tokens, steps = list(tokens), list(steps)
        at = min(diverge_at, len(tokens) - 1)
        tokens[at] = (tokens[at] + 1) % 50
        row = np.zeros(64, dtype=np.float32)
        row[:2] = (1.0, 1.0 - margin)
        steps[at] = row
        return tokens, steps

    return reference


@pytest.mark.parametrize("margin,exit_code", [(0.5, 1), (1e-4, 0)])
def test_greedy_divergence_fails_the_gate_unless_it_is_a_float_tie(
    margin: float, exit_code: int, tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tie rule end to end: the same divergence fails `check` (exit 1, only the greedy
    checks) when the reference's margin is real, and passes when it is below TIE_MARGIN."""
    import adaptive_export.exporter.check as check

    monkeypatch.setattr(
        check, "reference_greedy", functools.partial(_fake_reference(margin), real=check.reference_greedy)
    )
    report = tmp_path / "r.json"
    assert main(["check", str(tiny_bundle), "--report", str(report), "--new-tokens", "4"]) == exit_code
    data = json.loads(report.read_text())
    greedy = [r for r in data["results"] if r["check"].startswith("greedy")]
    assert greedy and all(r["passed"] for r in data["results"] if r["check"] == "parity")
    assert all(r["passed"] == (exit_code == 0) for r in greedy)
    assert all(("a float tie" if exit_code == 0 else "a real mismatch") in r["detail"] for r in greedy)


def test_check_decodes_each_reference_once(tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain decoding and every draft source on a prompt compare against one reference decode:
    `check` asks reference_greedy once per (configuration, prompt), however many rows use it."""
    import adaptive_export.exporter.check as check

    real = check.reference_greedy
    decoded: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def counted(parts, prompt_ids, new_tokens, eos_ids, kept):
        decoded.append((tuple(kept), tuple(prompt_ids)))
        return real(parts, prompt_ids, new_tokens, eos_ids, kept)

    monkeypatch.setattr(check, "reference_greedy", counted)
    report = tmp_path / "r.json"
    assert main(["check", str(tiny_bundle), "--report", str(report), "--new-tokens", "4"]) == 0
    greedy = [r for r in json.loads(report.read_text())["results"] if r["check"].startswith("greedy")]
    configs = json.loads((tiny_bundle / "manifest.json").read_text())["configs"]
    assert len(decoded) == len(set(decoded)) == len(configs) * len(check.BUILTIN_PROMPTS)
    assert len(greedy) > len(decoded)  # plain decoding and prompt lookup share each reference


def test_check_prints_no_third_party_warnings(tiny_bundle: Path, tmp_path: Path) -> None:
    """`check` as a CI job runs it: its stderr carries progress and our own lines, never
    transformers' or torch's FutureWarning / UserWarning / deprecation chatter."""
    proc = cli("check", str(tiny_bundle), "--report", str(tmp_path / "r.json"), "--new-tokens", "4", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("passed, 0 failed")
    lines = proc.stderr.replace("\r", "\n").splitlines()
    assert not [line for line in lines if "Warning" in line], proc.stderr[-4000:]
