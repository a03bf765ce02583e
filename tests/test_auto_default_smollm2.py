"""`run`'s default mode (auto) on a packaged model, one process per prompt as a user runs it (issue
#24), on the GGUF-exact bundle verified at accuracy 1 (conftest's trimmed_native_bundle), where a
verify pass reproduces plain steps: the default run must speculate, emit `--mode ar`'s tokens
(ties allowed), draft on a rewrite prompt, and stop drafting on a chat prompt where drafts do not
pay. On the accuracy-4 default build auto decodes plainly (tests/test_smollm2_native.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.gate import PROBE_EVERY
from tests.conftest import cli, needs_smollm2

pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.timeout(1800)]

TIE_MARGIN = 1e-3
NEW_TOKENS = 32
REWRITE = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."
CHAT = "What are three good habits for staying healthy?"


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


@pytest.mark.parametrize("prompt", [REWRITE, CHAT], ids=["rewrite", "chat"])
def test_default_run_speculates_with_plain_tokens(trimmed_native_bundle: Path, prompt: str) -> None:
    bundle = trimmed_native_bundle
    default = run_json(bundle, prompt)
    plain = run_json(bundle, prompt, "--mode", "ar")
    stats = default["stats"]
    # fails if the default run stops speculating on a packaged model
    assert stats["mode"] == "spec" and stats["gated"] and stats["draft_source"], stats
    assert plain["stats"]["mode"] == "ar"
    assert_same_or_tie(bundle, prompt, plain["tokens"], default["tokens"])
    drafting_rounds = stats["rounds"] - stats["rounds_without_drafting"]
    if prompt == REWRITE:
        assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
    elif stats["acceptance"] < 0.5:  # drafts that do not pay: drafting stops within a few rounds
        assert drafting_rounds <= 3 + stats["rounds"] // PROBE_EVERY, stats
