"""Decode speed of a bundle against HF transformers greedy `generate`, in one run.

    python benchmarks/decode.py --bundle bundles/smollm2 [--threads 2] [--repeat 3]

Both sides decode the same chat-formatted prompt ids greedily for the same number of
new tokens (EOS ignored by forcing min_new_tokens), with the same thread count.
Prints medians over repetitions (one warm-up excluded) and the ratio bundle / HF.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import hf_generate_timer, load_prompts, pin_threads, print_table, timed_runs


def bench_hf(model, prompt_ids: list[int], new_tokens: int, repeat: int) -> dict[str, float]:
    run = hf_generate_timer(model, new_tokens)

    def once() -> dict[str, float]:
        prefill, total, _ = run(prompt_ids)  # generate = prefill + (new_tokens - 1) decode steps
        return {"prefill_ms": prefill * 1e3, "tpot_ms": max(total - prefill, 0.0) * 1e3 / (new_tokens - 1)}

    return timed_runs(once, repeat)


def bench_bundle(generator, prompt_ids: list[int], new_tokens: int, repeat: int, **kwargs) -> dict[str, float]:
    eos = generator.codec.eos_ids
    generator.codec.eos_ids = set()  # decode exactly new_tokens, like min_new_tokens on the HF side

    def once() -> dict[str, float]:
        stats = generator.generate(prompt_ids, max_new_tokens=new_tokens, **kwargs).stats
        return {"prefill_ms": stats.prefill_ms, "tpot_ms": stats.tpot_ms}

    try:
        return timed_runs(once, repeat)
    finally:
        generator.codec.eos_ids = eos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True, help="bundle directory built from --model")
    parser.add_argument("--model", default="smollm2", help="HF model for the baseline (default: smollm2)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every contender (default: 2)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed repetitions per prompt (median), after one warm-up"
    )
    parser.add_argument(
        "--prompts", type=int, default=3, help="how many prompts of samples/eval_prompts.jsonl (default: 3)"
    )
    args = parser.parse_args()
    pin_threads(args.threads)

    from adaptive_export.loading.model import load_model
    from adaptive_export.runtimes import Generator

    generator = Generator(Path(args.bundle), threads=args.threads)
    loaded = load_model(args.model)
    rows = []
    for prompt in load_prompts(limit=args.prompts):
        ids = generator.codec.encode(prompt)
        hf = bench_hf(loaded.hf_model, ids, args.new_tokens, args.repeat)
        ours = bench_bundle(generator, ids, args.new_tokens, args.repeat, config="full")
        rows.append(
            {
                "prompt": prompt[:28],
                "tokens": len(ids),
                "hf_prefill_ms": hf["prefill_ms"],
                "bundle_prefill_ms": ours["prefill_ms"],
                "hf_tpot_ms": hf["tpot_ms"],
                "bundle_tpot_ms": ours["tpot_ms"],
                "tpot_ratio": ours["tpot_ms"] / hf["tpot_ms"],
            }
        )
    from benchmarks.common import median_of

    rows.append({"prompt": "MEDIAN", **{k: median_of([r[k] for r in rows]) for k in rows[0] if k != "prompt"}})
    print(f"threads={args.threads}, new_tokens={args.new_tokens}, repeat={args.repeat} (medians), fp32")
    print_table(
        rows, ["prompt", "tokens", "hf_prefill_ms", "bundle_prefill_ms", "hf_tpot_ms", "bundle_tpot_ms", "tpot_ratio"]
    )


if __name__ == "__main__":
    main()
