"""Early exit's calibration: teacher-forced early-exit drafts per candidate exit layer E and
draft length k, priced by the layer cost model and by the draft/verify engines' latencies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adaptive_export.calibration.draft_sources import (
    Candidate,
    DraftMeasure,
    latency_candidate,
    mean_of,
    simulate_rounds,
)

EARLY_EXIT_KS = (1, 2, 3, 4, 6, 8)


def early_exit_speedup(
    tokens_per_round: float, exit_layer: int, k: int, layers: int, head: float, adapter: float = 0.0
) -> float:
    """Tokens per round over the round's cost, k draft steps (E layers + adapter + head) and one
    verify pass (L - E layers + head), against a full step (L layers + head)."""
    cost = k * (exit_layer + head + adapter) + (layers - exit_layer + head)
    return round(tokens_per_round * (layers + head) / cost, 3)


class EarlyExitMeasure(DraftMeasure):
    """Drafts are the teacher-forced early-exit predictions head(adapter(h_E)) per candidate E:
    while drafts are accepted they equal the true tokens, so this is exact for greedy."""

    name = "early_exit"

    def __init__(self, loaded: Any, adapters: dict[int, Any] | None) -> None:
        super().__init__(loaded, adapters)
        from adaptive_export.graphs.layers import Head

        spec = loaded.spec
        self.head = Head(loaded.hf_model, spec)
        self.candidates = sorted(adapters) if adapters else list(range(max(1, spec.num_layers // 3), spec.num_layers))
        self.draft_in: Callable[[int, Any], Any] = (lambda e, h: adapters[e](h)) if adapters else (lambda e, h: h)
        self.per_exit: dict[int, list[float]] = {e: [] for e in self.candidates}
        self.rounds: dict[tuple[int, int], list[dict[str, float]]] = {
            (e, k): [] for e in self.candidates for k in EARLY_EXIT_KS
        }

    def observe(self, ids: list[int], continuation: list[int], hidden: Any) -> None:
        start, truth = len(ids) - 1, continuation  # position `start` predicts continuation[0]
        # hidden[e] is the input of layer e (un-normalised); HF's last entry is already
        # normalised, so the reference is the greedy continuation itself.
        for e in self.candidates:
            pred = self.head(self.draft_in(e, hidden[e][0, start : start + len(truth)])).argmax(-1).tolist()
            self.per_exit[e].append(float(np.mean([p == t for p, t in zip(pred, truth)])))
            for k in EARLY_EXIT_KS:
                # the draft at position i (after token truth[i]) is pred[i + 1]
                self.rounds[(e, k)].append(simulate_rounds(lambda i, kk, pred=pred: pred[i + 1 : i + 1 + kk], truth, k))

    def report(self) -> dict[str, Any]:
        agreement = {str(e): round(float(np.mean(v)), 4) for e, v in self.per_exit.items() if v}
        return {
            "early_exit_agreement": agreement,
            "early_exit_through_adapter": bool(self.adapters),
            "best_exit_layer": int(max(agreement, key=agreement.get)) if agreement else self.loaded.spec.num_layers - 1,
            "early_exit_tokens_per_round": {
                f"{e}:{k}": mean_of(v, "tokens_per_round") for (e, k), v in self.rounds.items()
            },
        }

    @staticmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        out = []
        for key, tokens in measured["early_exit_tokens_per_round"].items():
            e, k = (int(x) for x in key.split(":"))
            out.append(
                {
                    "source": "early_exit",
                    "exit_layer": e,
                    "draft_len": k,
                    "tokens_per_round": tokens,
                    "expected_speedup": early_exit_speedup(tokens, e, k, layers, head, adapter),
                }
            )
        return out

    @staticmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """k draft calls plus one verify pass at T = k, on the exit layer whose engines were built."""
        if exit_layer is None or "draft_ms" not in latencies:
            return []
        step, out = latencies["decode_ms"][1], []
        for key, tokens in measured["early_exit_tokens_per_round"].items():
            e, k = (int(x) for x in key.split(":"))
            if e != exit_layer or k not in latencies["verify_ms"]:
                continue
            round_ms = k * latencies["draft_ms"] + latencies["verify_ms"][k]
            fields = {"source": "early_exit", "exit_layer": e, "draft_len": k, "tokens_per_round": tokens}
            out.append(latency_candidate(fields, round_ms, step))
        return out


MEASURE = EarlyExitMeasure
