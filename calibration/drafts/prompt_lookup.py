"""Prompt lookup's calibration: its n-gram drafts simulated on the calibration runs for every
draft length, priced as one decode pass per round (cost model) or by the decode engine's
measured latency at T = k + 1 (drafts plus the bonus row)."""

from __future__ import annotations

from typing import Any

from adaptive_export.calibration.draft_sources import (
    MAX_DRAFT,
    Candidate,
    DraftMeasure,
    latency_candidate,
    mean_of,
    simulate_rounds,
)
from adaptive_export.runtimes.drafting.prompt_lookup import lookup_ngram


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
        a round without costs a T = 1 pass, or `floor_ms` where the bundle decodes two rows at least
        (a floor round, runtimes/speculative.py; its guess counted as never accepted)."""
        step, out = latencies["decode_ms"][1], []
        no_draft_ms = latencies.get("floor_ms", step)
        hit_rate = measured["prompt_lookup_hit_rate"]
        for k_text, tokens in measured["prompt_lookup_tokens_per_round"].items():
            k, hits = int(k_text), hit_rate.get(k_text, 1.0)
            if k + 1 not in latencies["decode_ms"]:
                continue
            round_ms = hits * latencies["decode_ms"][k + 1] + (1 - hits) * no_draft_ms
            fields = {"source": "prompt_lookup", "draft_len": k, "tokens_per_round": tokens}
            out.append(latency_candidate(fields, round_ms, step))
        return out


MEASURE = PromptLookupMeasure
