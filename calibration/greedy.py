"""The full model's greedy continuations of many prompts, a batch at a time.

Calibration (routers, the draft vocabulary and training text, exit adapters, speculation and
pipelined match rates) needs the model's own greedy continuation of each calibration prompt.
One `generate` per prompt runs a batch of one: on a CPU a decode step is bound by reading the
weights, so left-padded batches of GREEDY_BATCH prompts of similar length cost little more per
step than one prompt. Batched sums may round differently from a batch of one, so a near-tie may
resolve the other way: these continuations are calibration data, never a reference
(exporter/check.py's reference decodes one prompt at a time).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from adaptive_export.loading.prompts import hf_prompt_ids

GREEDY_BATCH = 16


def greedy_continuations(
    loaded: Any, prompts: Sequence[str], new_tokens: int, desc: str = "greedy continuations", progress: bool = True
) -> list[tuple[list[int], list[int]]]:
    """Per prompt, in order: (its chat-template ids, the greedy continuation: `new_tokens`, fewer at EOS)."""
    ids = [hf_prompt_ids(loaded.tokenizer, p) for p in prompts]
    by_length = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # little padding within a batch
    out: list[list[int]] = [[] for _ in ids]
    with tqdm(total=len(ids), desc=desc, unit="prompt", disable=not progress) as bar:
        for start in range(0, len(by_length), GREEDY_BATCH):
            batch = by_length[start : start + GREEDY_BATCH]
            for index, tokens in zip(batch, generate_batch(loaded, [ids[i] for i in batch], new_tokens), strict=True):
                out[index] = tokens
            bar.update(len(batch))
    return list(zip(ids, out, strict=True))


def greedy_sequences(
    loaded: Any, prompts: Sequence[str], new_tokens: int, desc: str = "greedy continuations", progress: bool = True
) -> list[tuple[list[int], int]]:
    """Per prompt: (its ids + the greedy continuation, the prompt's length)."""
    return [(p + c, len(p)) for p, c in greedy_continuations(loaded, prompts, new_tokens, desc, progress)]


def greedy_sequence(loaded: Any, prompt: str, new_tokens: int) -> tuple[list[int], int]:
    """`greedy_sequences` of one prompt: a batch of one, no padding."""
    return greedy_sequences(loaded, [prompt], new_tokens, progress=False)[0]


def greedy_with_hidden(loaded: Any, prompt: str, new_tokens: int) -> tuple[list[int], list[int], Any]:
    """`greedy_runs_with_hidden` of one prompt."""
    return next(greedy_runs_with_hidden(loaded, [prompt], new_tokens, progress=False))


def greedy_runs_with_hidden(
    loaded: Any, prompts: Sequence[str], new_tokens: int, desc: str = "greedy continuations", progress: bool = True
) -> Iterator[tuple[list[int], list[int], Any]]:
    """(prompt ids, continuation, per-layer hidden states of both), one prompt at a time after the
    batched continuations: the states of one sequence are in memory at once."""
    for ids, continuation in greedy_continuations(loaded, prompts, new_tokens, desc, progress):
        yield ids, continuation, hidden_states(loaded, ids + continuation)


def hidden_states(loaded: Any, ids: list[int]) -> Any:
    """The full model's hidden states (embeddings, then each layer's output) over `ids`."""
    import torch

    with torch.no_grad():
        return loaded.hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def generate_batch(loaded: Any, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of left-padded prompts, each cut after its first EOS (what a batch of
    one returns: generate pads a finished row until the whole batch stops)."""
    import torch

    model = loaded.hf_model
    pad = loaded.tokenizer.pad_token_id or 0
    width = max(len(ids) for ids in batch)
    inputs = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return [until_stop(row[width:], stops) for row in out.tolist()]


def until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """`tokens` up to and including the first stop token."""
    for position, token in enumerate(tokens):
        if token in stops:
            return tokens[: position + 1]
    return tokens
