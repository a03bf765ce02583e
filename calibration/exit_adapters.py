"""Fit exit adapters so that head(adapter(h_E)) imitates the full model (docs/architecture.md
sections 2 "Exit adapters" and 5).

Why: on a model not trained for early exit, the shared head on layer E's hidden state
rarely agrees with the last layer, so early-exit drafts are mostly rejected. A small
low-rank residual adapter (graphs.adaptive.ExitAdapter) before the shared final norm +
LM head closes part of that gap at the cost of ~2*H*rank parameters per draft step.

Data: the model's own greedy continuations of the calibration prompts (what the draft must
predict to be accepted), every position of prompt + continuation, each distinct prefix once. The backbone is run ONCE:
h_E (HF `hidden_states[E]`, the input of layer E) and the full model's distribution are
cached, then only the adapter trains, so an epoch costs one pass through the LM head.

Loss: KL(full || head(adapter(h_E))) truncated to the full model's top-k tokens
(TOP_K): sum over those k of p (log p - log q), with p the full model's true (not
renormalised) probabilities; the tail mass, usually small, is ignored.

Evaluation: every HOLDOUT_EVERY-th prompt is held out; agreement = top-1 of
head(adapter(h_E)) equals the full model's argmax, before (identity adapter = raw early
exit) and after fitting, on held-out and train positions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from adaptive_export.graphs.adaptive import ExitAdapter
from adaptive_export.graphs.layers import Head
from adaptive_export.runtimes.errors import UsageError

DEFAULT_RANK = 64
DEFAULT_EPOCHS = 8
DEFAULT_LR = 2e-3
BATCH = 64
TOP_K = 64
HOLDOUT_EVERY = 5
WEIGHT_DECAY = 1e-4
EVAL_BATCH = 512

GreedyRun = tuple[list[int], list[int], Any]  # (prompt ids, greedy continuation, HF hidden states)


@dataclass
class Split:
    """Cached positions of one split: h_E per exit and the full model's top-k distribution."""

    hidden: dict[int, Tensor]  # exit layer -> [N, H]
    top_ids: Tensor  # [N, TOP_K], column 0 is the full model's argmax
    top_logp: Tensor  # [N, TOP_K], full model's log-probabilities of those tokens

    @property
    def size(self) -> int:
        return int(self.top_ids.shape[0])


@dataclass
class ExitAdapterFit:
    adapters: dict[int, ExitAdapter]
    report: dict[str, Any] = field(default_factory=dict)


