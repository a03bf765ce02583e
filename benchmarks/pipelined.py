"""Predictive Pipelined Decoding's measurements (docs/pipelined.md "Match rates and the paper's model").

1. Match rates as the paper defines them: at layer d in {L/2, 2L/3, 5L/6}, is the final greedy
   token among the top-k (k = 1, 2, 3) predictions taken at d? Teacher-forced over the model's own
   greedy continuations (32 tokens) of the chat prompts (samples/eval_prompts.jsonl) and the
   rewrite prompts (the rewrite part of samples/spec_prompts.jsonl). Classifier N: the model's own
   final norm + LM head on h_d; Y: the trained draft exit for d (calibration/draft_training.py,
   gated block + VocabTrim head, self-distilled on the model's own text), trained here per d
   (slow on CPU: `--device cuda` trains on a GPU).
2. The paper's latency/compute model at those rates (calibration/pipeline_model.py states the
   formulas: our reading of its equations 3, 5, 6), with stage costs in decoder-layer equivalents.
3. With `--timing`: plain decoding (2 threads in one session, and 1 thread) against `run --mode
   pipelined` (two stage sessions, one thread each) on bundles with the stage graphs at each d
   (built with `--speculate d:1`, or `--bundle`): TPOT and CPU seconds per token, medians over
   prompts x repetitions, and what one stage costs on one thread against the whole model on two.
   Without the pipelined runtime only the plain contenders and the stage costs are timed.

    python -m benchmarks.pipelined --model smollm2
    python -m benchmarks.pipelined --model gemma3 --classifier Y --device cuda --json gemma3-y.json
    python -m benchmarks.pipelined --model smollm2 --timing --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.speculative import rewrite_prompts

NEW_TOKENS = 32
MATCH_COLUMNS = "set d d/L k positions p latency compute".split() + [
    "stage1 share", "latency joined", "latency free heads", "p to pay", "p to pay joined"
]  # fmt: skip


def prompt_sets(chat_limit: int, rewrite_limit: int | None) -> dict[str, list[str]]:
    """The chat prompts the other benchmarks use and the spec prompt set's rewrite category."""
    rewrite = rewrite_prompts()
    return {
        "chat": common.load_prompts(common.DEFAULT_PROMPTS, chat_limit),
        "rewrite": rewrite[:rewrite_limit] or rewrite,
    }


def use_device(device: str) -> None:
    """Where the Y heads train (accelerate picks a GPU when one is visible): cuda must exist; cpu hides it."""
    from adaptive_export.runtimes.errors import UsageError

    if device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but torch sees no CUDA device", "run on a GPU or drop --device")


def train_heads(args: Any, loaded: Any, layers: list[int]) -> Any:
    """Classifier Y: the trained draft exit per d, through the trained-draft modules."""
    from adaptive_export.calibration.draft_data import training_text
    from adaptive_export.calibration.draft_training import TrainSettings, train_draft_heads

    text = training_text(
        loaded, requests=args.requests, answer_tokens=args.answer_tokens, docstrings=args.docstrings, seed=0
    )
    settings = TrainSettings(epochs=args.epochs, max_seconds=args.max_seconds)
    return train_draft_heads(loaded, text, layers, forms=(args.form,), settings=settings)


def classifier(args: Any, loaded: Any, layers: list[int]) -> tuple[Any, dict[int, Any], dict[str, Any]]:
    """(classify, stage costs per d, the training report) for --classifier N or Y."""
    from adaptive_export.calibration.pipeline_match import own_head, trained_heads
    from adaptive_export.calibration.pipeline_model import stage_costs, trained_classifier_params

    if args.classifier == "N":
        return own_head(loaded), {d: stage_costs(loaded, d) for d in layers}, {}
    fit = train_heads(args, loaded, layers)
    width = loaded.spec.hidden_size
    costs = {d: stage_costs(loaded, d, trained_classifier_params(fit.heads[d], width)) for d in layers}
    return trained_heads(loaded, fit.heads), costs, fit.report


