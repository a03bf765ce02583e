"""The acceptance rule of speculative decoding, once (docs/architecture.md section 5).

A verify pass scores drafts d1..dk: its row j is the full model's distribution after input j
([pending, d1, .., dk]), and a pass that also scored the row after the last draft carries the
bonus row. The rule keeps drafts while they are what the full model would emit and emits one
token of the full model's own after them, so the output is what plain decoding emits:

- greedy: the longest prefix of the drafts equal to the verifier's argmax tokens, then the
  verifier's token at the first mismatch, or the bonus token when every draft matched;
- sampling: the rejection rule (Leviathan et al. 2023; gpt-fast `speculative_decode`): accept
  d_j with probability min(1, p(d_j) / q(d_j)), else emit a token from the residual
  max(p - q, 0), which keeps the full model's distribution p exactly. Deterministic drafts
  (copied from the context, or argmax guesses) have q = a point mass at d_j.

The runtime's rounds (runtimes/speculative.py) and calibration's simulated rounds
(calibration/draft_sources.py `simulate_rounds`) both call these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from adaptive_export.runtimes.sampling import Sampler, check_finite


@dataclass(frozen=True)
class Verdict:
    """What one verify pass decided: how many drafts stand, and the verifier's own token after
    them (the correction at the first rejection, or the bonus token), None when every draft
    was accepted and the pass did not score the row after the last one (early exit)."""

    accepted: int
    token: int | None

    @property
    def emitted(self) -> int:
        """Tokens the round emits: the accepted drafts, then the verifier's token if any."""
        return self.accepted + (self.token is not None)


def greedy_verdict(drafts: Sequence[int], targets: Sequence[int]) -> Verdict:
    """Greedy acceptance. `targets[j]` is the verifier's token after input j: one per draft,
    plus one when the pass scored the bonus row (for a plain step: no drafts, one target)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return Verdict(accepted, int(targets[accepted]) if accepted < len(targets) else None)


def rejection_verdict(
    drafts: Sequence[int], draft_rows: Sequence[np.ndarray] | None, verify_rows: np.ndarray, sampler: Sampler
) -> Verdict:
    """Sampling acceptance. `draft_rows[j]`: the logits d_j was sampled from, or None when the
    drafts are deterministic; `verify_rows`: the verify pass's logits [rows, V]."""
    for j, draft in enumerate(drafts):
        p = sampler.probabilities(verify_rows[j])
        q = sampler.probabilities(draft_rows[j]) if draft_rows is not None else None
        accept = p[draft] if q is None else min(1.0, p[draft] / max(q[draft], 1e-30))
        if sampler.rng.random() < accept:
            continue
        if q is None:
            residual = p.copy()
            residual[draft] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        return Verdict(j, int(sampler.rng.choice(residual.size, p=residual)))
    return Verdict(len(drafts), _bonus(len(drafts), verify_rows, sampler))


def judge(
    drafts: Sequence[int], draft_rows: Sequence[np.ndarray] | None, verify_rows: np.ndarray, sampler: Sampler
) -> Verdict:
    """The verdict on one verify pass: greedy acceptance or the rejection rule."""
    if not sampler.greedy:
        return rejection_verdict(drafts, draft_rows, verify_rows, sampler)
    # argmax rows only as far as a verdict can reach: the drafts' rows and the one after them
    verdict = greedy_verdict(drafts, verify_rows[: len(drafts) + 1].argmax(axis=-1).tolist())
    if verdict.accepted == len(drafts) and verdict.token is not None:
        check_finite(verify_rows[verdict.accepted])  # the verifier's own token, as a plain step checks it
    return verdict


def _bonus(accepted: int, verify_rows: np.ndarray, sampler: Sampler) -> int | None:
    """The verifier's token from the row after the last accepted draft, when the pass scored it."""
    return sampler.choose(verify_rows[accepted]) if verify_rows.shape[0] > accepted else None
