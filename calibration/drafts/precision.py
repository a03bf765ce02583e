"""The precision draft's calibration: measured on the staged engines, priced by their latencies.
Its VocabTrim head (calibration/draft_vocab.py) is a feature of this source, not a source."""

from __future__ import annotations

from typing import Any

from adaptive_export.calibration.draft_sources import Candidate, MeasuredElsewhere, latency_candidate


class PrecisionMeasure(MeasuredElsewhere):
    """Precision drafts (runtimes/drafting/precision.py) cannot be simulated on the PyTorch
    model: what differs from the verifier is exactly the engines' quantized weights and
    activations. Their acceptance is measured by running the staged engines
    (calibration/latency.py measure_precision_acceptance) into measured["precision"]."""

    name = "precision"

    @staticmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        return []  # no engines yet, so no acceptance: decided once they are built

    @staticmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """k precision-draft calls plus one decode pass at T = k + 1 (drafts plus the bonus position)."""
        if "precision_draft_ms" not in latencies:
            return []
        step, out = latencies["decode_ms"][1], []
        for k_text, measured_k in (measured.get("precision") or {}).get("per_k", {}).items():
            k = int(k_text)
            if k + 1 not in latencies["decode_ms"]:
                continue
            round_ms = k * latencies["precision_draft_ms"] + latencies["decode_ms"][k + 1]
            tokens, acceptance = measured_k["tokens_per_round"], measured_k["acceptance"]
            fields = {"source": "precision", "draft_len": k, "tokens_per_round": tokens, "acceptance": acceptance}
            out.append(latency_candidate(fields, round_ms, step))
        return out


MEASURE = PrecisionMeasure