def match_rows(args: Any, loaded: Any, layers: list[int]) -> dict[str, Any]:
    """One row per (prompt set, d, k): the match rate and the model's latency and compute; the tokens
    per prompt set, and the Y heads' training report."""
    from adaptive_export.calibration.pipeline_match import greedy_runs, match_rates
    from adaptive_export.calibration.pipeline_model import StageCosts, break_even, predict

    classify, costs, training = classifier(args, loaded, layers)
    num_layers = loaded.spec.num_layers
    rows, tokens = [], {}
    for name, prompts in prompt_sets(args.prompts, args.rewrite_prompts).items():
        runs = greedy_runs(loaded, prompts, args.new_tokens)
        tokens[name] = sum(len(r.continuation) for r in runs)
        for rate in match_rates(runs, layers, classify):
            cost = costs[rate.layer]
            model = predict(cost, rate.rate, rate.k)
            free = StageCosts(rate.layer, num_layers - rate.layer, num_layers)  # the paper's model: heads cost nothing
            rows.append({
                "set": name, "d": rate.layer, "d/L": round(rate.layer / loaded.spec.num_layers, 3),
                "stage1 share": round(cost.share, 3), "k": rate.k, "positions": rate.positions,
                "p": round(rate.rate, 3), "latency": round(model.latency, 3),
                "latency joined": round(model.latency_joined, 3), "compute": round(model.compute, 3),
                "latency free heads": round(predict(free, rate.rate, rate.k).latency, 3),
                "p to pay": round(break_even(cost)[0], 3), "p to pay joined": round(break_even(cost)[1], 3),
            })  # fmt: skip
    return {"rows": rows, "tokens": tokens, "training": training}


def pipelined_available() -> bool:
    """Whether the runtime has `--mode pipelined` yet (another change adds it)."""
    from adaptive_export.runtimes.generate import Mode

    return any(mode.value == "pipelined" for mode in Mode)


def stage_bundle(model: str, layer: int) -> Path:
    """A bundle whose stage graphs split at `layer`: early exit's draft [0, d) and verify [d, L)."""
    from adaptive_export.commands.cli import main

    out = Path(tempfile.mkdtemp(prefix="pipelined-")) / "bundle"
    assert main(["build", model, "-o", str(out), "--speculate", f"{layer}:1"]) == 0, f"build at d={layer} failed"
    return out


def bundle_layer(bundle: Path) -> int:
    """The bundle's split: the first layer of its full configuration's verify graph."""
    from adaptive_export.runtimes.bundle import load_bundle

    loaded = load_bundle(bundle, verify="size")
    engines = loaded.config("full").engines
    if "verify" not in engines:
        from adaptive_export.runtimes.errors import UsageError

        raise UsageError(f"bundle {str(bundle)!r} has no stage graphs", "rebuild it with --speculate D:1")
    return loaded.graph(engines["verify"]).layers[0]


def decode_costs(generator: Any, prompts: list[list[int]], repeat: int, new_tokens: int, mode: str) -> dict[str, Any]:
    """Median TPOT (ms) and CPU seconds per token (the whole process: every thread) over prompts x repeat,
    one warm-up run excluded; the tokens of each prompt's last run, to check pipelining changed none."""
    generator.generate(prompts[0], max_new_tokens=new_tokens, mode=mode)
    tpot, cpu, tokens = [], [], []
    for ids in prompts:
        for _ in range(repeat):
            started = time.process_time()
            result = generator.generate(ids, max_new_tokens=new_tokens, mode=mode)
            cpu.append((time.process_time() - started) / max(result.stats.new_tokens, 1))
            tpot.append(result.stats.tpot_ms)
        tokens.append(result.tokens)
    return {"tpot_ms": common.median_of(tpot), "cpu_s_per_token": common.median_of(cpu), "tokens": tokens}


def stage_times(bundle: Path) -> dict[str, float]:
    """Median ms of stage 1 and stage 2 on one thread against the whole model on two (and on one): a
    pipelined token on 2 cores costs at least the slower stage, plain decoding the whole model on two."""
    from adaptive_export.calibration.latency import measure_engine_latencies

    one = measure_engine_latencies(bundle, 1, threads=1, prepack=None)
    whole = measure_engine_latencies(bundle, 1, threads=2, prepack=None)["decode_ms"][1]
    stage1, stage2 = one["draft_ms"], one["verify_ms"][1]
    return {
        "d": bundle_layer(bundle), "stage1 1t ms": stage1, "stage2 1t ms": stage2, "whole 1t ms": one["decode_ms"][1],
        "whole 2t ms": whole, "stage1 1t / whole 2t": round(stage1 / whole, 3),
        "stage2 1t / whole 2t": round(stage2 / whole, 3),
    }  # fmt: skip


def contenders() -> list[tuple[str, int, str]]:
    """(name, session threads, mode): plain on both cores, plain on one, pipelined once it exists."""
    plain = [("plain 2t", 2, "ar"), ("plain 1t", 1, "ar")]
    return plain + ([("pipelined 1t+1t", 2, "pipelined")] if pipelined_available() else [])


