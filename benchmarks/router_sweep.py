"""FiRST router lambda sweep on SmolLM2: layers skipped against quality and speed.

    python -m benchmarks.router_sweep [--lambdas 0.01,0.05,0.1,0.2] [--plot docs/router_sweep.png]

Per lambda: routers trained on samples/calib_prompts.jsonl (model frozen); on held-out
prompts (samples/eval_prompts.jsonl) the routers decide on the prompt and the kept set
applies to the continuation (prefill runs every layer, decode skips; the PyTorch forward
reproduces exactly that); reported: mean skipped layers, teacher-forced top-1 agreement
with the full model on its own greedy continuations, perplexity on held-out text
(samples/heldout_text.jsonl, routers decide on the first half, the second half is scored),
and TPOT estimated from ONNX Runtime decode engines measured in the same run (a linear fit
of TPOT over kept layers, from engines with 30, 24, 18 and 12 layers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import DEFAULT_PROMPTS, ROOT, load_prompts, pin_threads, print_table
from calibration.measure import calibration_prompts, greedy_sequence
from calibration.routers import THRESHOLD, GatedModel, TrainingSequence, router_scores, skipping_logits, train_routers



def evaluate(loaded, model: GatedModel, routers, held: list[TrainingSequence], texts: list[list[int]]) -> dict[str, float]:
    skipped, agreement, nll = [], [], []
    every = set(range(loaded.spec.num_layers))
    for seq in held:
        scores = router_scores(loaded, routers, seq.ids[: seq.prompt_len])
        kept = {i for i, s in enumerate(scores) if s >= THRESHOLD}
        skipped.append(len(every) - len(kept))
        logits = skipping_logits(model, seq.ids, seq.prompt_len, kept)[seq.prompt_len - 1 : -1]
        agreement.append(float((logits.argmax(-1) == torch.tensor(seq.ids[seq.prompt_len:])).float().mean()))
    for ids in texts:
        half = len(ids) // 2
        kept = {i for i, s in enumerate(router_scores(loaded, routers, ids[:half])) if s >= THRESHOLD}
        logits = skipping_logits(model, ids, half, kept)[half - 1 : -1]
        nll.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[half:]))))
    return {"mean_skipped": statistics.mean(skipped), "top1_agreement": statistics.mean(agreement), "perplexity": float(np.exp(np.mean(nll)))}


def tpot_model(threads: int) -> tuple[float, float, dict[int, float]]:
    """Measure ORT decode TPOT for engines with fewer layers; return (intercept, per-layer slope, points)."""
    from exporter.build import BuildOptions, build_bundle
    from exporter.model_loading import load_model
    from graphs.plan import BuildPlan, SkipConfig
    from runtimes import Generator

    loaded = load_model("smollm2")
    n = loaded.spec.num_layers
    configs = [SkipConfig(f"k{k}", tuple(range(k))) for k in (24, 18, 12)]  # which layers does not change the cost
    out = Path(tempfile.mkdtemp()) / "sweep"
    build_bundle(loaded, BuildPlan(n, configs=list(configs)), BuildOptions(output=out, max_len=512))
    gen = Generator(out, threads=threads)
    gen.codec.eos_ids = set()
    ids = gen.codec.encode("Write a short story about a robot who learns to paint.")
    points = {}
    for config_id, layers in [("full", n)] + [(c.id, len(c.kept)) for c in configs]:
        gen.generate(ids, max_new_tokens=8, config=config_id)
        points[layers] = statistics.median(gen.generate(ids, max_new_tokens=32, config=config_id).stats.tpot_ms for _ in range(3))
    slope, intercept = np.polyfit(list(points), list(points.values()), 1)
    return float(intercept), float(slope), points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lambdas", default="0.0,0.005,0.01,0.02,0.05", help="router sparsity weights to train and evaluate (comma-separated)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "router_sweep.png"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pin_threads(args.threads)
    from exporter.model_loading import load_model

    loaded = load_model("smollm2")
    model = GatedModel(loaded).eval()
    train = [TrainingSequence(*greedy_sequence(loaded, p, 24)) for p in calibration_prompts(None)]
    held = [TrainingSequence(*greedy_sequence(loaded, p, 32)) for p in load_prompts(DEFAULT_PROMPTS)]
    texts = [loaded.tokenizer(p, add_special_tokens=False)["input_ids"] for p in load_prompts(ROOT / "samples" / "heldout_text.jsonl")]
    intercept, slope, points = tpot_model(args.threads)
    n = loaded.spec.num_layers
    rows = []
    for lam in [float(x) for x in args.lambdas.split(",")]:
        result = train_routers(loaded, train, lam=lam, seed=0)
        metrics = evaluate(loaded, model, result.routers, held, texts)
        tpot = intercept + slope * (n - metrics["mean_skipped"])
        rows.append({"lambda": lam, **metrics, "tpot_ms": tpot, "tpot_vs_full": tpot / (intercept + slope * n), "train_s": result.seconds})
    print(f"SmolLM2 router sweep, threshold {THRESHOLD}; measured TPOT by kept layers: {json.dumps({k: round(v, 2) for k, v in points.items()})}")
    print_table(rows, ["lambda", "mean_skipped", "top1_agreement", "perplexity", "tpot_ms", "tpot_vs_full", "train_s"])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tpot_points": points}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot([r["mean_skipped"] for r in rows], [r["top1_agreement"] for r in rows], "o-")
    for r in rows:
        ax[0].annotate(f"λ={r['lambda']}", (r["mean_skipped"], r["top1_agreement"]))
    ax[0].set_xlabel("mean layers skipped (of 30)"); ax[0].set_ylabel("top-1 agreement with full model")
    ax[1].plot([r["tpot_ms"] for r in rows], [r["perplexity"] for r in rows], "o-")
    ax[1].set_xlabel("TPOT ms (ONNX Runtime, 2 threads)"); ax[1].set_ylabel("held-out perplexity")
    fig.suptitle("SmolLM2-135M FiRST routers: lambda sweep"); fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
