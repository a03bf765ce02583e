"""Calibration side of the draft sources: how each is measured and what a round of it costs.

Keyed by the runtime's names (runtimes/drafting: what drafts, which engines it needs). Each
measure simulates its source exactly as the runtime runs it (greedy) on the model's own
greedy continuations (calibration/measure.py), writes its calibration.json entries (keys
prefixed with its name), and turns tokens per round into expected speed-up candidates twice:
with the layer-equivalent cost model (before the engines exist) and with the engines'
measured latencies (calibration/latency.py). A new source is one class here plus its line in
MEASURES, beside its runtime module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from adaptive_export.runtimes.acceptance import greedy_verdict
from adaptive_export.runtimes.drafting import SOURCES, lookup_ngram

MAX_DRAFT = 8
EARLY_EXIT_KS = (1, 2, 3, 4, 6, 8)

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


def _mean(rows: list[dict[str, float]], key: str) -> float:
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
                f"{e}:{k}": _mean(v, "tokens_per_round") for (e, k), v in self.rounds.items()
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
            out.append(
                {
                    "source": "early_exit",
                    "exit_layer": e,
                    "draft_len": k,
                    "tokens_per_round": tokens,
                    "round_ms": round(round_ms, 3),
                    "expected_speedup": round(tokens * step / round_ms, 3),
                }
            )
        return out


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
            "prompt_lookup_acceptance": {str(k): _mean(v, "acceptance") for k, v in self.rounds.items()},
            "prompt_lookup_hit_rate": {str(k): _mean(v, "hit_rate") for k, v in self.rounds.items()},
            "prompt_lookup_tokens_per_round": {str(k): _mean(v, "tokens_per_round") for k, v in self.rounds.items()},
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


class MeasuredElsewhere(DraftMeasure):
    """A source the greedy HF runs cannot simulate: its measurement lands in measured[name] from
    where its parts exist (engines built, prompt tokens trained)."""

    def observe(self, ids: list[int], continuation: list[int], hidden: Any) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {}


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
            tokens = measured_k["tokens_per_round"]
            out.append(
                {
                    "source": "precision",
                    "draft_len": k,
                    "tokens_per_round": tokens,
                    "acceptance": measured_k["acceptance"],
                    "round_ms": round(round_ms, 3),
                    "expected_speedup": round(tokens * step / round_ms, 3),
                }
            )
        return out


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
            out.append(
                {
                    "source": "prompt_tokens",
                    "draft_len": k,
                    "tokens_per_round": row["tokens_per_round"],
                    "acceptance": row["acceptance"],
                    "round_ms": round(round_ms, 3),
                    "expected_speedup": round(row["tokens_per_round"] * step / round_ms, 3),
                }
            )
        return out


MEASURES: dict[str, type[DraftMeasure]] = {
    m.name: m for m in (EarlyExitMeasure, PromptLookupMeasure, PrecisionMeasure, PromptTokensMeasure)
}
if set(MEASURES) != set(SOURCES):  # pragma: no cover - a registration mistake, caught by any import
    raise RuntimeError(
        f"calibration measures {sorted(MEASURES)} differ from the runtime's draft sources {sorted(SOURCES)}"
    )
