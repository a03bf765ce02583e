"""`build --speculate ... --draft-head train|FILE`: the trained draft exit in a bundle.

Why a plan of its own: a trained head decides the exit layer, the draft length and the stop
threshold from its own held-out measurement (calibration/draft_training.py), so it replaces
the raw-exit measurement of `--speculate auto` rather than feeding it. The bundle gets the
block as exit_adapters.safetensors (its parameters also in weights.bin), the head's ids as
draft_vocab.bin (the head is rows of the LM head, stored once), and the threshold as the
manifest's `speculation.draft_stop_below`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_export.graphs.adaptive import DraftHead
from adaptive_export.graphs.drafts.early_exit import ExitPlan
from adaptive_export.loading.artifacts import ADAPTERS_FILE, adapters_bytes, load_draft_head
from adaptive_export.runtimes.errors import UsageError

MIN_SPEEDUP = 1.05  # as calibration/latency.py: below this, `run --mode auto` keeps plain decoding


@dataclass(frozen=True)
class DraftHeadRecipe:
    """How much text and training `--draft-head train` spends (SmolLM2: within 20 minutes on 2 cores)."""

    requests: int = 60  # user requests the model writes itself, then answers (its own text to imitate)
    answer_tokens: int = 96  # tokens of each answer (a docstring document gets twice as many)
    docstrings: int = 300  # standard-library docstrings, text the model did not write
    epochs: int = 4
    max_seconds: float = 120.0  # per (exit, form) trained
    seed: int = 0


def train_or_load(option: str, loaded: Any, exits: list[int], recipe: DraftHeadRecipe) -> tuple[DraftHead, dict]:
    """(the best trained head among `exits`, calibration.json's 'draft_head' entry)."""
    spec = loaded.spec
    if option != "train":
        head = load_draft_head(Path(option), spec.hidden_size, spec.rms_norm_eps, spec.num_layers, spec.vocab_size)
        if len(exits) == 1 and head.exit_layer != exits[0]:
            raise UsageError(
                f"draft head file {option!r} drafts from exit {head.exit_layer}, --speculate asks for {exits[0]}",
                f"use --speculate {head.exit_layer}:K or --speculate auto, or train a head with --draft-head train",
            )
        return head, {"loaded_from": option, "exit_layer": head.exit_layer, "form": head.form}
    from adaptive_export.calibration.draft_data import training_text
    from adaptive_export.calibration.draft_training import TrainSettings, train_draft_heads

    text = training_text(
        loaded,
        requests=recipe.requests,
        answer_tokens=recipe.answer_tokens,
        docstrings=recipe.docstrings,
        seed=recipe.seed,
    )
    settings = TrainSettings(epochs=recipe.epochs, max_seconds=recipe.max_seconds, seed=recipe.seed)
    fit = train_draft_heads(loaded, text, exits, settings=settings)
    kept = {e: fit.report["per_exit"][str(e)]["kept"]["expected_speedup"] for e in fit.heads}
    best = max(kept, key=lambda e: kept[e])
    return fit.heads[best], {**fit.report, "shipped": best}


def plan_draft_head(
    option: str, speculate: str, loaded: Any, parts: Any, recipe: DraftHeadRecipe = DraftHeadRecipe()
) -> tuple[ExitPlan, dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """ExitPlan, manifest `speculation`, calibration.json entries and the adapter file, as
    calibration/speculation.py's plan_speculation returns them; sets the parts' block and ids."""
    from adaptive_export.calibration.draft_training import draft_exits
    from adaptive_export.calibration.speculation import parse_forced

    spec = loaded.spec
    forced = None if speculate == "auto" else parse_forced(speculate, spec.num_layers)
    exits = [forced[0]] if forced else draft_exits(spec.num_layers)
    head, report = train_or_load(option, loaded, exits, recipe)
    draft_len = forced[1] if forced else head.draft_len
    parts.exit_adapters = {head.exit_layer: head.block}
    parts.draft_vocab = head.ids
    expected = report.get("per_exit", {}).get(str(head.exit_layer), {}).get("kept", {}).get("expected_speedup")
    manifest = {
        "source": "early_exit",
        "auto_enabled": bool(expected is not None and expected > MIN_SPEEDUP),
        "exit_layer": head.exit_layer,
        "early_exit": {"draft_len": draft_len},
        "adapter": True,
        "draft_head": {"form": head.form, "vocab": int(head.ids.numel())},
        "draft_stop_below": head.stop_below,
        "chosen_by": "forced with --speculate, trained draft head" if forced else "trained draft head (held-out)",
    }
    if expected is not None:
        manifest["expected_speedup"] = expected
    plan = ExitPlan(head.exit_layer, draft_len, adapter=True, draft_vocab=int(head.ids.numel()))
    files = {ADAPTERS_FILE: adapters_bytes({head.exit_layer: head.block})}
    return plan, manifest, {"speculation": {"draft_head": report}}, files
