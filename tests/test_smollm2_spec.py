"""SmolLM2 self-speculation is lossless on 50 prompts, for early exit and prompt lookup."""
from __future__ import annotations

from pathlib import Path

import pytest

from loading.prompts import read_prompts
from runtimes import Generator
from tests.conftest import needs_smollm2
from tests.test_speculative import assert_same_or_tie

pytestmark = [needs_smollm2, pytest.mark.slow]
ROOT = Path(__file__).parents[1]
NEW_TOKENS = 24


def test_speculation_is_lossless_on_50_prompts(smol_bundle: Path) -> None:
    prompts = read_prompts(str(ROOT / "samples" / "spec_prompts.jsonl"))
    assert len(prompts) >= 50
    generator = Generator(smol_bundle)
    stats = {"early_exit": [0, 0], "prompt_lookup": [0, 0]}
    identical = 0
    for prompt in prompts:
        ids = generator.codec.encode(prompt)
        ar = generator.generate(ids, max_new_tokens=NEW_TOKENS).tokens
        for draft in stats:
            result = generator.generate(ids, max_new_tokens=NEW_TOKENS, mode="spec", draft=draft)
            assert_same_or_tie(generator, ids, ar, result.tokens)
            identical += result.tokens == ar
            stats[draft][0] += result.stats.speculation["accepted"]
            stats[draft][1] += result.stats.speculation["drafted"]
    assert identical >= 2 * len(prompts) - 3  # ties are rare; more would hide a bug
    assert stats["early_exit"][1] > 0 and stats["prompt_lookup"][1] > 0
