"""The acceptance rule on its own (runtimes/acceptance.py): greedy verdicts, the checks a
plain step makes, the rejection rule's edge cases, and calibration's simulated rounds
agreeing with it. No bundle: logits rows are numpy arrays made here."""

from __future__ import annotations

import numpy as np
import pytest

from adaptive_export.calibration.draft_sources import simulate_rounds
from adaptive_export.runtimes.acceptance import Verdict, greedy_verdict, judge, rejection_verdict
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.sampling import Sampler, SamplingParams, make_sampler

VOCAB = 8


def rows_for(targets: list[int], vocab: int = VOCAB) -> np.ndarray:
    """Verify logits whose row j has its maximum at targets[j] (by a margin of 3)."""
    rows = np.random.default_rng(1).standard_normal((len(targets), vocab)).astype(np.float32)
    for j, target in enumerate(targets):
        rows[j, target] = rows[j].max() + 3.0
    return rows


def test_greedy_verdict_keeps_the_matching_prefix_then_the_verifier_token() -> None:
    assert greedy_verdict([4, 5, 6], [4, 5, 1, 2]) == Verdict(2, 1)  # correction at the first mismatch
    assert greedy_verdict([4, 5, 6], [4, 5, 6, 2]) == Verdict(3, 2)  # all accepted + bonus
    assert greedy_verdict([4, 5, 6], [4, 5, 6]) == Verdict(3, None)  # all accepted, no bonus row (early exit)
    assert greedy_verdict([4, 5, 6], [0, 5, 6, 2]) == Verdict(0, 0)
    assert greedy_verdict([], [7]) == Verdict(0, 7)  # a plain step
    assert [v.emitted for v in (Verdict(2, 1), Verdict(3, None), Verdict(0, 7))] == [3, 3, 1]


def test_judge_greedy_reads_the_argmax_of_each_row() -> None:
    sampler = make_sampler(SamplingParams())
    assert judge([3, 1], None, rows_for([3, 1, 6]), sampler) == Verdict(2, 6)
    assert judge([3, 1], None, rows_for([3, 2, 6]), sampler) == Verdict(1, 2)
    assert judge([], None, rows_for([5]), sampler) == Verdict(0, 5)
    assert judge([3, 1], None, rows_for([3, 1]), sampler) == Verdict(2, None)


def test_judge_greedy_checks_the_row_it_emits_from_as_a_plain_step_does() -> None:
    sampler = make_sampler(SamplingParams())
    rows = rows_for([3, 1, 6])
    rows[2, 0] = np.nan
    with pytest.raises(UsageError, match="non-finite"):
        judge([3, 1], None, rows, sampler)  # the bonus row is the verifier's own token
    assert judge([3, 2], None, rows, sampler) == Verdict(1, 1)  # a rejection never reads the bonus row


def test_rejection_rule_edge_cases() -> None:
    params = SamplingParams(temperature=1.0)
    certain = np.full((2, VOCAB), -30.0, dtype=np.float32)
    certain[:, 4] = 30.0  # p is (almost) a point mass at 4
    for seed in range(20):
        sampler = Sampler(params, np.random.default_rng(seed))
        assert rejection_verdict([4], None, certain, sampler) == Verdict(1, 4)  # accepted, bonus from row 1
        verdict = rejection_verdict([2], None, certain, sampler)  # p(2) ~ 0: rejected, the residual has no 2
        assert verdict == Verdict(0, 4)
    # q == p: min(1, p/q) = 1, every draft is accepted whatever it is
    same = np.random.default_rng(3).standard_normal((3, VOCAB)).astype(np.float32)
    for seed in range(20):
        sampler = Sampler(params, np.random.default_rng(seed))
        assert rejection_verdict([1, 7], [same[0], same[1]], same, sampler).accepted == 2


def test_rejection_rule_draws_in_the_same_order_as_sampling() -> None:
    """A plain step under sampling is the rule with no drafts: one draw from row 0, so seeded
    runs reproduce plain decoding's first token."""
    params = SamplingParams(temperature=0.8, top_k=4, seed=11)
    rows = np.random.default_rng(5).standard_normal((1, VOCAB)).astype(np.float32)
    plain = make_sampler(params).choose(rows[0])
    assert judge([], None, rows, make_sampler(params)) == Verdict(0, plain)


@pytest.mark.parametrize("bonus", [False, True])
def test_simulated_rounds_follow_the_acceptance_rule(bonus: bool) -> None:
    """simulate_rounds on a continuation where the drafts match for exactly two tokens per round."""
    truth = list(range(1, 14))  # 13 tokens, 12 to produce

    def drafts_at(i: int, k: int) -> list[int]:
        good = truth[i + 1 : i + 3]
        return (good + [0] * k)[:k]  # two right, then wrong

    result = simulate_rounds(drafts_at, truth, 3, bonus=bonus)
    # each round: 2 accepted + the correction = 3 tokens; the bonus never applies (a draft is wrong)
    assert result["rounds"] == 4 and result["tokens_per_round"] == pytest.approx(3.0)
    assert result["acceptance"] == pytest.approx(8 / 12) and result["hit_rate"] == 1.0
