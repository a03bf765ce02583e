"""Early exit's calibration: teacher-forced early-exit drafts per candidate exit layer E and
draft length k, priced by the layer cost model and by the draft/verify engines' latencies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.calibration.draft_sources import (
    Candidate,
    DraftMeasure,
    latency_candidate,
    mean_of,
    simulate_rounds,
)
from adaptive_export.runtimes.errors import UsageError

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


def needs_speculate(flag: str, option: str, speculate: str | None, part: str) -> None:
    """`--exit-adapter` and `--draft-head` shape the early-exit draft, which only --speculate builds."""
    if not speculate:
        raise UsageError(
            f"{flag} {option} needs --speculate (the {part} belongs to the early-exit draft)",
            "add --speculate auto, or --speculate E:k",
        )


def check_option_file(option: str, what: str, fix: str) -> None:
    """A FILE given to a build option must exist: it fails before minutes of loading."""
    if not Path(option).is_file():
        raise UsageError(f"{what} file {option!r} does not exist", fix)


def check_exit_adapter_option(options: Any) -> None:
    """`--exit-adapter none|fit|FILE` needs --speculate; a missing FILE fails before minutes of loading."""
    option = options.exit_adapter or "none"
    if option == "none":
        return
    needs_speculate("--exit-adapter", option, options.speculate, "adapter")
    if option != "fit":
        fix = "pass --exit-adapter fit, or an exit_adapters.safetensors file written by a previous build"
        check_option_file(option, "exit adapter", fix)


def check_draft_head_option(options: Any) -> None:
    """`--draft-head none|train|FILE` needs --speculate, and replaces --exit-adapter and --draft-vocab."""
    option = options.draft_head or "none"
    if option == "none":
        return
    needs_speculate("--draft-head", option, options.speculate, "head")
    if (options.exit_adapter or "none") != "none" or options.draft_vocab:
        raise UsageError(
            f"--draft-head {option} brings its own exit block and vocabulary",
            "drop --exit-adapter and --draft-vocab",
        )
    if option != "train":
        fix = "pass --draft-head train, or a draft head file (samples/smollm2_draft_head.safetensors)"
        check_option_file(option, "draft head", fix)


def check_options(options: Any, quantize: str) -> None:
    """The build options that shape the early-exit draft (commands/options.py BuildOptions),
    checked before minutes of loading."""
    check_exit_adapter_option(options)
    check_draft_head_option(options)


MEASURE = EarlyExitMeasure
