"""VocabTrim: the token ids a precision draft's reduced LM head scores (`build --draft-vocab N`).

A draft step pays the whole LM head: 28M of SmolLM2's 135M parameters, 168M of Gemma 3
270M's. A draft can only be accepted when the verifier's token is one the draft can name, so
the head keeps the tokens the model itself writes: the special tokens, then the tokens of its
own greedy continuations of the calibration prompts by frequency, then those of the prompts
(answers copy them), then the lowest ids (BPE merge order, a proxy for corpus frequency). The
verifier keeps the full head, so output is unchanged; coverage on held-out prompts (every
5th) bounds the acceptance the trim keeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from adaptive_export.runtimes.errors import UsageError

CONTINUATION_TOKENS = 48  # greedy tokens per calibration prompt
HELD_OUT_EVERY = 5


def ranked_ids(special: Iterable[int], continuations: Counter[int], prompts: Counter[int], vocab: int) -> list[int]:
    """Every id once, in the order the reduced head keeps them."""

    def by_count(counts: Counter[int]) -> list[int]:
        return sorted(counts, key=lambda token: (-counts[token], token))

    order: dict[int, None] = dict.fromkeys(t for t in special if 0 <= t < vocab)
    for token in (*by_count(continuations), *by_count(prompts), *range(vocab)):
        order.setdefault(token, None)
    return list(order)


def coverage(kept: set[int], tokens: Sequence[int]) -> float:
    return round(sum(t in kept for t in tokens) / max(len(tokens), 1), 4)


def plan_draft_vocab(
    loaded: Any, prompts: Sequence[str], size: int, progress: bool = True
) -> tuple[Any, dict[str, Any]]:
    """(the sorted int64 ids of a `size`-token draft head, calibration.json's 'draft_vocab' entry)."""
    import torch

    from adaptive_export.calibration.greedy import greedy_sequences

    vocab = loaded.spec.vocab_size
    if not 0 < size < vocab:
        raise UsageError(
            f"--draft-vocab {size} is not below this model's vocabulary of {vocab} tokens",
            f"use a size such as {min(8192, vocab // 4)}, or drop --draft-vocab for the full head",
        )
    continuations: Counter[int] = Counter()
    prompt_ids: Counter[int] = Counter()
    held_out: list[int] = []
    runs = greedy_sequences(loaded, prompts, CONTINUATION_TOKENS, "draft vocabulary", progress)
    for index, (ids, prompt_len) in enumerate(runs):
        if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            held_out.extend(ids[prompt_len:])
            continue
        continuations.update(ids[prompt_len:])
        prompt_ids.update(ids[:prompt_len])
    special = getattr(loaded.tokenizer, "all_special_ids", None) or []
    kept = ranked_ids(special, continuations, prompt_ids, vocab)[:size]
    chosen = set(kept)
    report = {
        "size": size,
        "vocab_size": vocab,
        "prompts": len(prompts),
        "new_tokens": CONTINUATION_TOKENS,
        "distinct_continuation_tokens": len(continuations),
        "coverage_train": coverage(chosen, [t for t, n in continuations.items() for _ in range(n)]),
        "coverage_held_out": coverage(chosen, held_out),
    }
    return torch.tensor(sorted(chosen), dtype=torch.int64), report