def candidate_exits(num_layers: int) -> list[int]:
    """Few exits, so `--speculate auto --exit-adapter fit` stays minutes: L/2, 2L/3, 5L/6, L-2."""
    exits = {num_layers // 2, (2 * num_layers) // 3, (5 * num_layers) // 6, num_layers - 2}
    return sorted(e for e in exits if 0 < e < num_layers)


def is_held_out(index: int) -> bool:
    """Deterministic hold-out: every HOLDOUT_EVERY-th prompt (indices 4, 9, ...)."""
    return index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1


def greedy_runs(loaded: Any, prompts: Sequence[str], new_tokens: int, progress: bool = True) -> list[GreedyRun]:
    """The full model's greedy continuation and hidden states for each prompt (computed once, reused)."""
    from adaptive_export.calibration.greedy import greedy_runs_with_hidden

    return list(greedy_runs_with_hidden(loaded, prompts, new_tokens, progress=progress))


def cache_split(
    loaded: Any, runs: Sequence[GreedyRun], exit_layers: Sequence[int], seen: set[tuple[int, ...]]
) -> Split:
    """Stack the positions of `runs` whose token prefix is not in `seen`: h_E per exit and the
    full model's top-k log-probs.

    A position is a function of its prefix, so a prefix already seen (the chat template's
    shared system prompt) is an exact duplicate: dropping it keeps the template from dominating
    the loss and from counting as held-out when train already holds it. HF's last hidden
    state is already normalised, so the full logits are lm_head of it.
    """
    hidden: dict[int, list[Tensor]] = {e: [] for e in exit_layers}
    ids, logp = [], []
    with torch.no_grad():
        for prompt_ids, cont, states in runs:
            tokens = prompt_ids + cont
            fresh = [t for t in range(len(tokens)) if tuple(tokens[: t + 1]) not in seen]
            seen.update(tuple(tokens[: t + 1]) for t in fresh)
            keep = torch.tensor(fresh, dtype=torch.long)
            for e in exit_layers:
                hidden[e].append(states[e][0, keep].float())
            full = torch.log_softmax(loaded.hf_model.lm_head(states[-1][0, keep]).float(), dim=-1)
            top = full.topk(min(TOP_K, full.shape[-1]), dim=-1)
            ids.append(top.indices)
            logp.append(top.values)
    width = loaded.spec.hidden_size
    return Split(
        hidden={e: torch.cat(v) if v else torch.zeros(0, width) for e, v in hidden.items()},
        top_ids=torch.cat(ids) if ids else torch.zeros(0, TOP_K, dtype=torch.long),
        top_logp=torch.cat(logp) if logp else torch.zeros(0, TOP_K),
    )


@contextmanager
def frozen(module: torch.nn.Module) -> Iterator[None]:
    """No gradients for the shared head's weights (they are the model's) while the adapter trains."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def truncated_kl(logits: Tensor, top_ids: Tensor, top_logp: Tensor) -> Tensor:
    """Mean over positions of sum_{j in top-k of full} p_j (log p_j - log q_j)."""
    logq = torch.log_softmax(logits, dim=-1).gather(-1, top_ids)
    return (top_logp.exp() * (top_logp - logq)).sum(-1).mean()


def agreement(head: Head, adapter: ExitAdapter | None, hidden: Tensor, top_ids: Tensor) -> float:
    """Share of positions where head(adapter(h_E)) picks the full model's argmax (None: raw exit)."""
    if hidden.shape[0] == 0:
        return float("nan")
    hits = 0
    with torch.no_grad():
        for start in range(0, hidden.shape[0], EVAL_BATCH):
            x = hidden[start : start + EVAL_BATCH]
            if adapter is not None:
                x = adapter(x)
            hits += int((head(x).argmax(-1) == top_ids[start : start + EVAL_BATCH, 0]).sum())
    return hits / hidden.shape[0]


def train_adapter(
    head: Head,
    exit_layer: int,
    train: Split,
    held: Split,
    *,
    rank: int,
    epochs: int,
    seed: int,
    lr: float = DEFAULT_LR,
    progress: bool = True,
) -> tuple[ExitAdapter, dict[str, Any]]:
    """Adam with cosine decay over shuffled minibatches of cached positions; returns the adapter and its curve."""
    torch.manual_seed(seed)
    adapter = ExitAdapter(train.hidden[exit_layer].shape[1], rank, head.eps)
    optimizer = torch.optim.Adam(adapter.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    steps_per_epoch = max(1, math.ceil(train.size / BATCH))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps_per_epoch)
    order = torch.Generator().manual_seed(seed)
    hidden = train.hidden[exit_layer]
    curve: list[dict[str, float]] = []
    bar = tqdm(
        total=epochs * steps_per_epoch, desc=f"fit exit adapter E={exit_layer}", unit="step", disable=not progress
    )
    with frozen(head):
        for epoch in range(epochs):
            adapter.train()
            total = 0.0
            for batch in torch.randperm(train.size, generator=order).split(BATCH):
                loss = truncated_kl(head(adapter(hidden[batch])), train.top_ids[batch], train.top_logp[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                total += loss.item() * len(batch)
                bar.update(1)
            adapter.eval()
            curve.append(
                {
                    "epoch": epoch + 1,
                    "train_kl": round(total / max(train.size, 1), 4),
                    "held_out_agreement": round(agreement(head, adapter, held.hidden[exit_layer], held.top_ids), 4),
                }
            )
            bar.set_postfix(kl=curve[-1]["train_kl"], held_out=curve[-1]["held_out_agreement"])
    bar.close()
    return adapter.eval(), {"curve": curve}


def fit_exit_adapters(
    loaded: Any,
    prompts: Sequence[str],
    exit_layers: Sequence[int],
    *,
    rank: int = DEFAULT_RANK,
    epochs: int = DEFAULT_EPOCHS,
    seed: int = 0,
    new_tokens: int = 32,
    progress: bool = True,
    runs: Sequence[GreedyRun] | None = None,
) -> ExitAdapterFit:
    """One adapter per exit layer, fitted on the train prompts; report agreement before/after.

    `runs` (from greedy_runs) lets a caller reuse continuations it already generated.
    """
    spec = loaded.spec
    bad = [e for e in exit_layers if not 0 < e < spec.num_layers]
    if bad:
        raise UsageError(
            f"exit layer {bad[0]} is outside 1..{spec.num_layers - 1}",
            f"choose exit layers between 1 and {spec.num_layers - 1}",
        )
    runs = list(runs) if runs is not None else greedy_runs(loaded, prompts, new_tokens, progress)
    seen: set[tuple[int, ...]] = set()  # train first: a held-out prefix already in train is not held out
    train = cache_split(loaded, [r for i, r in enumerate(runs) if not is_held_out(i)], exit_layers, seen)
    held = cache_split(loaded, [r for i, r in enumerate(runs) if is_held_out(i)], exit_layers, seen)
    head = Head(loaded.hf_model, spec)
    adapters: dict[int, ExitAdapter] = {}
    per_exit: dict[str, Any] = {}
    for e in exit_layers:
        started = time.perf_counter()
        adapters[e], details = train_adapter(
            head, e, train, held, rank=rank, epochs=epochs, seed=seed, progress=progress
        )
        per_exit[str(e)] = exit_report(head, adapters[e], e, train, held, time.perf_counter() - started, details)
    report = {
        "rank": rank,
        "epochs": epochs,
        "seed": seed,
        "lr": DEFAULT_LR,
        "batch": BATCH,
        "top_k_target": TOP_K,
        "loss": "KL(full || head(adapter(h_E))) over the full model's top-k tokens",
        "prompts": len(runs),
        "held_out_prompts": sum(is_held_out(i) for i in range(len(runs))),
        "held_out_rule": f"every {HOLDOUT_EVERY}th prompt",
        "new_tokens": new_tokens,
        "positions": {
            "train": train.size,
            "held_out": held.size,
            "duplicates_dropped": sum(len(a) + len(b) for a, b, _ in runs) - train.size - held.size,
        },
        "per_exit": per_exit,
    }
    return ExitAdapterFit(adapters, report)


def exit_report(
    head: Head,
    adapter: ExitAdapter,
    exit_layer: int,
    train: Split,
    held: Split,
    seconds: float,
    details: dict[str, Any],
) -> dict[str, Any]:
    """calibration.json's entry of one exit: agreement before/after on both splits, size, time, curve."""
    return {
        "held_out": {
            "before": _round(agreement(head, None, held.hidden[exit_layer], held.top_ids)),
            "after": _round(agreement(head, adapter, held.hidden[exit_layer], held.top_ids)),
        },
        "train": {
            "before": _round(agreement(head, None, train.hidden[exit_layer], train.top_ids)),
            "after": _round(agreement(head, adapter, train.hidden[exit_layer], train.top_ids)),
        },
        "params": sum(p.numel() for p in adapter.parameters()),
        "seconds": round(seconds, 1),
        **details,
    }


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def resolve_exit_adapters(
    option: str,
    loaded: Any,
    exit_layers: Sequence[int],
    prompts: Sequence[str],
    runs: Sequence[GreedyRun],
    seed: int,
    progress: bool = True,
) -> ExitAdapterFit:
    """`--exit-adapter fit|FILE`: fit adapters for `exit_layers`, or load them from a safetensors file."""
    if option == "fit":
        return fit_exit_adapters(loaded, prompts, exit_layers, seed=seed, progress=progress, runs=runs)
    from adaptive_export.loading.artifacts import load_adapters

    spec = loaded.spec
    adapters = load_adapters(Path(option), spec.hidden_size, spec.rms_norm_eps, spec.num_layers)
    return ExitAdapterFit(adapters, {"loaded_from": str(option), "exit_layers": sorted(adapters)})
