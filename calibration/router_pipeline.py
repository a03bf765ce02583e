"""`build --routers train|FILE`: routers, the configurations worth an engine, and what was measured."""
from __future__ import annotations

import argparse
import logging
from collections import Counter
from typing import Any

from tqdm import tqdm

from calibration.artifacts import load_routers, routers_bytes, ROUTERS_FILE
from calibration.configs import choose_configs, layers_saved, served_share
from calibration.measure import calibration_prompts, greedy_sequence
from calibration.routers import (DEFAULT_LAMBDA, LEARNING_RATE, THRESHOLD, GatedModel, TrainingSequence, continuation_agreement,
                                 router_scores, train_routers)
from graphs.plan import SkipConfig
from runtimes.errors import UsageError

CONTINUATION_TOKENS = 24
# A skip configuration gets an engine only if decoding with it keeps this share of the full
# model's greedy tokens (teacher-forced, calibration continuations); prompts it would have
# served fall back, by the superset rule, to a larger configuration or the full model.
DEFAULT_MIN_AGREEMENT = 0.9
log = logging.getLogger(__name__)


def plan_routers(args: argparse.Namespace, loaded: Any) -> tuple[Any, list[SkipConfig], dict[str, Any], dict[str, bytes]]:
    spec = loaded.spec
    prompts = calibration_prompts(args.calib)
    lam = DEFAULT_LAMBDA if args.router_lambda is None else args.router_lambda
    if lam < 0:
        raise UsageError(f"--router-lambda {lam} is negative", "use 0 or a positive sparsity weight such as 0.02")
    sequences = [TrainingSequence(*greedy_sequence(loaded, p, CONTINUATION_TOKENS))
                 for p in tqdm(prompts, desc="calibration continuations", unit="prompt")]
    report: dict[str, Any] = {"prompts": len(prompts), "threshold": THRESHOLD}
    if args.routers == "train":
        lr = getattr(args, "router_lr", None) or LEARNING_RATE
        if lr <= 0:
            raise UsageError(f"--router-lr {lr} is not positive", "use a learning rate such as 5e-3")
        result = train_routers(loaded, sequences, lam=lam, seed=args.seed, lr=lr)
        routers = result.routers
        report["training"] = {"lambda": lam, "learning_rate": lr, "epochs": result.epochs, "seconds": round(result.seconds, 1), "seed": args.seed,
                              "loss_first_epoch": round(result.loss_first, 4), "loss_last_epoch": round(result.loss_last, 4),
                              "mean_p_last": round(result.mean_p_last, 4)}
    else:
        routers = load_routers(args.routers, spec.num_layers, spec.hidden_size)
        report["training"] = {"loaded_from": str(args.routers)}
    histogram: Counter[frozenset[int]] = Counter()
    for seq in sequences:
        scores = router_scores(loaded, routers, seq.ids[: seq.prompt_len])
        histogram[frozenset(i for i, s in enumerate(scores) if s >= THRESHOLD)] += 1
    chosen = choose_configs(histogram, spec.num_layers, args.max_configs)
    chosen, quality = keep_good_configs(loaded, sequences, chosen, getattr(args, "min_config_agreement", DEFAULT_MIN_AGREEMENT))
    shares = served_share(histogram, chosen, spec.num_layers)
    configs = [SkipConfig(f"s{n}", tuple(sorted(kept))) for n, kept in enumerate(chosen, 1)]
    ids = {frozenset(c.kept): c.id for c in configs} | {frozenset(range(spec.num_layers)): "full"}
    report["configs"] = {
        "histogram": [{"kept": sorted(k), "skipped": spec.num_layers - len(k), "count": n} for k, n in histogram.most_common()],
        "chosen": [{"id": ids[k], "kept": sorted(k), "skipped": spec.num_layers - len(k), "share": round(v, 4)} for k, v in shares.items()],
        "expected_layers_saved_per_prompt": round(layers_saved(histogram, chosen, spec.num_layers) / max(len(sequences), 1), 3),
        "max_configs": args.max_configs,
        "quality": quality,
        "rule": "superset: cheapest compiled configuration containing every kept layer; full always compiled",
    }
    return routers, configs, report, {ROUTERS_FILE: routers_bytes(routers)}


def keep_good_configs(loaded: Any, sequences: list[TrainingSequence], chosen: list[frozenset[int]],
                      floor: float) -> tuple[list[frozenset[int]], dict[str, Any]]:
    """Drop chosen skip configurations whose decoding quality is below `floor`."""
    model = GatedModel(loaded).eval()
    measured = [{"kept": sorted(kept), "agreement": round(continuation_agreement(model, sequences, set(kept)), 4)} for kept in chosen]
    good = [kept for kept, row in zip(chosen, measured) if row["agreement"] >= floor]
    dropped = [row for row in measured if row["agreement"] < floor]
    if dropped:
        log.warning("dropped %d skip configuration(s) below the quality floor %.2f (agreement %s); their prompts use the full model",
                    len(dropped), floor, ", ".join(f"{row['agreement']:.2f}" for row in dropped))
    return good, {"min_agreement": floor, "measured": measured, "dropped": dropped}
