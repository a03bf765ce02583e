"""Match rates for Predictive Pipelined Decoding (docs/pipelined.md "Match rates and the paper's model").

Why: a pipelined token saves work only when the final greedy token is among the top-k guesses
taken at an intermediate layer d (the paper's p_correct). Measured as the paper defines it,
teacher-forced over the model's own greedy continuations: for each continuation token t_j, the
hidden state h_d at the position that predicts it goes through a classifier, and a hit is t_j
among that classifier's k highest-scoring token ids.

Classifiers (the paper's Table 2 column "trained"):
- "N": the model's own final norm + LM head on h_d (`own_head`);
- "Y": a head trained for layer d: the trained draft exit's block + VocabTrim head
  (calibration/draft_training.py; `trained_heads`); a token outside its trimmed vocabulary is a miss.

HF's last hidden state already has the final norm applied, so at d = L only the LM head is applied:
classifier N at d = L is the model itself and matches every greedy token at k = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adaptive_export.calibration.draft_training import TrimmedDraft
from adaptive_export.calibration.greedy import greedy_runs_with_hidden
from adaptive_export.graphs.adaptive import DraftHead
from adaptive_export.graphs.layers import Head

KS = (1, 2, 3)

# (layer d, hidden state at the predicting positions [N, H], k) -> [N, k] token ids, best first
Classifier = Callable[[int, Tensor, int], Tensor]


@dataclass(frozen=True)
class GreedyRun:
    """One prompt's greedy continuation, teacher-forced once: every layer's hidden states."""

    prompt_len: int
    continuation: tuple[int, ...]
    hidden: tuple[Tensor, ...]  # index = layer (0: embeddings, L: after the final norm), each [T, H]

    def at(self, layer: int) -> Tensor:
        """h_layer at the positions that predict the continuation's tokens, [len(continuation), H]."""
        start = self.prompt_len - 1
        return self.hidden[layer][start : start + len(self.continuation)]

    @property
    def targets(self) -> Tensor:
        return torch.tensor(self.continuation, dtype=torch.long)


@dataclass(frozen=True)
class MatchRate:
    """How often the final greedy token is among the top-k guesses at layer d."""

    layer: int
    k: int
    hits: int
    positions: int

    @property
    def rate(self) -> float:
        return self.hits / self.positions if self.positions else float("nan")


def greedy_runs(loaded: Any, prompts: Sequence[str], new_tokens: int) -> list[GreedyRun]:
    """Each prompt's greedy continuation of `new_tokens` (fewer at EOS) with its hidden states."""
    return [
        GreedyRun(len(ids), tuple(continuation), tuple(s[0].float() for s in states))
        for ids, continuation, states in greedy_runs_with_hidden(loaded, prompts, new_tokens, "greedy runs")
    ]


def top_candidates(logits: Tensor, k: int, ids: Tensor | None = None) -> Tensor:
    """[N, k] token ids of the k highest logits, best first; `ids` names a trimmed head's columns."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    return top if ids is None else ids[top]


def topk_hits(candidates: Tensor, targets: Tensor, ks: Sequence[int] = KS) -> dict[int, int]:
    """Per k, the positions whose target is among the first k of its candidates (ranked best first)."""
    found = candidates == targets[:, None]
    return {k: int(found[:, :k].any(dim=-1).sum()) for k in ks}


def own_head(loaded: Any) -> Classifier:
    """Classifier N: the shared final norm + LM head on h_d (only the LM head at d = L, already normed)."""
    head, last = Head(loaded.hf_model, loaded.spec), loaded.spec.num_layers

    def classify(layer: int, hidden: Tensor, k: int) -> Tensor:
        with torch.no_grad():
            logits = head.logits(hidden) if layer == last else head(hidden)
        return top_candidates(logits, k)

    return classify


def trained_heads(loaded: Any, heads: dict[int, DraftHead]) -> Classifier:
    """Classifier Y: per layer d, the trained draft exit for d (block, final norm, trimmed head rows)."""
    shared = Head(loaded.hf_model, loaded.spec)
    drafts = {d: TrimmedDraft(h.block.float().eval(), shared, h.ids) for d, h in heads.items()}

    def classify(layer: int, hidden: Tensor, k: int) -> Tensor:
        with torch.no_grad():
            return top_candidates(drafts[layer](hidden), k, heads[layer].ids)

    return classify


def match_rates(
    runs: Sequence[GreedyRun], layers: Sequence[int], classify: Classifier, ks: Sequence[int] = KS
) -> list[MatchRate]:
    """Top-k match rate per (layer, k) over every continuation token of every run."""
    rates = []
    for layer in layers:
        hits = dict.fromkeys(ks, 0)
        positions = 0
        for run in runs:
            if not run.continuation:
                continue
            found = topk_hits(classify(layer, run.at(layer), max(ks)), run.targets, ks)
            hits = {k: hits[k] + found[k] for k in ks}
            positions += len(run.continuation)
        rates += [MatchRate(layer, k, hits[k], positions) for k in ks]
    return rates
