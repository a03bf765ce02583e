"""FiRST router lambda sweep on SmolLM2: layers skipped against quality and speed.

    python -m benchmarks.router_sweep [--lambdas 0.01,0.05,0.1,0.2] [--plot docs/router_sweep.png]
    python -m benchmarks.router_sweep --single-layers   # what skipping each one layer costs

Per lambda: routers trained on samples/calib_prompts.jsonl (model frozen); on held-out
prompts (samples/eval_prompts.jsonl) the routers decide on the prompt and the kept set
applies to the continuation (prefill runs every layer, decode skips; the PyTorch forward
reproduces exactly that); reported: mean skipped layers, teacher-forced top-1 agreement
with the full model on its own greedy continuations, perplexity on held-out text
(samples/heldout_text.jsonl, routers decide on the first half, the second half is scored),
and TPOT estimated from ONNX Runtime decode engines measured in the same run (a linear fit
of TPOT over kept layers, from engines with 30, 24, 18, 12 and 1 layers; the per-engine
table of benchmarks/router_configs.py is printed too). The first row is the full model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from adaptive_export.calibration.greedy import greedy_sequences
from adaptive_export.calibration.measure import calibration_prompts
from adaptive_export.calibration.routers import (
    THRESHOLD,
    GatedModel,
    TrainingSequence,
    continuation_agreement,
    kept_by_routers,
    skipping_logits,
    train_routers,
)
from benchmarks.common import DEFAULT_PROMPTS, ROOT, bench_parser, load_prompts, pin_threads, print_table
from benchmarks.router_configs import build_probe_bundle, config_rows, config_tpot


def evaluate(
    loaded, model: GatedModel, routers, held: list[TrainingSequence], texts: list[list[int]]
) -> dict[str, float]:
    skipped, agreement, nll = [], [], []
    every = set(range(loaded.spec.num_layers))
    for seq in held:
        kept = kept_by_routers(loaded, routers, seq.ids[: seq.prompt_len])
        skipped.append(len(every) - len(kept))
        logits = skipping_logits(model, seq.ids, seq.prompt_len, kept)[seq.prompt_len - 1 : -1]
        agreement.append(float((logits.argmax(-1) == torch.tensor(seq.ids[seq.prompt_len :])).float().mean()))
    for ids in texts:
        half = len(ids) // 2
        kept = kept_by_routers(loaded, routers, ids[:half])
        logits = skipping_logits(model, ids, half, kept)[half - 1 : -1]
        nll.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[half:]))))
    return {
        "mean_skipped": statistics.mean(skipped),
        "top1_agreement": statistics.mean(agreement),
        "perplexity": float(np.exp(np.mean(nll))),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, threads_help="torch and ONNX Runtime threads (default: 2)")
    parser.add_argument(
        "--lambdas",
        default="0.0,0.01,0.02,0.05,0.1,0.2",
        help="router sparsity weights to train and evaluate (comma-separated)",
    )
    parser.add_argument("--plot", default=str(ROOT / "docs" / "router_sweep.png"))
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--single-layers",
        action="store_true",
        help="only print the teacher-forced top-1 agreement on the calibration prompts "
        "when decoding skips each single layer",
    )
    return parser


def print_single_layer_costs(loaded, model: GatedModel, train: list[TrainingSequence]) -> None:
    """`--single-layers`: what skipping each one layer costs in agreement."""
    every = set(range(loaded.spec.num_layers))
    costs = [
        {"skipped_layer": i, "top1_agreement": continuation_agreement(model, train, every - {i})} for i in sorted(every)
    ]
    print_table(costs, ["skipped_layer", "top1_agreement"])


def main() -> None:
    args = build_parser().parse_args()
    pin_threads(args.threads)
    from adaptive_export.loading.model import load_model

    loaded = load_model("smollm2")
    model = GatedModel(loaded).eval()
    train = [TrainingSequence(*run) for run in greedy_sequences(loaded, calibration_prompts(None), 24)]
    if args.single_layers:
        print_single_layer_costs(loaded, model, train)
        return
    held = [TrainingSequence(*run) for run in greedy_sequences(loaded, load_prompts(DEFAULT_PROMPTS), 32)]
    texts = [
        loaded.tokenizer(p, add_special_tokens=False)["input_ids"]
        for p in load_prompts(ROOT / "samples" / "heldout_text.jsonl")
    ]
    n = loaded.spec.num_layers
    points = config_tpot(build_probe_bundle(Path(tempfile.mkdtemp()) / "probe"), args.threads)
    config_table, intercept, slope = config_rows(points, n)
    full_tpot = intercept + slope * n
    reference = evaluate(loaded, model, None, held, texts)
    rows = [{"lambda": "full model", **reference, "tpot_ms": full_tpot, "tpot_vs_full": 1.0}]
    for lam in [float(x) for x in args.lambdas.split(",")]:
        result = train_routers(loaded, train, lam=lam, seed=0)
        metrics = evaluate(loaded, model, result.routers, held, texts)
        tpot = intercept + slope * (n - metrics["mean_skipped"])
        rows.append(
            {"lambda": lam, **metrics, "tpot_ms": tpot, "tpot_vs_full": tpot / full_tpot, "train_s": result.seconds}
        )
    print(
        f"decode engines by kept layers (threads={args.threads}); "
        f"fit: {slope:.3f} ms per layer + {intercept:.2f} ms fixed"
    )
    print_table(
        config_table, ["config", "kept", "skipped", "tpot_ms", "vs_full", "cut_per_skip_share", "per_layer_efficiency"]
    )
    print(f"SmolLM2 router sweep, threshold {THRESHOLD}")
    print_table(rows, ["lambda", "mean_skipped", "top1_agreement", "perplexity", "tpot_ms", "tpot_vs_full", "train_s"])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "configs": config_table}, indent=2))
    plot_sweep(rows, args.plot)


def plot_sweep(rows: list[dict], path: str) -> None:
    """Agreement against layers skipped, perplexity against TPOT (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot([r["mean_skipped"] for r in rows], [r["top1_agreement"] for r in rows], "o-")
    for r in rows[1:]:
        ax[0].annotate(f"λ={r['lambda']}", (r["mean_skipped"], r["top1_agreement"]))
    ax[0].set_xlabel("mean layers skipped (of 30)")
    ax[0].set_ylabel("top-1 agreement with full model")
    ax[1].plot([r["tpot_ms"] for r in rows], [r["perplexity"] for r in rows], "o-")
    ax[1].set_xlabel("TPOT ms (ONNX Runtime, 2 threads)")
    ax[1].set_ylabel("held-out perplexity")
    fig.suptitle("SmolLM2-135M FiRST routers: lambda sweep")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
