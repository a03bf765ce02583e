"""Would a draft head over a reduced vocabulary pay on SmolLM2? (issue #5, draft sources)

    python -m benchmarks.reduced_vocab [--sizes 2048,4096,8192,16384] [--threads 2]

The LM head is 28M of SmolLM2's 135M parameters, so every drafted token pays for a matmul
over 49,152 rows. A draft head restricted to the N most frequent tokens is cheaper; the
verifier keeps the full head, so output is unchanged, but a draft can only be accepted
when the full model's token lies inside the reduced set. Measured here, per N:
- coverage: share of the full model's greedy tokens (chat continuations of the held-out
  prompts in samples/eval_prompts.jsonl and samples/spec_prompts.jsonl) that lie in the set;
  the set is the tokens seen in the calibration continuations (samples/calib_prompts.jsonl)
  plus the lowest BPE ranks (merge order, a proxy for corpus frequency) up to N;
- head ms: the median time of the head matmul [1, H] x [H, N] in torch (fp32, pinned
  threads), against the full vocabulary;
- head cost in decoder-layer equivalents (parameters), the unit of calibration's cost model.
Coverage bounds the acceptance a reduced draft head can keep.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import DEFAULT_PROMPTS, ROOT, load_prompts, median_of, pin_threads, print_table

NEW_TOKENS = 32


def head_ms(weight, rows: int, repeat: int = 200) -> float:
    import torch

    w = weight[:rows].contiguous()
    x = torch.randn(1, w.shape[1])
    with torch.no_grad():
        for _ in range(10):
            x @ w.T
        samples = []
        for _ in range(repeat):
            started = time.perf_counter()
            x @ w.T
            samples.append((time.perf_counter() - started) * 1e3)
    return median_of(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes", default="2048,4096,8192,16384", help="reduced vocabulary sizes N to measure (comma-separated)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the head timing (default: 2)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    pin_threads(args.threads)
    import torch

    from adaptive_export.calibration.greedy import greedy_sequence
    from adaptive_export.loading.model import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2")
    seen: set[int] = set()
    for prompt in load_prompts(ROOT / "samples" / "calib_prompts.jsonl"):
        ids, _ = greedy_sequence(loaded, prompt, NEW_TOKENS)
        seen.update(ids)
    held_out: list[int] = []
    for prompt in load_prompts(DEFAULT_PROMPTS) + load_prompts(ROOT / "samples" / "spec_prompts.jsonl"):
        ids, prompt_len = greedy_sequence(loaded, prompt, NEW_TOKENS)
        held_out.extend(ids[prompt_len:])
    weight = loaded.hf_model.lm_head.weight.detach()
    vocab = weight.shape[0]
    layer_params = sum(p.numel() for p in loaded.hf_model.model.layers[0].parameters())
    full_ms = head_ms(weight, vocab)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")] + [vocab]:
        chosen = set(seen) if size < vocab else set(range(vocab))
        rank = 0
        while len(chosen) < size and rank < vocab:
            chosen.add(rank)
            rank += 1
        coverage = sum(t in chosen for t in held_out) / len(held_out)
        ms = head_ms(weight, len(chosen)) if size < vocab else full_ms
        rows.append(
            {
                "vocab": len(chosen),
                "coverage": coverage,
                "head_ms": ms,
                "head_vs_full": ms / full_ms,
                "head_layers": len(chosen) * weight.shape[1] / layer_params,
            }
        )
    print(
        f"SmolLM2-135M LM head: {vocab} x {weight.shape[1]}; {len(held_out)} held-out greedy tokens; "
        f"{len(seen)} distinct tokens in the calibration sequences; {args.threads} threads"
    )
    print_table(rows, ["vocab", "coverage", "head_ms", "head_vs_full", "head_layers"])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
