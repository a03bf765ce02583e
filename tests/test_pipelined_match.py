"""Predictive Pipelined Decoding's match rates and latency model (calibration/pipeline_match.py,
calibration/pipeline_model.py): top-k membership is counted right, the model's own head at d = L
matches every greedy token, and the formulas give their hand-computed values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptive_export.calibration.pipeline_match import (
    greedy_runs,
    match_rates,
    own_head,
    top_candidates,
    topk_hits,
    trained_heads,
)
from adaptive_export.calibration.pipeline_model import StageCosts, break_even, head_layers, predict, stage_costs
from adaptive_export.graphs.adaptive import DraftHead, GatedExitAdapter
from adaptive_export.loading.model import load_model

PROMPTS = ["Tell me about the sea.", "Write a list of three fruits."]


def test_topk_hits_counts_membership_by_rank() -> None:
    # the target of row i sits at rank i + 1 (row 3: outside the top 3)
    logits = torch.tensor(
        [
            [0.0, 5.0, 4.0, 3.0, 2.0],
            [0.0, 5.0, 4.0, 3.0, 2.0],
            [0.0, 5.0, 4.0, 3.0, 2.0],
            [0.0, 5.0, 4.0, 3.0, 2.0],
        ]
    )
    targets = torch.tensor([1, 2, 3, 4])
    assert topk_hits(top_candidates(logits, 3), targets, (1, 2, 3)) == {1: 1, 2: 2, 3: 3}


def test_trimmed_candidates_name_token_ids_and_miss_outside_the_vocabulary() -> None:
    ids = torch.tensor([2, 7, 9])  # a trimmed head's columns -> token ids
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]])
    assert top_candidates(logits, 2, ids).tolist() == [[7, 9], [2, 9]]
    targets = torch.tensor([9, 4])  # 4 is not in the trimmed vocabulary: a miss at every k
    assert topk_hits(top_candidates(logits, 3, ids), targets, (1, 2, 3)) == {1: 0, 2: 1, 3: 1}


@pytest.fixture(scope="module")
def tiny_runs(tiny_model_dir: Path) -> tuple[object, list]:
    loaded = load_model(str(tiny_model_dir))
    return loaded, greedy_runs(loaded, PROMPTS, 8)


def test_own_head_at_the_last_layer_matches_every_greedy_token(tiny_runs: tuple) -> None:
    loaded, runs = tiny_runs
    layers = loaded.spec.num_layers
    rates = match_rates(runs, [layers // 2, layers], own_head(loaded))
    positions = sum(len(run.continuation) for run in runs)
    assert positions > 8 and all(r.positions == positions for r in rates)
    by = {(r.layer, r.k): r.rate for r in rates}
    assert by[(layers, 1)] == 1.0
    assert by[(layers // 2, 1)] <= by[(layers // 2, 2)] <= by[(layers // 2, 3)]
    assert by[(layers // 2, 1)] < 1.0  # a random model's middle layer disagrees somewhere


def test_untrained_full_vocabulary_head_matches_the_own_head(tiny_runs: tuple) -> None:
    """Classifier Y's path with an untrained gated block (the identity: its down projection starts
    at zero) over every token id is classifier N: the same counts at every d < L and k."""
    loaded, runs = tiny_runs
    spec = loaded.spec
    layers = [1, spec.num_layers - 1]
    heads = {
        d: DraftHead(
            d, "gated", GatedExitAdapter(spec.hidden_size, 8, spec.rms_norm_eps), torch.arange(spec.vocab_size), 1, 0.0
        )  # fmt: skip
        for d in layers
    }
    trained = match_rates(runs, layers, trained_heads(loaded, heads))
    own = match_rates(runs, layers, own_head(loaded))
    assert [r.hits for r in trained] == [r.hits for r in own]


def test_latency_and_compute_model_at_hand_values(tiny_runs: tuple) -> None:
    even = StageCosts(stage1=1.0, stage2=1.0, plain=2.0)  # free heads, d = L/2
    assert predict(even, 1.0, 1).latency == 0.5 and predict(even, 0.0, 1).latency == 1.0
    assert predict(even, 1.0, 1).compute == 1.0 and predict(even, 0.0, 3).compute == 2.5
    deep = StageCosts(stage1=20.0, stage2=10.0, plain=30.0)  # d = 2L/3: 1 - p (1 - d/L) paper-style
    assert predict(deep, 0.6, 1).latency == pytest.approx(1 - 0.6 / 3)
    assert predict(deep, 0.6, 1).latency_joined == pytest.approx((20 + 0.4 * 20) / 30)
    for costs in (even, deep, StageCosts(stage1=23.0, stage2=23.0, plain=38.0)):
        paper, joined = break_even(costs)  # at the break-even rate the latency is exactly plain's
        assert predict(costs, paper, 1).latency == pytest.approx(1.0)
        assert predict(costs, joined, 1).latency_joined == pytest.approx(1.0)
    loaded, _ = tiny_runs
    head, layers = head_layers(loaded), loaded.spec.num_layers
    assert stage_costs(loaded, 2) == StageCosts(2 + head, layers - 2 + head, layers + head)
