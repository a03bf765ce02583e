"""The latency/compute model of Predictive Pipelined Decoding, evaluated at measured match rates
(docs/pipelined.md "Match rates and the paper's model").

Our reading of the paper's model (Yang et al., its equations 3, 5 and 6: 0.63-0.89 of greedy
latency for 1.6-5x the compute), in the two stages this project runs: stage 1 = layers [0, d)
plus the classifier that ranks the k guesses, stage 2 = layers [d, L) plus the final head. Costs
are in decoder-layer equivalents (parameters read per token: decode on a CPU is bound by them),
so the LM head counts (V x H parameters: about 8 SmolLM2 layers, 37 Gemma 3 270M layers):

    s1 = d + c_classifier        s2 = (L - d) + c_head        C = L + c_head   (a plain token)

The guess for token t+1 starts its stage 1 when token t's stage 1 ends, beside t's stage 2.
- latency (paper-style, wrong guesses abandoned the moment the final token is known):
      (p * max(s1, s2) + (1 - p) * (s1 + s2)) / C
  a match overlaps the next token's stage 1 with this one's stage 2; a miss starts over.
  Without heads and with d >= L/2 this is 1 - p * (1 - d/L); at d = L/2 it is 1 - p * d/L.
- latency, joined stages (runtimes/pipelined.py, k = 1: both stages joined every token, a miss
  reruns stage 1 for the true token):   (max(s1, s2) + (1 - p) * s1) / C
- compute per token (each of the k guesses runs its whole stage 1, kept or not; a match makes
  one of them the token's own stage 1, a miss runs stage 1 again):
      (s2 + k * s1 + (1 - p) * s1) / C      (without heads: 1 + (k - p) * d/L)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptive_export.calibration.draft_training import layer_params


@dataclass(frozen=True)
class StageCosts:
    """A pipelined token's two stages and a plain token, in decoder-layer equivalents."""

    stage1: float  # layers [0, d) + the classifier ranking the guesses
    stage2: float  # layers [d, L) + the final head
    plain: float  # layers [0, L) + the final head

    @property
    def share(self) -> float:
        """Stage 1's share of a plain token (d/L when the heads are free)."""
        return self.stage1 / self.plain


@dataclass(frozen=True)
class PipelinePrediction:
    """Per token, relative to plain greedy decoding."""

    latency: float  # paper-style: wrong guesses abandoned at once
    latency_joined: float  # this runtime's joined stages, k = 1
    compute: float  # k guesses, each paying its stage 1


def predict(costs: StageCosts, p: float, k: int) -> PipelinePrediction:
    """The model above at match rate p (the final token among the k guesses)."""
    s1, s2, plain = costs.stage1, costs.stage2, costs.plain
    return PipelinePrediction(
        latency=(p * max(s1, s2) + (1 - p) * (s1 + s2)) / plain,
        latency_joined=(max(s1, s2) + (1 - p) * s1) / plain,
        compute=(s2 + k * s1 + (1 - p) * s1) / plain,
    )


def break_even(costs: StageCosts) -> tuple[float, float]:
    """The match rates above which pipelining is faster than plain decoding: (paper-style, joined stages).
    From the latencies above: p > (s1 + s2 - C) / min(s1, s2) and p > (max(s1, s2) + s1 - C) / s1."""
    s1, s2, plain = costs.stage1, costs.stage2, costs.plain
    return (s1 + s2 - plain) / min(s1, s2), (max(s1, s2) + s1 - plain) / s1


def head_layers(loaded: Any) -> float:
    """The LM head's cost in decoder layers (V x H parameters over one layer's)."""
    spec = loaded.spec
    return spec.vocab_size * spec.hidden_size / layer_params(loaded)


def stage_costs(loaded: Any, layer: int, classifier_params: int | None = None) -> StageCosts:
    """Costs at exit layer d; `classifier_params` the trained classifier's (block + trimmed rows),
    None for the model's own head."""
    head = head_layers(loaded)
    classifier = head if classifier_params is None else classifier_params / layer_params(loaded)
    num_layers = loaded.spec.num_layers
    return StageCosts(stage1=layer + classifier, stage2=num_layers - layer + head, plain=num_layers + head)


def trained_classifier_params(draft_head: Any, hidden_size: int) -> int:
    """A trained draft exit's parameters read per token: its block and its trimmed head rows."""
    block = sum(p.numel() for p in draft_head.block.parameters())
    return int(block + draft_head.ids.numel() * hidden_size)
