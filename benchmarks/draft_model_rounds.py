"""How a draft bundle's rounds should end: k and the confidence stop, against the default run.

    python -m benchmarks.draft_model_rounds --bundle B15 --draft-bundle B05 [--prompt-set chat]
        [--prompts 16] [--rounds 3:0,6:0.6] [--new-tokens 64]

One process, one Generator with the draft bundle and one without. For each prompt, every
contender runs in turn: the bundle's default run without the draft bundle, then each `k:stop`
(up to k drafts a round, ended after a draft whose own top-1 probability is below `stop`; 0 never
ends early). Interleaving spreads a neighbour's load over every contender alike. The script prints
TPOT medians and means, drafts accepted and tokens a round, on the CPU it names, and fails if any
configuration's tokens differ from the first one's: the stop must not change them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks.common import bench_parser, cpu_model, load_prompts, parse_and_pin, print_table
from benchmarks.peers import resolve_prompt_set


@dataclass
class Contender:
    name: str
    k: int = 0  # 0: the default run without the draft bundle
    stop: float = 0.0
    tpot: list[float] = field(default_factory=list)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


def parse_rounds(text: str) -> list[Contender]:
    """`3:0,6:0.6` -> a contender per k:stop pair."""
    pairs = [item.split(":") for item in text.split(",") if item]
    return [Contender(f"k={k} stop={stop}", int(k), float(stop)) for k, stop in pairs]


def main() -> None:
    parser = bench_parser(__doc__, bundle="the target bundle (the 1.5B's)")
    parser.add_argument("--draft-bundle", required=True, help="the draft bundle (the 0.5B's)")
    parser.add_argument("--prompt-set", default="chat", help="chat, edit or a .jsonl file (default: chat)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts of the set (default: 16)")
    parser.add_argument("--rounds", default="3:0,6:0.6", help="k:stop pairs to compare (default: 3:0,6:0.6)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per answer (default: 64)")
    args = parse_and_pin(parser)
    from adaptive_export.runtimes import Generator

    paired = Generator(args.bundle, threads=args.threads, draft_bundle=args.draft_bundle)
    alone = Generator(args.bundle, threads=args.threads)
    alone.backend.alternate()  # its pool must not spin while the paired Generator runs
    draft = paired.decoding.draft_model
    assert draft is not None
    prompts = load_prompts(resolve_prompt_set(parser, "qwen2.5-coder-1.5b", args.prompt_set), args.prompts)
    contenders = [Contender("default run (no draft bundle)"), *parse_rounds(args.rounds)]
    for generator in (paired, alone):
        generator.generate(prompts[0], max_new_tokens=8)  # warm-up
    for prompt in prompts:
        first: list[int] | None = None
        for c in contenders:
            if c.k:
                draft.stop_below = c.stop
                result = paired.generate(prompt, max_new_tokens=args.new_tokens, draft_len=c.k)
                spec = result.stats.speculation
                c.rounds += spec["rounds"]
                c.drafted += spec["drafted"]
                c.accepted += spec["accepted"]
                first = first or result.tokens
                if result.tokens != first:
                    raise SystemExit(f"error: {c.name} changed the tokens of {prompt[:40]!r}. Fix: report it as a bug")
            else:
                result = alone.generate(prompt, max_new_tokens=args.new_tokens)
            c.tpot.append(result.stats.tpot_ms)
    rows = [
        {
            "contender": c.name,
            "tpot_median": statistics.median(c.tpot),
            "tpot_mean": statistics.mean(c.tpot),
            "accepted": c.accepted / c.drafted if c.drafted else "",
            "tokens_a_round": (c.accepted + c.rounds) / c.rounds if c.rounds else "",
        }
        for c in contenders
    ]
    setup = f"{len(prompts)} prompts of {args.prompt_set}, {args.new_tokens} tokens"
    print(f"{cpu_model()}, {args.threads} threads, {setup}")
    print_table(rows, ["contender", "tpot_median", "tpot_mean", "accepted", "tokens_a_round"])


if __name__ == "__main__":
    main()
