"""TPOT of every skip configuration of a bundle against its full model, in one run.

    python -m benchmarks.router_configs [--bundle bundles/smollm2-routed] [--threads 2] [--repeat 5]

Without --bundle it builds a temporary SmolLM2 bundle whose configurations keep the first
24, 18, 12 and 1 of 30 layers (which layers are kept does not change the cost). Every
configuration decodes the same prompt for the same number of tokens; repetitions rotate
through the configurations so machine drift hits all of them alike; medians are printed.

Columns: `cut / skipped share` is (1 - TPOT / full TPOT) / (skipped / total layers), the
issue's criterion (>= 0.9). `per-layer efficiency` divides the time saved by skipped
layers x the cost of one layer, measured as the slope of a least-squares line of TPOT over
kept layers: 1.0 means a skipped layer saves exactly what it costs and the runtime adds
nothing per configuration. The line's intercept is the part of a step no configuration
can skip (embedding, final norm, LM head, the runtime); its share of full TPOT bounds the
first ratio at 1 - share.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import bench_parser, parse_and_pin, print_table

PROMPT = "Write a short story about a robot who learns to paint."
PROBE_KEPT = (24, 18, 12, 1)


def build_probe_bundle(out: Path, max_len: int = 512) -> Path:
    """A SmolLM2 bundle with configurations keeping the first k layers, for k in PROBE_KEPT."""
    from adaptive_export.exporter.build import ExportOptions, build_bundle
    from adaptive_export.graphs.plan import BuildPlan, SkipConfig
    from adaptive_export.loading.model import load_model

    loaded = load_model("smollm2")
    configs = [SkipConfig(f"k{k}", tuple(range(k))) for k in PROBE_KEPT]
    build_bundle(loaded, BuildPlan(loaded.spec.num_layers, configs=configs), ExportOptions(output=out, max_len=max_len))
    return out


def config_tpot(bundle: Path, threads: int, repeat: int = 5, new_tokens: int = 32) -> dict[str, dict[str, Any]]:
    """{config id: {kept, tpot_ms}}: median TPOT per configuration, repetitions interleaved."""
    from adaptive_export.runtimes import Generator

    gen = Generator(bundle, threads=threads)
    gen.codec.eos_ids = set()  # decode exactly new_tokens in every configuration
    ids = gen.codec.encode(PROMPT)
    configs = gen.bundle.manifest.configs
    samples: dict[str, list[float]] = {c.id: [] for c in configs}
    for c in configs:  # warm-up
        gen.generate(ids, max_new_tokens=8, config=c.id)
    for _ in range(repeat):
        for c in configs:
            samples[c.id].append(gen.generate(ids, max_new_tokens=new_tokens, config=c.id).stats.tpot_ms)
    return {c.id: {"kept": len(c.kept), "tpot_ms": statistics.median(samples[c.id])} for c in configs}


def linear_cost(points: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """(intercept ms, ms per kept layer) of the least-squares line of TPOT over kept layers."""
    kept = [p["kept"] for p in points.values()]
    if len(set(kept)) < 2:
        raise ValueError("need configurations with at least two different layer counts")
    slope, intercept = np.polyfit(kept, [p["tpot_ms"] for p in points.values()], 1)
    return float(intercept), float(slope)


def config_rows(points: dict[str, dict[str, Any]], num_layers: int) -> tuple[list[dict[str, Any]], float, float]:
    intercept, slope = linear_cost(points)
    full = points["full"]["tpot_ms"]
    rows = []
    for config, p in points.items():
        skipped = num_layers - p["kept"]
        cut = 1 - p["tpot_ms"] / full
        rows.append(
            {
                "config": config,
                "kept": p["kept"],
                "skipped": skipped,
                "tpot_ms": p["tpot_ms"],
                "vs_full": p["tpot_ms"] / full,
                "cut_per_skip_share": cut / (skipped / num_layers) if skipped else None,
                "per_layer_efficiency": (full - p["tpot_ms"]) / (skipped * slope) if skipped else None,
            }
        )
    return rows, intercept, slope


def main() -> None:
    parser = bench_parser(
        __doc__,
        bundle="a bundle with skip configurations (default: build a SmolLM2 probe bundle in a temp dir)",
        bundle_required=False,
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed repetitions per configuration (median), after one warm-up"
    )
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per repetition (default: 32)")
    args = parse_and_pin(parser)
    bundle = Path(args.bundle) if args.bundle else build_probe_bundle(Path(tempfile.mkdtemp()) / "probe")
    points = config_tpot(bundle, args.threads, args.repeat, args.new_tokens)
    from adaptive_export.runtimes.bundle import load_bundle

    num_layers = load_bundle(bundle, verify="size").num_layers
    rows, intercept, slope = config_rows(points, num_layers)
    print(
        f"{bundle}: threads={args.threads}, {args.new_tokens} tokens, median of {args.repeat}; "
        f"fit: {slope:.3f} ms per layer + {intercept:.2f} ms fixed "
        f"({intercept / points['full']['tpot_ms']:.0%} of full TPOT)"
    )
    print_table(rows, ["config", "kept", "skipped", "tpot_ms", "vs_full", "cut_per_skip_share", "per_layer_efficiency"])
    if (
        len({p["kept"] for p in points.values()}) < 3
        or min((r["skipped"] for r in rows if r["skipped"]), default=0) * slope < 0.05 * points["full"]["tpot_ms"]
    ):
        print(
            "note: fewer than three layer counts, or a configuration saving under 5% of a step: ratios of such small "
            "differences are within run-to-run noise; the probe bundle (no --bundle) gives the per-layer cost"
        )


if __name__ == "__main__":
    main()