def time_bundle(bundle: Path, prompts: list[str], repeat: int, new_tokens: int) -> list[dict[str, Any]]:
    """Each contender on one bundle, with ratios against plain decoding on two threads from the same run."""
    from adaptive_export.runtimes import Generator

    layer, results, ids = bundle_layer(bundle), {}, None
    for name, threads, mode in contenders():
        generator = Generator(bundle, threads=threads)
        ids = ids or [generator.codec.encode(p) for p in prompts]
        results[name] = decode_costs(generator, ids, repeat, new_tokens, mode)
    plain = results["plain 2t"]
    rows = []
    for name, got in results.items():
        same = sum(a == b for a, b in zip(got["tokens"], plain["tokens"], strict=True))
        rows.append({
            "d": layer, "contender": name, "TPOT ms": round(got["tpot_ms"], 2),
            "CPU s/token": round(got["cpu_s_per_token"], 4),
            "TPOT / plain 2t": round(got["tpot_ms"] / plain["tpot_ms"], 3),
            "CPU / plain 2t": round(got["cpu_s_per_token"] / plain["cpu_s_per_token"], 3),
            "same tokens": f"{same}/{len(prompts)}",
        })  # fmt: skip
    return rows


def timing(args: Any, layers: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Part 3 on a given bundle, or on one bundle built per d: the contenders, then the stages' costs."""
    if not pipelined_available():
        print("runtime missing: this runtime has no `--mode pipelined` yet; timing plain decoding and the stages only")
    bundles = [Path(args.bundle)] if args.bundle else [stage_bundle(args.model, d) for d in layers]
    prompts = common.load_prompts(common.DEFAULT_PROMPTS, args.timing_prompts)
    rows = [row for bundle in bundles for row in time_bundle(bundle, prompts, args.repeat, args.new_tokens)]
    stages = [stage_times(bundle) for bundle in bundles]
    print(f"timing: {len(prompts)} chat prompts x {args.repeat}, {args.new_tokens} new tokens, {common.cpu_model()}")
    common.print_table(rows, list(rows[0]))
    common.print_table(stages, list(stages[0]))
    return {"decoding": rows, "stages": stages}


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a model path")
    parser.add_argument("--classifier", choices=("N", "Y"), default="N", help="N: own head; Y: trained head per d")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where Y's heads train")
    parser.add_argument("--layers", default=None, help="comma-separated d (default L/2, 2L/3, 5L/6)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--prompts", type=int, default=10, help="chat prompts")
    parser.add_argument("--rewrite-prompts", type=int, default=None, help="rewrite prompts (default: all)")
    parser.add_argument("--requests", type=int, default=60, help="Y: self-written training requests")
    parser.add_argument("--answer-tokens", type=int, default=96, help="Y: tokens per training answer")
    parser.add_argument("--docstrings", type=int, default=300, help="Y: stdlib docstrings")
    parser.add_argument("--epochs", type=int, default=4, help="Y: training epochs")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="Y: training bound per d")
    parser.add_argument("--form", choices=("gated", "lowrank"), default="gated", help="Y: exit block form")
    parser.add_argument("--timing", action="store_true", help="part 3: time plain against pipelined decoding")
    parser.add_argument("--match", action=argparse.BooleanOptionalAction, default=True, help="parts 1-2")
    parser.add_argument("--repeat", type=int, default=3, help="timing repetitions per prompt")
    parser.add_argument("--timing-prompts", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the report here")


def main() -> None:
    parser = common.bench_parser(
        __doc__, bundle="part 3: time this bundle (stage graphs at its d)", bundle_required=False
    )
    add_arguments(parser)
    args = common.parse_and_pin(parser)
    from adaptive_export.calibration.draft_training import draft_exits
    from adaptive_export.calibration.pipeline_model import head_layers
    from adaptive_export.loading.model import load_model

    use_device(args.device)
    loaded = load_model(args.model)
    num_layers = loaded.spec.num_layers
    layers = [int(d) for d in args.layers.split(",")] if args.layers else draft_exits(num_layers)
    report: dict[str, Any] = {"machine": common.cpu_model(), "model": args.model, "classifier": args.classifier,
                              "num_layers": num_layers, "head_layers": round(head_layers(loaded), 2),
                              "new_tokens": args.new_tokens}  # fmt: skip
    if args.match:
        report.update(match_rows(args, loaded, layers))
    if args.timing:
        report["timing"] = timing(args, layers)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.match:
        print(f"\n{args.model}, classifier {args.classifier}, L={num_layers}, head = {report['head_layers']} layers, "
              f"tokens {report['tokens']}, {report['machine']}\n")  # fmt: skip
        common.print_table(report["rows"], MATCH_COLUMNS)


if __name__ == "__main__":
    main()
