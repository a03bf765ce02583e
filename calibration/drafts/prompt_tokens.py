"""The prompt-token source's calibration: its chain rounds are simulated where the tokens are
trained (calibration/prompt_tokens.py) and priced here by the cost model and by latency."""

from __future__ import annotations

from typing import Any

from adaptive_export.calibration.draft_sources import Candidate, MeasuredElsewhere, latency_candidate


class PromptTokensMeasure(MeasuredElsewhere):
    """Prompt-token drafts (runtimes/drafting/prompt_tokens.py) need the trained prompt tokens, so they are
    simulated where those are trained (calibration/prompt_tokens.py measure_prompt_tokens), into
    measured["prompt_tokens"]: tokens per round and the share of rounds that carry drafts."""

    name = "prompt_tokens"

    @staticmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        """A round is one decode pass (its width ignored by this model), as for prompt lookup."""
        return [
            {
                "source": "prompt_tokens",
                "draft_len": int(k),
                "tokens_per_round": row["tokens_per_round"],
                "expected_speedup": round(row["tokens_per_round"], 3),
            }
            for k, row in (measured.get("prompt_tokens") or {}).get("per_k", {}).items()
        ]

    @staticmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """A round with k drafts is one decode pass at T = 1+k+m, a round without at T = 1+m."""
        rounds = measured.get("prompt_tokens") or {}
        m, step, out = int(rounds.get("prompt_tokens", 0)), latencies["decode_ms"][1], []
        for k_text, row in rounds.get("per_k", {}).items():
            k = int(k_text)
            if 1 + k + m not in latencies["decode_ms"]:
                continue
            share = row["draft_round_share"]
            round_ms = share * latencies["decode_ms"][1 + k + m] + (1 - share) * latencies["decode_ms"][1 + m]
            tokens, acceptance = row["tokens_per_round"], row["acceptance"]
            fields = {"source": "prompt_tokens", "draft_len": k, "tokens_per_round": tokens, "acceptance": acceptance}
            out.append(latency_candidate(fields, round_ms, step))
        return out


MEASURE = PromptTokensMeasure
