"""`build --routers train|FILE`: routers, the configurations worth an engine, and what was measured."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from adaptive_export.calibration.configs import choose_configs, layers_saved, served_share
from adaptive_export.calibration.greedy import greedy_sequences
from adaptive_export.calibration.measure import calibration_prompts
from adaptive_export.calibration.routers import (
    DEFAULT_LAMBDA,
    LEARNING_RATE,
    THRESHOLD,
    GatedModel,
    TrainingSequence,
    continuation_agreement,
    kept_by_routers,
    train_routers,
)
from adaptive_export.graphs.plan import SkipConfig
from adaptive_export.loading.artifacts import ROUTERS_FILE, load_routers, routers_bytes
from adaptive_export.runtimes.errors import UsageError

CONTINUATION_TOKENS = 24
# A skip configuration gets an engine only if decoding with it keeps this share of the full
# model's greedy tokens (teacher-forced, calibration continuations); the choice then takes
# the best passing candidate instead (calibration/configs.py).
DEFAULT_MIN_AGREEMENT = 0.8
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterOptions:
    """What `build --routers ...` asks of router calibration."""

    routers: str  # "train", or a routers .safetensors file
    calib: str | None = None  # calibration prompts (JSONL); None: the built-in set
    max_configs: int = 3
    router_lambda: float | None = None  # None: DEFAULT_LAMBDA
    router_lr: float | None = None  # None: LEARNING_RATE
    min_config_agreement: float | None = None  # None: DEFAULT_MIN_AGREEMENT
    seed: int = 0


def plan_routers(options: RouterOptions, loaded: Any) -> tuple[Any, list[SkipConfig], dict[str, Any], dict[str, bytes]]:
    """(routers, the skip configurations worth an engine, calibration.json's entry, the routers file)."""
    spec = loaded.spec
    prompts = calibration_prompts(options.calib)
    lam = DEFAULT_LAMBDA if options.router_lambda is None else options.router_lambda
    if lam < 0:
        raise UsageError(f"--router-lambda {lam} is negative", "use 0 or a positive sparsity weight such as 0.02")
    sequences = [
        TrainingSequence(ids, prompt_len)
        for ids, prompt_len in greedy_sequences(loaded, prompts, CONTINUATION_TOKENS, "calibration continuations")
    ]
    report: dict[str, Any] = {"prompts": len(prompts), "threshold": THRESHOLD}
    routers, report["training"] = routers_and_training(options, loaded, sequences, lam)
    histogram: Counter[frozenset[int]] = Counter()
    for seq in sequences:
        histogram[kept_by_routers(loaded, routers, seq.ids[: seq.prompt_len])] += 1
    floor = options.min_config_agreement
    quality = QualityFloor(loaded, sequences, DEFAULT_MIN_AGREEMENT if floor is None else floor)
    chosen = choose_configs(histogram, spec.num_layers, options.max_configs, acceptable=quality.passes)
    floor_report = quality.report()
    if dropped := floor_report["dropped"]:
        log.warning(
            "%d candidate skip configuration(s) fell below the quality floor %.2f (agreement %s) and got no engine",
            len(dropped),
            quality.floor,
            ", ".join(f"{row['agreement']:.2f}" for row in dropped),
        )
    shares = served_share(histogram, chosen, spec.num_layers)
    configs = [SkipConfig(f"s{n}", tuple(sorted(kept))) for n, kept in enumerate(chosen, 1)]
    ids = {frozenset(c.kept): c.id for c in configs} | {frozenset(range(spec.num_layers)): "full"}
    report["configs"] = {
        "histogram": [
            {"kept": sorted(k), "skipped": spec.num_layers - len(k), "count": n} for k, n in histogram.most_common()
        ],
        "chosen": [
            {"id": ids[k], "kept": sorted(k), "skipped": spec.num_layers - len(k), "share": round(v, 4)}
            for k, v in shares.items()
        ],
        "expected_layers_saved_per_prompt": round(
            layers_saved(histogram, chosen, spec.num_layers) / max(len(sequences), 1), 3
        ),
        "max_configs": options.max_configs,
        "quality": floor_report,
        "rule": "superset: cheapest compiled configuration containing every kept layer; full always compiled",
    }
    return routers, configs, report, {ROUTERS_FILE: routers_bytes(routers)}


def routers_and_training(
    options: RouterOptions, loaded: Any, sequences: list[TrainingSequence], lam: float
) -> tuple[Any, dict[str, Any]]:
    """The routers, trained on the calibration continuations or loaded from a file, and how they came."""
    if options.routers != "train":
        spec = loaded.spec
        return load_routers(options.routers, spec.num_layers, spec.hidden_size), {"loaded_from": str(options.routers)}
    lr = options.router_lr or LEARNING_RATE
    if lr <= 0:
        raise UsageError(f"--router-lr {lr} is not positive", "use a learning rate such as 5e-3")
    result = train_routers(loaded, sequences, lam=lam, seed=options.seed, lr=lr)
    training = {
        "lambda": lam,
        "learning_rate": lr,
        "epochs": result.epochs,
        "seconds": round(result.seconds, 1),
        "seed": options.seed,
        "loss_first_epoch": round(result.loss_first, 4),
        "loss_last_epoch": round(result.loss_last, 4),
        "mean_p_last": round(result.mean_p_last, 4),
    }
    return result.routers, training


class QualityFloor:
    """Teacher-forced top-1 agreement of decoding with a kept set, measured once per set;
    a set passes if it keeps `floor` of the full model's greedy tokens."""

    def __init__(self, loaded: Any, sequences: list[TrainingSequence], floor: float) -> None:
        self.model = GatedModel(loaded).eval()
        self.sequences = sequences
        self.floor = floor
        self.measured: dict[frozenset[int], float] = {}

    def passes(self, kept: frozenset[int]) -> bool:
        if kept not in self.measured:
            self.measured[kept] = round(continuation_agreement(self.model, self.sequences, kept), 4)
            log.info(
                "skipping layers %s keeps %.3f of the greedy tokens (floor %.2f)",
                sorted(set(range(len(self.model.layers))) - kept),
                self.measured[kept],
                self.floor,
            )
        return self.measured[kept] >= self.floor

    def report(self) -> dict[str, Any]:
        rows = [{"kept": sorted(kept), "agreement": agreement} for kept, agreement in self.measured.items()]
        return {
            "min_agreement": self.floor,
            "measured": rows,
            "dropped": [row for row in rows if row["agreement"] < self.floor],
        }
