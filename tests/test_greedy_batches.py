"""Calibration's batched greedy continuations (calibration/greedy.py): prompts of different
lengths, left-padded into one batch, get the tokens a batch of one gets, in prompt order; a
row that reaches EOS ends there while the rest of its batch goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_export.calibration import greedy
from adaptive_export.calibration.greedy import greedy_sequence, greedy_with_hidden
from adaptive_export.loading.model import load_model

PROMPTS = [
    "Tell me about the sea.",
    "Hi",
    "Write a list of three fruits and say why each one is good for you.",
    "What is two plus two?",
    "Name a color.",
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):
    return load_model(str(tiny_model_dir))


def test_batches_give_the_tokens_of_a_batch_of_one(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(greedy, "GREEDY_BATCH", 3)  # two batches, one of them padded
    batched = greedy.greedy_sequences(loaded, PROMPTS, 12, progress=False)
    assert batched == [greedy_sequence(loaded, p, 12) for p in PROMPTS]
    lengths = {prompt_len for _, prompt_len in batched}
    assert len(lengths) > 1  # the prompts differ in length, so some rows were padded


def test_a_row_stops_at_eos_inside_its_batch(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = greedy_sequence(loaded, PROMPTS[0], 12)
    stop = alone[0][alone[1] + 3]  # the 4th token of the first prompt's continuation
    monkeypatch.setattr(loaded.hf_model.generation_config, "eos_token_id", stop)
    runs = greedy.greedy_continuations(loaded, PROMPTS, 12, progress=False)
    first = runs[0][1]
    assert first[-1] == stop and stop not in first[:-1] and len(first) <= 4
    for (ids, continuation), prompt in zip(runs, PROMPTS, strict=True):
        assert (ids + continuation, len(ids)) == greedy_sequence(loaded, prompt, 12)  # a batch of one stops there too
        assert len(continuation) == 12 or continuation[-1] == stop


def test_hidden_states_follow_the_continuation(loaded) -> None:
    ids, continuation, states = greedy_with_hidden(loaded, PROMPTS[1], 6)
    (run,) = greedy.greedy_runs_with_hidden(loaded, [PROMPTS[1]], 6, progress=False)
    assert (run[0], run[1]) == (ids, continuation)
    assert len(states) == loaded.spec.num_layers + 1 and states[-1].shape[1] == len(ids) + len(continuation)
    assert all(bool((a == b).all()) for a, b in zip(states, run[2], strict=True))
