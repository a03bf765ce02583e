"""The drafting gate on its own (runtimes/gate.py): fed round times and emitted tokens, no
bundle, no engine. It drafts while a drafting round's seconds per token beat a plain step's."""

from __future__ import annotations

import pytest

from adaptive_export.runtimes.gate import PLAIN_EVERY, PROBE_EVERY, DraftingGate


def timed_gate(plain_s: float, draft_round_s: float, emitted: int, round_passes: float = 1.3) -> DraftingGate:
    """A gate that has seen two rounds of each kind (each kind's first one is a warm-up)."""
    gate = DraftingGate(round_passes)
    for _ in range(2):
        gate.record_round(False, 1, plain_s)
        gate.record_round(True, emitted, draft_round_s)
    return gate


def test_before_timing_it_prices_rounds_with_the_build_costs() -> None:
    gate = DraftingGate(round_passes=2.5)
    assert not gate.would_pay(2.0) and gate.would_pay(2.5) and gate.would_pay(3.0)
    assert gate.timed_plain_ms() is None and gate.timed_draft_ms_per_token() is None


def test_first_round_of_each_kind_is_not_timed() -> None:
    gate = DraftingGate(round_passes=1.3)
    gate.record_round(False, 1, 5.0)  # a first plain round may create sessions
    assert gate.plain_s is None
    gate.record_round(False, 1, 0.010)
    assert gate.plain_s == pytest.approx(0.010)
    gate.record_round(True, 3, 5.0)
    assert gate.draft_round_s is None and gate.mean_emitted == 3  # tokens count from the first round
    gate.record_round(True, 3, 0.020)
    assert gate.timed_plain_ms() == 10.0 and gate.timed_draft_ms_per_token() == pytest.approx(6.667)


def test_measured_times_decide_whatever_the_build_claimed() -> None:
    cheap = timed_gate(plain_s=0.010, draft_round_s=0.020, emitted=3, round_passes=100.0)
    assert cheap.pays() and cheap.would_pay(2.5) and not cheap.would_pay(2.0)  # 20 ms / 2 tokens = a plain step
    dear = timed_gate(plain_s=0.010, draft_round_s=0.050, emitted=3, round_passes=1.0)
    assert not dear.pays()


def test_paying_gate_drafts_and_retimes_plain_steps_every_plain_every_rounds() -> None:
    gate = timed_gate(plain_s=0.010, draft_round_s=0.012, emitted=3)
    decisions = [gate.should_draft() for _ in range(3 * (PLAIN_EVERY + 1))]
    assert decisions.count(False) == 3 and gate.skipped == 3
    assert decisions[PLAIN_EVERY] is False and all(decisions[:PLAIN_EVERY])


def test_untimed_gate_drafts_twice_then_times_a_plain_step() -> None:
    gate = DraftingGate(round_passes=1.3)  # not free: unknown means draft to find out
    assert [gate.should_draft() for _ in range(3)] == [True, True, False]


def test_losing_gate_only_probes_every_probe_every_rounds() -> None:
    gate = timed_gate(plain_s=0.010, draft_round_s=0.050, emitted=2)
    decisions = [gate.should_draft() for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1] and decisions[2 * PROBE_EVERY - 1]
    assert gate.skipped == 2 * PROBE_EVERY - 2


def test_free_proposals_are_scored_on_plain_rounds() -> None:
    # the build says a round costs 10 passes: a proposal is scored only when it ends
    gate = DraftingGate(round_passes=10.0, scores_plain_rounds=True)
    assert not gate.should_draft() and gate.wants_shadow()  # nothing scored yet: plain, no probe
    gate.watch([5, 6, 7])
    assert not gate.wants_shadow()
    for token in (5, 6, 7):
        gate.record_plain_token(token)
    assert gate.mean_emitted == 4  # 3 accepted + the verifier's token, as the drafting round would have
    gate.watch([1, 2])
    gate.record_plain_token(9)  # rejected at once: that round would have emitted one token
    assert gate.mean_emitted == pytest.approx(0.7 * 4 + 0.3 * 1)


def test_a_proposal_that_already_pays_is_scored_at_once() -> None:
    gate = DraftingGate(round_passes=1.3, scores_plain_rounds=True)
    gate.watch([5, 6, 7])
    gate.record_plain_token(5)  # 1 hit + the verifier's token = 2 tokens >= 1.3 passes: pays already
    assert gate.mean_emitted == 2 and gate.shadow is None
    assert gate.should_draft()


def test_hopeless_free_proposals_are_not_probed_and_drafting_drops_the_watched_one() -> None:
    gate = DraftingGate(round_passes=1.3, scores_plain_rounds=True)
    gate.watch([3])
    gate.record_plain_token(4)  # mean 1 token per round: below PROBE_MIN_EMITTED
    assert not any(gate.should_draft() for _ in range(3 * PROBE_EVERY))
    paying = DraftingGate(round_passes=1.0)  # not free: drafts while unknown
    paying.watch([1, 2])
    assert paying.should_draft() and paying.shadow is None
