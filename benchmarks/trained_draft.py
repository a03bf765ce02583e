"""Trained draft exit (docs/early-exit.md "Trained draft exit"): per exit E and block form, the
untrained exit's and the trained draft's held-out agreement, training minutes (wall and CPU)
and tokens; then, for the shipped head, a bundle built with `--draft-head FILE`: draft ms per
token, verify ms at T=k+1, tokens per round, expected and measured speed-up over plain decoding.

    python -m benchmarks.trained_draft --model smollm2 --save samples/smollm2_draft_head.safetensors

Measured speed-up: median over the eval prompts of plain-decoding seconds / speculative
seconds (greedy, outputs identical), one warm-up excluded.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import bench_parser, cpu_model, load_prompts, median_of, parse_and_pin, print_table

NEW_TOKENS = 48


def train(args: Any) -> Any:
    from adaptive_export.calibration.draft_data import training_text
    from adaptive_export.calibration.draft_training import TrainSettings, draft_exits, train_draft_heads
    from adaptive_export.loading.model import load_model

    loaded = load_model(args.model)
    wall, cpu = time.perf_counter(), time.process_time()
    text = training_text(
        loaded, requests=args.requests, answer_tokens=args.answer_tokens, docstrings=args.docstrings, seed=0
    )
    text_minutes = {
        "wall": round((time.perf_counter() - wall) / 60, 2),
        "cpu": round((time.process_time() - cpu) / 60, 2),
    }
    exits = [int(e) for e in args.exits.split(",")] if args.exits else draft_exits(loaded.spec.num_layers)
    settings = TrainSettings(epochs=args.epochs, max_seconds=args.max_seconds)
    fit = train_draft_heads(loaded, text, exits, settings=settings)
    fit.report["text_minutes"] = text_minutes
    return fit


def training_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for e, row in report["per_exit"].items():
        for form, trained in row["forms"].items():
            rows.append(
                {
                    "E": e,
                    "form": form,
                    "params": trained["params"],
                    "untrained (full vocab)": row["untrained_agreement"]["full_vocabulary"],
                    **{f"trained N={n}": a for n, a in trained["held_out_agreement"].items()},
                    "train min wall/cpu": f"{trained['train_minutes']['wall']}/{trained['train_minutes']['cpu']}",
                    "kept": "yes" if row["kept"]["form"] == form else "",
                }
            )
    return rows


def measure_bundle(head_path: Path, model: str, exit_layer: int, k: int, prompts: list[str]) -> dict[str, Any]:
    """Build with the head, time its engines and decode the prompts plain and speculative."""
    from adaptive_export.calibration.latency import measure_engine_latencies
    from adaptive_export.commands.cli import main
    from adaptive_export.runtimes import Generator

    out = Path(tempfile.mkdtemp(prefix="trained-draft-")) / "bundle"
    assert (
        main(["build", model, "-o", str(out), "--speculate", f"{exit_layer}:{k}", "--draft-head", str(head_path)]) == 0
    )
    latencies = measure_engine_latencies(out, k, prepack=None)
    generator = Generator(out)
    ratios, per_round, drafted, accepted = [], [], 0, 0
    for index, prompt in enumerate(prompts):
        ids = generator.codec.encode(prompt)
        started = time.perf_counter()
        plain = generator.generate(ids, max_new_tokens=NEW_TOKENS)
        plain_s = time.perf_counter() - started
        started = time.perf_counter()
        spec = generator.generate(ids, max_new_tokens=NEW_TOKENS, mode="spec", draft="early_exit")
        spec_s = time.perf_counter() - started
        drafted += spec.stats.speculation["drafted"]
        accepted += spec.stats.speculation["accepted"]
        if index:  # the first pair warms the sessions
            ratios.append(plain_s / spec_s)
            per_round.append(len(spec.tokens) / max(spec.stats.speculation["rounds"], 1))
        assert plain.tokens == spec.tokens, f"speculation changed the output on {prompt!r}"
    return {
        "draft_ms": round(latencies["draft_ms"], 3),
        "verify_ms_k+1": round(latencies["verify_ms"].get(k + 1, latencies["verify_ms"][k]), 3),
        "decode_ms": round(latencies["decode_ms"][1], 3),
        "tokens_per_round": round(median_of(per_round), 3),
        "acceptance": round(accepted / max(drafted, 1), 4),
        "measured_speedup": round(median_of(ratios), 3),
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--exits", default=None, help="comma-separated exits (default L/2, 2L/3, 5L/6)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument("--docstrings", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="training bound per (exit, form)")
    parser.add_argument("--save", default=None, help="write the best head here (fp16 safetensors)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--json", default=None, help="write the whole report here")
    args = parse_and_pin(parser)
    from adaptive_export.loading.artifacts import draft_head_bytes

    fit = train(args)
    report = fit.report
    print(f"machine: {cpu_model()}, {args.threads} threads")
    print(f"text: {json.dumps(report['text'])}, generated in {report['text_minutes']} min")
    print(f"teacher pass {report['teacher_minutes']} min; all training {report['minutes']} min")
    print_table(training_rows(report), list(training_rows(report)[0]))
    best = max(fit.heads, key=lambda e: report["per_exit"][str(e)]["kept"]["expected_speedup"])
    head, kept = fit.heads[best], report["per_exit"][str(best)]["kept"]
    head_path = Path(args.save) if args.save else Path(tempfile.mkdtemp()) / "head.safetensors"
    head_path.write_bytes(draft_head_bytes(head))
    measured = measure_bundle(head_path, args.model, best, head.draft_len, load_prompts(limit=args.prompts))
    row = {"E": best, "form": head.form, "N": int(head.ids.numel()), "k": head.draft_len,
           "stop_below": head.stop_below, "expected_speedup": kept["expected_speedup"], **measured}  # fmt: skip
    print_table([row], list(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"report": report, "bundle": row, "cpu": cpu_model()}, indent=2))


if __name__ == "__main__":
    main()
