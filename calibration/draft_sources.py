"""Calibration side of the draft sources: the machinery every source's measure shares.

Each source's measure lives beside its runtime module, in calibration/drafts/<name>.py (the
registry is runtimes/draft_registry.py). A measure simulates its source exactly as the
runtime runs it (greedy) on the model's own greedy continuations (calibration/measure.py),
writes its calibration.json entries (keys prefixed with its name), and turns tokens per round
into expected speed-up candidates twice: with the layer-equivalent cost model (before the
engines exist) and with the engines' measured latencies (calibration/latency.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from adaptive_export.runtimes.acceptance import greedy_verdict

MAX_DRAFT = 8

Candidate = dict[str, Any]


def simulate_rounds(drafts_at: Any, truth: list[int], k: int, bonus: bool = False) -> dict[str, float]:
    """Greedy speculation over `truth`; drafts_at(i, k) proposes tokens for positions i+1..

    The verifier's tokens are the true continuation, so each round is the runtime's acceptance
    rule (runtimes/acceptance.py `greedy_verdict`) with targets truth[i+1..]. `bonus`: the
    verifier also scores the last draft, so a round where every draft is accepted emits one
    more token (prompt lookup; early exit would need one more draft call).
    """
    i, rounds, drafted, accepted, hits = 0, 0, 0, 0, 0
    while i < len(truth) - 1:
        drafts = drafts_at(i, k)[: len(truth) - 1 - i]
        rounds += 1
        hits += bool(drafts)
        scored = len(drafts) + 1 if bonus or not drafts else len(drafts)  # a plain step scores one row
        verdict = greedy_verdict(drafts, truth[i + 1 : i + 1 + scored])
        drafted += len(drafts)
        accepted += verdict.accepted
        i += verdict.emitted
    produced = len(truth) - 1
    return {
        "rounds": rounds,
        "tokens_per_round": produced / max(rounds, 1),
        "acceptance": accepted / max(drafted, 1),
        "hit_rate": hits / max(rounds, 1),
    }


def latency_candidate(fields: Candidate, round_ms: float, step_ms: float) -> Candidate:
    """`fields` (source, draft length, tokens per round...) priced by the engines' latencies: a
    round of `round_ms` emits tokens_per_round tokens where a plain decode step of `step_ms` emits one."""
    speedup = fields["tokens_per_round"] * step_ms / round_ms
    return {**fields, "round_ms": round(round_ms, 3), "expected_speedup": round(speedup, 3)}


def mean_of(rows: list[dict[str, float]], key: str) -> float:
    return round(float(np.mean([r[key] for r in rows])), 4) if rows else 0.0


class DraftMeasure(ABC):
    """Measures one draft source over greedy runs (prompt ids, continuation, HF hidden states)."""

    name: ClassVar[str]

    def __init__(self, loaded: Any, adapters: dict[int, Any] | None) -> None:
        self.loaded, self.adapters = loaded, adapters

    @abstractmethod
    def observe(self, ids: list[int], continuation: list[int], hidden: Any) -> None:
        """Simulate the source on one run (under torch.no_grad)."""

    @abstractmethod
    def report(self) -> dict[str, Any]:
        """calibration.json entries, keys prefixed with the source's name."""

    @staticmethod
    @abstractmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        """Expected speed-ups from the layer-equivalent cost model (one layer = 1)."""

    @staticmethod
    @abstractmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """Expected speed-ups from the staged engines' measured milliseconds."""

    @staticmethod
    def wide_verify_costs(measured: dict[str, Any] | None, decode_ms: dict[int, float]) -> dict[str, float] | None:
        """Its verify pass's cost per draft length in T=1 passes (manifest `verify_cost`), when the pass
        is wider than prompt lookup's T=k+1 (the source appends inputs); None: it verifies as lookup does."""
        return None


class MeasuredElsewhere(DraftMeasure):
    """A source the greedy HF runs cannot simulate: its measurement lands in measured[name] from
    where its parts exist (engines built, prompt tokens trained)."""

    def observe(self, ids: list[int], continuation: list[int], hidden: Any) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {}
