"""benchmarks/draft_model_ceiling.py's pricing of draft-model rounds (issue #37 item 3): a round
accepts the run of teacher-forced hits from where it starts, up to k, and emits one token more."""

from __future__ import annotations

import pytest

from benchmarks.draft_model_ceiling import priced_rounds

DRAFT_MS = {1: 10.0, 2: 11.0}
TARGET_MS = {1: 30.0, 2: 33.0, 3: 36.0}


def test_a_draft_that_never_agrees_emits_one_token_a_round() -> None:
    per_round, ms = priced_rounds([[False] * 5], 1, DRAFT_MS, TARGET_MS)
    assert per_round == 1.0 and ms == pytest.approx(10.0 + 33.0)


def test_a_round_that_accepts_everything_reads_the_bonus_token_next() -> None:
    # k = 2 over six hits: two rounds of 2 accepted + 1; the second starts with a T=2 draft step
    per_round, ms = priced_rounds([[True] * 6], 2, DRAFT_MS, TARGET_MS)
    assert per_round == 3.0
    assert ms == pytest.approx(((10.0 + 10.0 + 36.0) + (11.0 + 10.0 + 36.0)) / 6)


def test_a_rejection_ends_the_round_and_the_last_round_stops_at_the_answer() -> None:
    # hit, miss, hit: round 1 accepts 1 and emits 2 (the miss is the target's token), round 2 the last
    per_round, ms = priced_rounds([[True, False, True]], 2, DRAFT_MS, TARGET_MS)
    assert per_round == 1.5 and ms == pytest.approx(2 * (10.0 + 10.0 + 36.0) / 3)
