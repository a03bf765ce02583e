"""Fast by default on the bundle a user deploys (issue #24): SmolLM2's default build (GGUF-exact,
accuracy 4) with `--speculate auto` on a two-prompt calibration set, run one process per prompt
as a user would. The default run (`--mode auto`) must speculate, emit `--mode ar`'s tokens (ties
allowed), draft on a rewrite prompt, and stop drafting on a chat prompt where drafts do not pay."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.gate import PROBE_EVERY
from tests.conftest import build_smollm2, cli, needs_smollm2

pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.timeout(1800)]

TIE_MARGIN = 1e-3
NEW_TOKENS = 32
REWRITE = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."
CHAT = "What are three good habits for staying healthy?"
CALIB_PROMPTS = [REWRITE, CHAT]


@pytest.fixture(scope="module")
def default_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default build plus the cheapest calibration the CLI allows (two prompts)."""
    calib = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CALIB_PROMPTS))
    return build_smollm2(
        tmp_path_factory, "smol-default", "--max-len", "512", "--speculate", "auto", "--calib", str(calib)
    )


def run_json(bundle: Path, prompt: str, *flags: str) -> dict:
    proc = cli("run", str(bundle), "-p", prompt, "--max-new-tokens", str(NEW_TOKENS), "--json", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def assert_same_or_tie(bundle: Path, prompt: str, ar: list[int], auto: list[int]) -> None:
    """Equal, or different only from a position where plain decoding's top-1/top-2 margin < 1e-3."""
    if ar == auto:
        return
    at = next((i for i, (a, b) in enumerate(zip(ar, auto)) if a != b), min(len(ar), len(auto)))
    generator = Generator(bundle)
    ids = generator.codec.encode(prompt) + ar[:at]
    out = generator.backend.run("prefill", np.asarray([ids]), generator.arena, 0)
    top2 = np.sort(out.logits[0, -1])[-2:]
    assert top2[1] - top2[0] < TIE_MARGIN, f"real mismatch at {at}: margin {top2[1] - top2[0]}"


def test_default_bundle_verifies_at_its_own_accuracy(default_bundle: Path) -> None:
    manifest = json.loads((default_bundle / "manifest.json").read_text())
    onnx = manifest["backends"]["onnx"]
    assert onnx["quantize"] == "native" and onnx["quant_options"]["accuracy_level"] == 4  # the default build
    speculation = json.loads((default_bundle / "calibration.json").read_text())["speculation"]
    costs = speculation["verify_cost"]["cost"]
    assert speculation["verify_cost"]["engine"] == manifest["configs"][0]["engines"]["decode"]
    assert set(costs) == {str(k) for k in range(1, 9)} and all(c > 0 for c in costs.values())


@pytest.mark.parametrize("prompt", [REWRITE, CHAT], ids=["rewrite", "chat"])
def test_default_run_speculates_with_plain_tokens(default_bundle: Path, prompt: str) -> None:
    default = run_json(default_bundle, prompt)
    plain = run_json(default_bundle, prompt, "--mode", "ar")
    stats = default["stats"]
    # fails if the default run stops speculating on a packaged model
    assert stats["mode"] == "spec" and stats["gated"] and stats["draft_source"], stats
    assert plain["stats"]["mode"] == "ar"
    assert_same_or_tie(default_bundle, prompt, plain["tokens"], default["tokens"])
    drafting_rounds = stats["rounds"] - stats["rounds_without_drafting"]
    if prompt == REWRITE:
        assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
    elif stats["acceptance"] < 0.5:  # drafts that do not pay: drafting stops within a few rounds
        assert drafting_rounds <= 3 + stats["rounds"] // PROBE_EVERY, stats
