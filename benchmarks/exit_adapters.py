"""Exit adapters on SmolLM2: early-exit agreement with the full model before (raw exit) and
after fitting, on held-out and train prompts, and what it does to simulated speculation.

    python -m benchmarks.exit_adapters [--exits 15,20,24,28] [--epochs 8] [--json out.json]

Data and fitting are exactly those of `build --speculate auto --exit-adapter fit`
(calibration/exit_adapters.py): the model's greedy continuations of the calibration prompts,
every 5th prompt held out. The speculation columns simulate greedy early-exit drafting on
the HELD-OUT prompts only (tokens per round, best k, expected speed-up with the build's
layer-equivalent cost model), raw exit vs through the adapter.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, pin_threads, print_table


def parse_args() -> argparse.Namespace:
    from adaptive_export.calibration.exit_adapters import DEFAULT_EPOCHS, DEFAULT_RANK

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="model directory, .gguf, or 'smollm2' (default)")
    parser.add_argument(
        "--calib",
        default=str(ROOT / "samples" / "calib_prompts.jsonl"),
        help="JSONL prompts (default: samples/calib_prompts.jsonl)",
    )
    parser.add_argument("--exits", default="15,20,24,28", help="comma-separated exit layers E (default: 15,20,24,28)")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK, help=f"adapter rank (default: {DEFAULT_RANK})")
    parser.add_argument(
        "--epochs", type=int, default=DEFAULT_EPOCHS, help=f"epochs per exit (default: {DEFAULT_EPOCHS})"
    )
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default: 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--json", default=None, help="write the fit report and the table here")
    return parser.parse_args()


def best_speedup(measured: dict[str, Any], exit_layer: int, layers: int) -> tuple[int, float, float]:
    """(k, tokens per round, expected speed-up) of the best draft length at this exit."""
    from adaptive_export.calibration.drafts.early_exit import early_exit_speedup

    rows = [
        (int(key.split(":")[1]), tokens)
        for key, tokens in measured["early_exit_tokens_per_round"].items()
        if int(key.split(":")[0]) == exit_layer
    ]
    scored = [
        (
            k,
            t,
            early_exit_speedup(t, exit_layer, k, layers, measured["head_cost_layers"], measured["adapter_cost_layers"]),
        )
        for k, t in rows
    ]
    return max(scored, key=lambda r: r[2])


def exit_row(e: int, report: dict[str, Any], raw: dict[str, Any], adapted: dict[str, Any], layers: int) -> dict:
    """One exit's table row: agreement before/after the fit, best k and speed-up raw vs adapted."""
    k0, t0, s0 = best_speedup(raw, e, layers)
    k1, t1, s1 = best_speedup(adapted, e, layers)
    return {
        "E": e,
        "params": report["params"],
        "held_before": report["held_out"]["before"],
        "held_after": report["held_out"]["after"],
        "train_before": report["train"]["before"],
        "train_after": report["train"]["after"],
        "fit_s": report["seconds"],
        "raw_best_k": k0,
        "raw_tok/round": t0,
        "raw_speedup": s0,
        "ad_best_k": k1,
        "ad_tok/round": t1,
        "ad_speedup": s1,
    }


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from adaptive_export.calibration.exit_adapters import fit_exit_adapters, greedy_runs, is_held_out
    from adaptive_export.calibration.measure import measure_speculation
    from adaptive_export.loading.model import load_model
    from adaptive_export.loading.prompts import read_prompts

    loaded = load_model(args.model)
    layers = loaded.spec.num_layers
    exits = [int(e) for e in args.exits.split(",")]
    prompts = read_prompts(args.calib)
    started = time.perf_counter()
    runs = greedy_runs(loaded, prompts, args.new_tokens)
    generate_s = time.perf_counter() - started
    fit = fit_exit_adapters(
        loaded,
        prompts,
        exits,
        rank=args.rank,
        epochs=args.epochs,
        seed=args.seed,
        new_tokens=args.new_tokens,
        runs=runs,
    )
    held = [i for i in range(len(prompts)) if is_held_out(i)]
    held_prompts, held_runs = [prompts[i] for i in held], [runs[i] for i in held]
    raw = measure_speculation(
        loaded, None, held_prompts, args.new_tokens, adapters={e: _identity(loaded) for e in exits}, runs=held_runs
    )
    adapted = measure_speculation(loaded, None, held_prompts, args.new_tokens, adapters=fit.adapters, runs=held_runs)
    raw["adapter_cost_layers"] = 0.0
    rows = [exit_row(e, fit.report["per_exit"][str(e)], raw, adapted, layers) for e in exits]
    positions = fit.report["positions"]
    print(
        f"{args.model}: {len(prompts)} prompts ({len(held)} held out), {args.new_tokens} greedy tokens, "
        f"positions {positions}, "
        f"rank {args.rank}, {args.epochs} epochs, {args.threads} threads; generation {generate_s:.0f} s"
    )
    table = print_table(rows, list(rows[0]))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "report": fit.report,
                    "table": rows,
                    "generate_seconds": round(generate_s, 1),
                    "held_out_simulation": {"raw": raw, "adapted": adapted},
                    "text": table,
                },
                indent=2,
            )
        )


def _identity(loaded: Any) -> Any:
    """An untrained adapter is the identity (`up` is zero): the raw exit at the same cost accounting."""
    from adaptive_export.graphs.adaptive import ExitAdapter

    return ExitAdapter(loaded.spec.hidden_size, 1, loaded.spec.rms_norm_eps).eval()


if __name__ == "__main__":
    main()
