"""Calibration side of the draft sources: the machinery every source's measure shares.

Each source's measure lives beside its runtime module, in calibration/drafts/<name>.py (the
registry is runtimes/drafting/registry.py). A measure simulates its source exactly as the
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
from adaptive_export.runtimes.drafting import lookup_ngram

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


class MeasuredElsewhere(DraftMeasure):
    """A source the greedy HF runs cannot simulate: its measurement lands in measured[name] from
    where its parts exist (engines built, prompt tokens trained)."""

    def observe(self, ids: list[int], continuation: list[int], hidden: Any) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {}


class PromptLookupMeasure(DraftMeasure):
    """n-gram drafts from the context, verified with the bonus row (runtimes/drafting/prompt_lookup.py)."""

    name = "prompt_lookup"

    def __init__(self, loaded: Any, adapters: dict[int, Any] | None) -> None:
        super().__init__(loaded, adapters)
        self.rounds: dict[int, list[dict[str, float]]] = {k: [] for k in range(1, MAX_DRAFT + 1)}

    def observe(self, ids: list[int], continuation: list[int], hidden: Any) -> None:
        context, truth = list(ids), continuation
        for k in self.rounds:
            self.rounds[k].append(
                simulate_rounds(lambda i, kk: lookup_ngram(context + truth[: i + 1], kk), truth, k, bonus=True)
            )

    def report(self) -> dict[str, Any]:
        return {
            "prompt_lookup_acceptance": {str(k): mean_of(v, "acceptance") for k, v in self.rounds.items()},
            "prompt_lookup_hit_rate": {str(k): mean_of(v, "hit_rate") for k, v in self.rounds.items()},
            "prompt_lookup_tokens_per_round": {str(k): mean_of(v, "tokens_per_round") for k, v in self.rounds.items()},
        }

    @staticmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        """A round is one decode pass (its width ignored by this model)."""
        return [
            {
                "source": "prompt_lookup",
                "exit_layer": None,
                "draft_len": int(k_text),
                "tokens_per_round": tokens,
                "expected_speedup": round(tokens, 3),
            }
            for k_text, tokens in measured["prompt_lookup_tokens_per_round"].items()
        ]

    @staticmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """A round with drafts costs one decode pass at T = k + 1 (drafts plus the bonus position),
        a round without costs a T = 1 pass."""
        step, out = latencies["decode_ms"][1], []
        hit_rate = measured["prompt_lookup_hit_rate"]
        for k_text, tokens in measured["prompt_lookup_tokens_per_round"].items():
            k, hits = int(k_text), hit_rate.get(k_text, 1.0)
            if k + 1 not in latencies["decode_ms"]:
                continue
            round_ms = hits * latencies["decode_ms"][k + 1] + (1 - hits) * step
            out.append(
                {
                    "source": "prompt_lookup",
                    "draft_len": k,
                    "tokens_per_round": tokens,
                    "round_ms": round(round_ms, 3),
                    "expected_speedup": round(tokens * step / round_ms, 3),
                }
            )
        return out


# A source whose measure has not moved to calibration/drafts/<name>.py yet.
NOT_YET_MOVED: dict[str, type[DraftMeasure]] = {"prompt_lookup": PromptLookupMeasure}
