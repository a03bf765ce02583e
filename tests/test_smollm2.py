"""Integration on the real SmolLM2-135M-Instruct: build, run torch-free, check, greedy parity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_export.loading.prompts import read_prompts
from tests.conftest import cli, needs_smollm2
from tests.test_torch_free import BLOCKER

# the first test pays smol_bundle's build (minutes on 2 cores), then a 10-prompt check
pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).parents[1]


def test_bundle_size_and_graphs(smol_bundle: Path) -> None:
    manifest = json.loads((smol_bundle / "manifest.json").read_text())
    total = sum(f["bytes"] for f in manifest["files"].values())
    assert len(manifest["graphs"]) >= 2
    # the fp32 weights once (538 MB) plus the int8 precision draft's own copy (151 MB)
    assert manifest["backends"]["onnx"]["weight_bytes"] < 540e6 + 155e6
    assert total <= 1.1 * manifest["backends"]["onnx"]["weight_bytes"]


def test_check_passes_with_reports(smol_bundle: Path, tmp_path: Path) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    prompt_file = str(ROOT / "samples" / "eval_prompts.jsonl")
    proc = cli(
        "check",
        str(smol_bundle),
        "--model",
        "smollm2",
        "--report",
        str(report),
        "--junit",
        str(junit),
        "--prompts",
        prompt_file,
        "--new-tokens",
        "32",
    )
    assert report.is_file(), proc.stderr[-4000:]
    data = json.loads(report.read_text())
    assert proc.returncode == 0, [r for r in data["results"] if not r["passed"]]
    assert data["passed"] and data["summary"]["failed"] == 0
    greedy = [r for r in data["results"] if r["check"].startswith("greedy")]
    prompts = len(read_prompts(str(ROOT / "samples" / "eval_prompts.jsonl")))
    by_engine = {engine: sum(r["engine"] == engine for r in greedy) for engine in {r["engine"] for r in greedy}}
    # plain decoding and speculation with each draft source, each on every prompt
    assert by_engine == {
        "decode_full": prompts,
        "spec:full:early_exit": prompts,
        "spec:full:prompt_lookup": prompts,
        "spec:full:precision": prompts,
        "spec:full:prompt_tokens": prompts,
    }
    assert all("identical" in r["detail"] or "float tie" in r["detail"] for r in greedy)
    assert {"prefill", "decode_full", "draft_full_e24", "verify_full_e24", "pdraft_full_int8"} <= {
        r["engine"] for r in data["results"] if r["check"] == "parity"
    }
    draft_gate = next(r for r in data["results"] if r["engine"] == "pdraft_full_int8" and r["check"] == "quality[mean]")
    assert draft_gate["passed"] and 1.0 - draft_gate["max_abs"] >= 0.9, (
        draft_gate
    )  # the int8 draft's agreement with fp32
    assert junit.read_text().count("<testcase") == len(data["results"])


def test_run_json_without_torch(smol_bundle: Path) -> None:
    code = f"""
from adaptive_export.commands.cli import main
raise SystemExit(main(['run', {str(smol_bundle)!r}, '-p', 'What is the capital of France?',
                      '--max-new-tokens', '12', '--json']))
"""
    proc = subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    assert out["stats"]["new_tokens"] == len(out["tokens"]) and out["stats"]["tpot_ms"] > 0
