"""How fast exact prompt-lookup speculation could ever be on one bundle and CPU: the bound behind
issue #37's edit-prompt targets (docs/prompt-lookup.md, "What prompt lookup can reach").

    python -m benchmarks.lookup_ceiling --bundle bundles/qwen-coder-0.5b [--prompts 16] [--tokens 160] [--save F]
    python -m benchmarks.lookup_ceiling --replay F    # the policies again over saved runs, no decoding

Greedy decoding is deterministic, so one plain run of each prompt fixes the tokens every exact
policy emits; what a policy changes is only how many rows each pass verifies. This script measures
the decode engine's pass of T rows (T = 1..9, medians), decodes each held-out coder prompt once with
two-row plain decoding (floor rounds: the rows an exact verify computes), and replays those tokens
through each round policy at the measured pass costs:
- `floor rounds`: what `--mode ar` does on two rows (one free guess per T=2 pass);
- `lookup k=4`: prompt lookup's 4-token draft on every round that has one;
- `lookup, growing k`: one guess per round (a floor round) until a round's drafts are all accepted,
  then twice as many, up to 3, drafting more than one only from a 3-token n-gram match (n-grams up
  to 4); back to one guess at the first rejection. Deterministic on the tokens, so exact;
- `oracle, two rows`: lookup drafts exactly the tokens that will be accepted, never one more: the
  bound for any gate or draft-length rule over prompt lookup at two rows (the exact setting);
- `oracle, one row`: the same with T=1 passes where nothing is drafted, which would need T=1 and
  T=k passes to round alike (they do not at accuracy 4);
- `all accepted, T=k`: every pass of T rows emits T tokens: the bound for ANY draft source.
Each is printed as the cost per token against one-row plain steps (T=1 passes), median over prompts;
the `measured` column checks the model against the same run's floor-round TPOT.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import ROOT, bench_parser, cpu_model, load_prompts, parse_and_pin, print_table

SETS = {"edit": "coder_edit_prompts.jsonl", "chat": "coder_chat_prompts.jsonl"}
MAX_DRAFTS = 8  # passes are timed up to T = MAX_DRAFTS + 1


@dataclass(frozen=True)
class Decoded:
    """One prompt's greedy run: the prompt's ids, its tokens (the first from prefill), and the
    measured floor-round and one-row TPOT."""

    prompt_ids: list[int]
    tokens: list[int]
    floor_tpot_ms: float
    plain_tpot_ms: float


@dataclass(frozen=True)
class Measured:
    """What one measuring run leaves: the CPU, the pass ms by T, and each prompt set's runs."""

    cpu: str
    pass_ms: dict[int, float]
    sets: dict[str, list[Decoded]]

    def save(self, path: str) -> None:
        sets = {name: [asdict(run) for run in runs] for name, runs in self.sets.items()}
        Path(path).write_text(json.dumps({"cpu": self.cpu, "pass_ms": self.pass_ms, "sets": sets}))

    @classmethod
    def load(cls, path: str) -> Measured:
        data = json.loads(Path(path).read_text())
        sets = {name: [Decoded(**run) for run in runs] for name, runs in data["sets"].items()}
        return cls(data["cpu"], {int(t): float(ms) for t, ms in data["pass_ms"].items()}, sets)


@dataclass(frozen=True)
class Round:
    rows: int  # T of the verify pass
    proposal: list[int]  # the tokens it verifies after `pending`


Policy = Callable[[list[int], list[int]], Round]  # (context, the tokens still to come) -> the round


def lookup(context: Sequence[int], k: int) -> list[int]:
    from adaptive_export.runtimes.drafting.prompt_lookup import lookup_ngram

    return lookup_ngram(list(context), k)


