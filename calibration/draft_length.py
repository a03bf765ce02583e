"""Dynamic draft length (Kangaroo's double early exit): stop a round's drafting once the draft's
own top-1 probability falls below a threshold.

Why: a fixed k pays k draft steps even when the draft already doubts its next token; most
rejected drafts are low-confidence ones. The runtime (runtimes/drafting/early_exit.py) keeps
a draft whose confidence is below `stop_below` (it is already computed) and stops after it.

Calibration simulates greedy rounds over the held-out split's greedy runs (positions whose next
token is the teacher's own greedy token): draft j of a round at position i is the trimmed
draft's prediction at i + j, correct when it names the teacher's argmax. After a wrong draft the
runtime's confidences come from a path the teacher-forced cache does not hold; those drafts are
rejected either way, and the simulation takes their confidence from the true path (only the
count of drafts, hence the cost, can differ). Cost is in layer-equivalents, as calibration/
speculation.py's model: a draft step = E layers + the block + the trimmed head; a verify pass =
L - E layers + the full head; a plain step = L layers + the full head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THRESHOLDS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class Costs:
    """Layer-equivalents of one draft step, one verify pass and one plain decode step."""

    draft: float
    verify: float
    plain: float


@dataclass(frozen=True)
class Rounds:
    tokens: int
    rounds: int
    drafted: int
    accepted: int

    def speedup(self, costs: Costs) -> float:
        spent = self.drafted * costs.draft + self.rounds * costs.verify
        return self.tokens * costs.plain / spent if spent else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / max(self.rounds, 1)


def simulate(segments: Sequence[tuple[Sequence[bool], Sequence[float]]], k: int, stop_below: float) -> Rounds:
    """Greedy early-exit rounds (no bonus token) over each segment's (draft correct, confidence)."""
    tokens = rounds = drafted = accepted = 0
    for correct, confidence in segments:
        i, n = 0, len(correct)
        while i < n:
            d = 0
            while d < k and i + d < n:
                d += 1
                if confidence[i + d - 1] < stop_below:
                    break
            a = 0
            while a < d and correct[i + a]:
                a += 1
            emitted = a + 1 if a < d else d
            tokens, rounds, drafted, accepted = tokens + emitted, rounds + 1, drafted + d, accepted + a
            i += emitted
    return Rounds(tokens, rounds, drafted, accepted)


@dataclass(frozen=True)
class LengthChoice:
    draft_len: int
    stop_below: float
    rounds: Rounds
    expected_speedup: float
    fixed_speedup: float  # the same k with stop_below 0 (always k drafts)


def choose_length(segments: Sequence[tuple[Sequence[bool], Sequence[float]]], costs: Costs) -> LengthChoice:
    """The (k, threshold) with the most expected tokens per unit cost on the held-out runs."""
    best: LengthChoice | None = None
    for k in DRAFT_LENGTHS:
        fixed = simulate(segments, k, 0.0).speedup(costs)
        for stop_below in THRESHOLDS:
            rounds = simulate(segments, k, stop_below)
            speedup = rounds.speedup(costs)
            if best is None or speedup > best.expected_speedup + 1e-9:
                best = LengthChoice(k, stop_below, rounds, speedup, fixed)
    assert best is not None
    return best
