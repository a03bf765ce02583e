"""Exact speculation at accuracy 4: what decoding two rows at least costs and earns on one bundle,
in one process, on the CPU at hand (docs/speculation.md, "Exact speculation at accuracy 4").

    python -m benchmarks.two_rows --bundle bundles/smollm2-acc4 [--prompts 10] [--repeat 3] [--json F]

Prints the decode engine's pass of T rows against T=1 (median ms and ratio); whether passes of two
rows reproduce one T=9 pass and T=1 passes do not (max |logit| difference, fixed pseudo-random
tokens); and, on the chat prompts of samples/eval_prompts.jsonl and the rewrite prompts of
samples/spec_prompts.jsonl (those starting "Rewrite", "Repeat", "Summarize", ...), or with `--prompt-sets coder` the
chat and edit prompts of samples/coder_chat_prompts.jsonl and coder_edit_prompts.jsonl, greedy, the median TPOT of
- `default`: what `run` does: the rows and policy chosen at prefill (runtimes/decode_policy.py), --mode auto,
- `ar-1row`: plain decoding with T=1 steps (the bundle's plain decoding without min_decode_rows),
- `ar-2rows`: plain decoding of floor rounds (one free guess per step, T=2),
- `auto-2rows`: `--mode auto` over floor rounds (prompt lookup growing from one draft a round),
- `gated-2rows`: `--mode auto --draft-len 4` over floor rounds (prompt lookup at k=4, gated by timing),
- `spec-2rows`: prompt lookup at k=4 over floor rounds,
- `eagle-2rows` (`--modes`, on a bundle built with `--eagle-head N`): the EAGLE head's guess every
  round (`--draft eagle`) over floor rounds (where the bundle has the head, every floor round above
  guesses with it too when prompt lookup has no match),
each against ar-1row, with how many prompts' tokens equal ar-2rows' (the exactness claim) and
ar-1row's (which rounds its rows differently).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, bench_parser, cpu_model, load_prompts, parse_and_pin, print_table
from benchmarks.speculative import rewrite_prompts

SETS = {"chat": lambda: load_prompts(ROOT / "samples" / "eval_prompts.jsonl"), "rewrite": rewrite_prompts}
CODER_SETS = {  # --prompt-sets coder: held apart from calibration (samples/coder_*_prompts.jsonl)
    "coder-chat": lambda: load_prompts(ROOT / "samples" / "coder_chat_prompts.jsonl"),
    "coder-edit": lambda: load_prompts(ROOT / "samples" / "coder_edit_prompts.jsonl"),
}
MODES = {  # name -> (decode rows, generate keyword arguments); rows None: chosen at prefill (the default run)
    "default": (None, {"mode": "auto"}),
    "ar-1row": (1, {"mode": "ar"}),
    "ar-2rows": (2, {"mode": "ar"}),
    "auto-2rows": (2, {"mode": "auto"}),
    "gated-2rows": (2, {"mode": "auto", "draft_len": 4}),
    "spec-2rows": (2, {"mode": "spec", "draft": "prompt_lookup", "draft_len": 4}),
    "eagle-2rows": (2, {"mode": "spec", "draft": "eagle"}),  # a bundle built with --eagle-head only
}
DEFAULT_MODES = tuple(mode for mode in MODES if not mode.startswith("eagle"))


@dataclass(frozen=True)
class ModeRow:
    """One mode on one prompt set: median TPOT, its ratio to ar-1row, agreement counts."""

    prompts: str
    mode: str
    tpot_ms: float
    vs_ar_1row: float
    same_as_ar_2rows: str
    same_as_ar_1row: str
    tokens_per_pass: float


def pass_costs(bundle: Path, threads: int) -> list[dict[str, Any]]:
    from adaptive_export.calibration.verify_cost import measure_verify_costs

    costs = measure_verify_costs(bundle, max_k=8, repeats=15, threads=threads)
    return [{"T": t, "ms": ms, "vs T=1": round(ms / costs.pass_ms[1], 3)} for t, ms in sorted(costs.pass_ms.items())]


def exactness(bundle: Path, threads: int) -> list[dict[str, Any]]:
    from adaptive_export.calibration.verify_exactness import measure_verify_exactness

    rows = []
    for plain_rows in (1, 2):
        measured = measure_verify_exactness(bundle, max_k=8, threads=threads, plain_rows=plain_rows)
        rows.append({"plain pass rows": plain_rows, **asdict(measured), "exact": measured.exact})
    return rows


def run_mode(generators: Generators, mode: str, prompt: str, tokens: int) -> tuple[float, list[int], float]:
    """TPOT ms, the tokens, and tokens per verify pass (rounds) of one greedy run."""
    rows, arguments = MODES[mode]
    result = generators[rows].generate(prompt, max_new_tokens=tokens, **arguments)
    rounds = result.stats.speculation.get("rounds") or max(1, len(result.tokens) - 1)
    return result.stats.tpot_ms, result.tokens, (len(result.tokens) - 1) / rounds


Generators = dict[int | None, Any]  # decode rows (None: chosen at prefill) -> Generator


def measure_set(
    generators: Generators, name: str, prompts: list[str], tokens: int, repeat: int, modes: tuple[str, ...]
) -> list[ModeRow]:
    """Every mode on every prompt, modes interleaved within each repetition (one warm-up pass)."""
    tpot: dict[str, list[float]] = {mode: [] for mode in modes}
    per_pass: dict[str, list[float]] = {mode: [] for mode in modes}
    outputs: dict[str, list[list[int]]] = {mode: [] for mode in modes}
    for prompt in prompts:
        for mode in modes:
            run_mode(generators, mode, prompt, tokens)
        last: dict[str, list[int]] = {}
        for _ in range(repeat):
            for mode in modes:
                ms, last[mode], passes = run_mode(generators, mode, prompt, tokens)
                tpot[mode].append(ms)
                per_pass[mode].append(passes)
        for mode in modes:
            outputs[mode].append(last[mode])
    base = statistics.median(tpot["ar-1row"])
    return [mode_row(name, mode, tpot, per_pass, outputs, base) for mode in modes]


def mode_row(name: str, mode: str, tpot: Any, per_pass: Any, outputs: Any, base: float) -> ModeRow:
    def same(reference: str) -> str:
        count = sum(a == b for a, b in zip(outputs[mode], outputs[reference], strict=True))
        return f"{count}/{len(outputs[mode])}"

    median = statistics.median(tpot[mode])
    per = round(statistics.median(per_pass[mode]), 2)
    return ModeRow(name, mode, round(median, 2), round(median / base, 3), same("ar-2rows"), same("ar-1row"), per)


def main() -> None:
    parser = bench_parser(__doc__, bundle="the bundle to measure (accuracy 4: `adaptive-export build smollm2`)")
    parser.add_argument("--prompts", type=int, default=10, help="prompts of each set (default: 10)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per run (default: 32)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions per prompt and mode (default: 3)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON here")
    parser.add_argument(
        "--prompt-sets",
        choices=("smollm2", "coder"),
        default="smollm2",
        help="smollm2: eval chat + rewrite prompts (default); coder: samples/coder_chat and coder_edit prompts",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated modes to run, ar-1row and ar-2rows always among them (of {', '.join(MODES)}; "
        f"default: {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument("--sets", default=None, help="comma-separated prompt sets of --prompt-sets (default: all)")
    args = parse_and_pin(parser)
    from adaptive_export.runtimes import Generator

    asked = {mode for mode in args.modes.split(",") if mode} | {"ar-1row", "ar-2rows"}
    unknown = asked - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    modes = tuple(mode for mode in MODES if mode in asked)

    bundle = Path(args.bundle)
    print(f"{cpu_model()}, {args.threads} threads, bundle {bundle}")
    costs, exact = pass_costs(bundle, args.threads), exactness(bundle, args.threads)
    print_table(costs, ["T", "ms", "vs T=1"])
    print_table(exact, ["plain pass rows", "max_logit_diff", "logit_scale", "top1_flips", "exact"])
    generators = {rows: Generator(bundle, decode_rows=rows, threads=args.threads) for rows in (None, 1, 2)}
    sets = CODER_SETS if args.prompt_sets == "coder" else SETS
    chosen = args.sets.split(",") if args.sets else list(sets)
    if set(chosen) - set(sets):
        parser.error(f"unknown prompt sets {sorted(set(chosen) - set(sets))}; choose from {', '.join(sets)}")
    rows = [
        row
        for name in chosen
        for row in measure_set(generators, name, sets[name]()[: args.prompts], args.tokens, args.repeat, modes)
    ]
    print_table([asdict(r) for r in rows], list(ModeRow.__dataclass_fields__))
    if args.json:
        report = {"cpu": cpu_model(), "threads": args.threads, "pass_costs": costs, "exactness": exact}
        Path(args.json).write_text(json.dumps({**report, "modes": [asdict(r) for r in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