def lookup_match(context: Sequence[int], k: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """Prompt lookup's proposal and the n-gram length it matched (runtimes/drafting/prompt_lookup.py)."""
    from adaptive_export.runtimes.drafting.prompt_lookup import lookup_match as runtime_match

    return runtime_match(list(context), k, max_ngram)


def accepted(proposal: Sequence[int], future: Sequence[int]) -> int:
    count = 0
    for drafted, actual in zip(proposal, future, strict=False):
        if drafted != actual:
            break
        count += 1
    return count


def floor_rounds(context: list[int], future: list[int]) -> Round:
    return Round(2, lookup(context, 1))


def lookup_k4(context: list[int], future: list[int]) -> Round:
    proposal = lookup(context, 4)
    return Round(max(2, 1 + len(proposal)), proposal)


def growing_k(most: int = 3, sure_ngram: int = 3, max_ngram: int = 4) -> Callable[[], Policy]:
    """A fresh policy per prompt: its draft length is state (see the module docstring). `run`'s
    default on edit prompts (runtimes/drafting/prompt_lookup.py GrowingLookup, the same constants)."""

    def fresh() -> Policy:
        state = {"k": 1}

        def policy(context: list[int], future: list[int]) -> Round:
            proposal, n = lookup_match(context, state["k"], max_ngram)
            if n < sure_ngram:
                proposal = proposal[:1]
            right = accepted(proposal, future)
            state["k"] = min(most, state["k"] * 2) if proposal and right == len(proposal) else 1
            return Round(max(2, 1 + len(proposal)), proposal)

        return policy

    return fresh


def oracle(min_rows: int) -> Policy:
    def policy(context: list[int], future: list[int]) -> Round:
        proposal = lookup(context, MAX_DRAFTS)
        right = accepted(proposal, future)
        if right == 0:  # nothing would be accepted: the cheapest pass the rows allow
            return Round(min_rows, proposal[:1] if min_rows == 2 else [])
        return Round(1 + right, proposal[:right])

    return policy


POLICIES: dict[str, Callable[[], Policy]] = {  # name -> a fresh policy for each prompt
    "floor rounds (ar, two rows)": lambda: floor_rounds,
    "lookup k=4": lambda: lookup_k4,
    "lookup, growing k": growing_k(),
    "oracle lookup, two rows": lambda: oracle(2),
    "oracle lookup, one row": lambda: oracle(1),
}


def replay(decoded: Decoded, policy: Policy, cost: dict[int, float]) -> float:
    """The policy's passes over this run's tokens, in T=1 passes per emitted token."""
    tokens, context, done, passes = decoded.tokens, list(decoded.prompt_ids) + decoded.tokens[:1], 1, 0.0
    while done < len(tokens):
        future = tokens[done:]
        chosen = policy(context, future)
        emitted = accepted(chosen.proposal, future) + 1
        passes += cost[chosen.rows]
        context += future[:emitted]
        done += emitted
    return passes / max(1, len(tokens) - 1)


def decode_set(bundle: Path, prompts: list[str], tokens: int, threads: int) -> list[Decoded]:
    from adaptive_export.runtimes import Generator

    generators = {rows: Generator(bundle, decode_rows=rows, threads=threads) for rows in (1, 2)}
    generators[1].generate(prompts[0], max_new_tokens=4, mode="ar")  # warm-up
    generators[2].generate(prompts[0], max_new_tokens=4, mode="ar")
    runs = []
    for prompt in prompts:
        floor = generators[2].generate(prompt, max_new_tokens=tokens, mode="ar")
        plain = generators[1].generate(prompt, max_new_tokens=tokens, mode="ar")
        runs.append(Decoded(floor.prompt_ids, floor.tokens, floor.stats.tpot_ms, plain.stats.tpot_ms))
    return runs


def rows_for(name: str, runs: list[Decoded], cost: dict[int, float]) -> list[dict[str, object]]:
    table = []
    for policy_name, fresh in POLICIES.items():
        ratios = [replay(run, fresh(), cost) for run in runs]
        measured: float | str = ""
        if fresh() is floor_rounds and all(run.plain_tpot_ms for run in runs):
            measured = round(statistics.median(run.floor_tpot_ms / run.plain_tpot_ms for run in runs), 3)
        table.append(
            {
                "prompts": name,
                "policy": policy_name,
                "x plain (median)": round(statistics.median(ratios), 3),
                "best prompt": round(min(ratios), 3),
                "measured": measured,
            }
        )
    return table


def measure(args: argparse.Namespace) -> Measured:
    from adaptive_export.calibration.verify_cost import measure_verify_costs

    bundle = Path(args.bundle)
    pass_ms = measure_verify_costs(bundle, max_k=MAX_DRAFTS, repeats=15, threads=args.threads).pass_ms
    sets = {
        name: decode_set(bundle, load_prompts(ROOT / "samples" / file, args.prompts), args.tokens, args.threads)
        for name, file in SETS.items()
    }
    return Measured(f"{cpu_model()}, {args.threads} threads, bundle {bundle}", dict(pass_ms), sets)


def report(measured: Measured) -> None:
    pass_ms = measured.pass_ms
    cost = {rows: ms / pass_ms[1] for rows, ms in pass_ms.items()}
    print(measured.cpu)
    passes = [
        {"T": t, "ms": round(ms, 2), "vs T=1": round(cost[t], 3), "all accepted, x plain": round(cost[t] / t, 3)}
        for t, ms in sorted(pass_ms.items())
    ]
    print_table(passes, ["T", "ms", "vs T=1", "all accepted, x plain"])
    table = [row for name, runs in measured.sets.items() for row in rows_for(name, runs, cost)]
    print_table(table, ["prompts", "policy", "x plain (median)", "best prompt", "measured"])


def main() -> None:
    what = "the bundle to measure (a default `adaptive-export build` of a coder model)"
    parser = bench_parser(__doc__, bundle=what, bundle_required=False)
    parser.add_argument("--prompts", type=int, default=16, help="prompts of each set (default: 16, all)")
    parser.add_argument("--tokens", type=int, default=160, help="greedy tokens per prompt (default: 160)")
    parser.add_argument("--save", metavar="FILE", help="also write the pass costs and the decoded runs here (JSON)")
    parser.add_argument("--replay", metavar="FILE", help="replay the policies over runs saved with --save instead")
    args = parse_and_pin(parser)
    if args.replay is None and args.bundle is None:
        parser.error("pass --bundle DIR to measure, or --replay FILE")
    measured = Measured.load(args.replay) if args.replay else measure(args)
    if args.save:
        measured.save(args.save)
    report(measured)


if __name__ == "__main__":
    main()
