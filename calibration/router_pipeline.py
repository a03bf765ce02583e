"""`build --routers train|FILE`: routers, the configurations worth an engine, and what was measured."""

from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

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
    router_scores,
    train_routers,
)
from adaptive_export.calibration.skip_adapters import (
    AdapterTraining,
    adapted_agreement,
    as_module_dict,
    train_skip_adapters,
)
from adaptive_export.graphs.plan import FULL_CONFIG, SkipConfig
from adaptive_export.loading.artifacts import (
    ROUTERS_FILE,
    SKIP_ADAPTERS_FILE,
    adapters_bytes,
    load_routers,
    routers_bytes,
)
from adaptive_export.runtimes.errors import UsageError

CONTINUATION_TOKENS = 24
# A skip configuration gets an engine only if decoding with it keeps this share of the full
# model's greedy tokens (teacher-forced, calibration continuations); the choice then takes
# the best passing candidate instead (calibration/configs.py).
DEFAULT_MIN_AGREEMENT = 0.8
# With skip adapters, every HELD_OUT_EVERY-th calibration sequence is held out of their training
# and measures the floor (adapters fit their own training text far better: docs/routers.md).
HELD_OUT_EVERY = 4
# The router thresholds `--router-threshold auto` compares (keep layer i iff p_i >= threshold):
# a higher one skips more layers per prompt, as far as the quality floor allows. Finer between 0.6
# and 0.7, where Qwen2.5-Coder-1.5B's routers go from 4 skipped layers to 7 (docs/routers.md).
THRESHOLDS = (0.5, 0.55, 0.6, 0.62, 0.64, 0.66, 0.68, 0.7, 0.75, 0.8, 0.9)
# The most kept sets one build measures against the floor (each a teacher-forced pass over its
# sequences: ~25 s on Gemma 3); a higher threshold's histogram offers hundreds of candidates.
# Past the budget an unmeasured set does not pass.
MAX_MEASUREMENTS = 48
# Skip adapters train on the routers' kept sets (at any threshold tried) that keep at least
# floor - ADAPTER_REACH unaided, the most frequent ADAPTER_SETS of them: a set far below the floor
# (the 1.5B's sets without layer 0 keep 0.08) only takes the adapters' capacity from the ones they
# can carry over it.
ADAPTER_REACH = 0.15
ADAPTER_SETS = 24
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
    lora: int = 0  # rank of the shared skip adapters (0: none)
    router_threshold: str | None = None  # a number, "auto" (calibrated), or None: THRESHOLD, "auto" with lora
    seed: int = 0


@dataclass(frozen=True)
class RouterPlan:
    """What router calibration decided: the routers, the configurations worth an engine, the
    skip adapters those configurations read (empty: none), calibration.json's entry, the files."""

    routers: Any
    threshold: float  # the runtime keeps layer i iff p_i >= threshold (manifest router_threshold)
    configs: list[SkipConfig]
    skip_adapters: dict[int, Any]
    report: dict[str, Any]
    files: dict[str, bytes]


def plan_routers(options: RouterOptions, loaded: Any) -> RouterPlan:
    """Routers, then the skip configurations that keep the quality floor (with the skip adapters
    where they help), then what was measured."""
    spec = loaded.spec
    prompts = calibration_prompts(options.calib)
    lam = DEFAULT_LAMBDA if options.router_lambda is None else options.router_lambda
    if lam < 0:
        raise UsageError(f"--router-lambda {lam} is negative", "use 0 or a positive sparsity weight such as 0.02")
    sequences = [
        TrainingSequence(ids, prompt_len)
        for ids, prompt_len in greedy_sequences(loaded, prompts, CONTINUATION_TOKENS, "calibration continuations")
    ]
    report: dict[str, Any] = {"prompts": len(prompts)}
    routers, report["training"] = routers_and_training(options, loaded, sequences, lam)
    scores = [router_scores(loaded, routers, seq.ids[: seq.prompt_len]) for seq in sequences]
    floor = DEFAULT_MIN_AGREEMENT if options.min_config_agreement is None else options.min_config_agreement
    quality = quality_floor(options, loaded, sequences, scores, floor)
    threshold, histogram, chosen, sweep = sweep_thresholds(options, scores, spec.num_layers, quality)
    if quality.training is not None:  # the same sweep without the adapters, on the same sequences and floor
        unaided = sweep_thresholds(options, scores, spec.num_layers, Unaided(quality))[3]
        for row, plain in zip(sweep, unaided, strict=True):
            row["layers_saved_per_prompt_without_adapters"] = plain["layers_saved_per_prompt"]
    report["threshold_sweep"] = sweep
    report["threshold"] = threshold
    floor_report = quality.report()
    if dropped := floor_report["dropped"]:
        log.warning(
            "%d candidate skip configuration(s) fell below the quality floor %.2f (agreement %s) and got no engine",
            len(dropped),
            quality.floor,
            ", ".join(f"{row['agreement']:.2f}" for row in dropped),
        )
    configs = [SkipConfig(f"s{n}", tuple(sorted(kept)), quality.adapts(kept)) for n, kept in enumerate(chosen, 1)]
    report["configs"] = configs_report(histogram, chosen, configs, spec.num_layers, len(sequences))
    report["configs"].update(max_configs=options.max_configs, quality=floor_report)
    adapters = quality.used_adapters(configs)
    files = {ROUTERS_FILE: routers_bytes(routers)}
    if adapters:
        files[SKIP_ADAPTERS_FILE] = adapters_bytes(adapters)
    return RouterPlan(routers, threshold, configs, adapters, report, files)


def thresholds_to_try(options: RouterOptions) -> tuple[float, ...]:
    """The router thresholds calibration compares: the one given, or THRESHOLDS ("auto", and the
    default with --lora: adapters pay only where the routers are allowed to skip more)."""
    given = options.router_threshold
    if given is None:
        return THRESHOLDS if options.lora else (THRESHOLD,)
    if given == "auto":
        return THRESHOLDS
    return (float(given),)


def kept_histogram(scores: list[list[float]], threshold: float) -> Counter[frozenset[int]]:
    """How many calibration prompts keep each layer set at this threshold (p_i >= threshold)."""
    return Counter(frozenset(i for i, p in enumerate(row) if p >= threshold) for row in scores)


def sweep_thresholds(
    options: RouterOptions, scores: list[list[float]], num_layers: int, quality: QualityFloor | Unaided
) -> tuple[float, Counter[frozenset[int]], list[frozenset[int]], list[dict[str, Any]]]:
    """The threshold whose configurations (each passing the floor) save the most layers per
    prompt, the lowest on a tie: (threshold, its kept-set histogram, its chosen sets, the sweep)."""
    best: tuple[float, Counter[frozenset[int]], list[frozenset[int]]] | None = None
    best_saved, sweep = -1, []
    thresholds = thresholds_to_try(options)
    for threshold in tqdm(thresholds, desc="router thresholds", unit="threshold", disable=len(thresholds) == 1):
        histogram = kept_histogram(scores, threshold)
        chosen = choose_configs(histogram, num_layers, options.max_configs, acceptable=quality.passes)
        saved = layers_saved(histogram, chosen, num_layers)
        sweep.append({"threshold": threshold, "layers_saved_per_prompt": round(saved / max(len(scores), 1), 3)})
        if saved > best_saved:
            best, best_saved = (threshold, histogram, chosen), saved
    assert best is not None  # at least one threshold is tried
    return (*best, sweep)


def configs_report(
    histogram: Counter[frozenset[int]], chosen: list[frozenset[int]], configs: list[SkipConfig], layers: int, n: int
) -> dict[str, Any]:
    """calibration.json's configs entry: the routers' kept sets, the chosen ones, the layers saved."""
    shares = served_share(histogram, chosen, layers)
    by_kept = {frozenset(c.kept): c for c in configs}
    full = SkipConfig(FULL_CONFIG, tuple(range(layers)))
    return {
        "histogram": [{"kept": sorted(k), "skipped": layers - len(k), "count": c} for k, c in histogram.most_common()],
        "chosen": [
            {
                "id": by_kept.get(k, full).id,
                "kept": sorted(k),
                "skipped": layers - len(k),
                "share": round(v, 4),
                "adapters": by_kept.get(k, full).adapters,
            }
            for k, v in shares.items()
        ],
        "expected_layers_saved_per_prompt": round(layers_saved(histogram, chosen, layers) / max(n, 1), 3),
        "rule": "superset: cheapest compiled configuration containing every kept layer; full always compiled",
    }


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


def quality_floor(
    options: RouterOptions,
    loaded: Any,
    sequences: list[TrainingSequence],
    scores: list[list[float]],
    floor: float,
) -> QualityFloor:
    """The floor every configuration must keep. With `--lora R`, one shared set of skip adapters
    trains on three of every four calibration sequences and the floor is measured on the fourth
    (held out), with and without them. Two sets of kept sets to train on are tried, and the
    adapters that let the threshold sweep skip more layers are kept (the first on a tie):
    `lowest_threshold_sets` (Gemma 3's layer 17 needs them) and `adapter_sets` (the 1.5B's fifth
    layer needs them; docs/routers.md)."""
    if not options.lora:
        return QualityFloor(loaded, sequences, floor)
    held_out = sequences[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY]
    training = [seq for index, seq in enumerate(sequences) if index % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    unaided = QualityFloor(loaded, held_out, floor)
    thresholds = thresholds_to_try(options)
    rules = {
        "lowest threshold": lowest_threshold_sets(scores, thresholds, loaded.spec.num_layers),
        "within reach": adapter_sets(scores, thresholds, unaided),
    }
    best, best_saved, saved_by_rule = unaided, -1, {}
    for rule, kept_sets in rules.items():
        if not kept_sets:
            continue
        quality = unaided.sibling()
        quality.training = train_skip_adapters(quality.model, training, kept_sets, options.lora, seed=options.seed)
        _, histogram, chosen, _ = sweep_thresholds(options, scores, loaded.spec.num_layers, quality)
        saved_by_rule[rule] = saved = layers_saved(histogram, chosen, loaded.spec.num_layers)
        if saved > best_saved:
            best, best_saved = quality, saved
            best.rule = rule
    if best.training is None:
        log.info("the routers keep every layer of every calibration prompt: no skip adapters to train")
    best.saved_by_rule = {rule: round(saved / max(len(scores), 1), 3) for rule, saved in saved_by_rule.items()}
    return best


def lowest_threshold_sets(
    scores: list[list[float]], thresholds: tuple[float, ...], layers: int
) -> list[frozenset[int]]:
    """The kept sets of the lowest threshold tried, each as often as the routers choose it."""
    full = frozenset(range(layers))
    histogram = kept_histogram(scores, min(thresholds))
    return sorted((k for k in histogram.elements() if k and k != full), key=sorted)


def adapter_sets(
    scores: list[list[float]], thresholds: tuple[float, ...], quality: QualityFloor
) -> list[frozenset[int]]:
    """The "within reach" kept sets (one of quality_floor's two): those the routers choose at any of `thresholds` (the
    most frequent ADAPTER_SETS, counted over every threshold) that keep at least floor -
    ADAPTER_REACH unaided. On the 1.5B, adapters trained this way (15 sets) keep 0.840 where the
    routers skip layers 1, 5, 13, 14 and 27 (0.798 unaided); trained on the lowest threshold's sets
    alone, which skip 1-3 layers and pass unaided, they kept 0.773 there (docs/routers.md)."""
    full = frozenset(range(quality.model.spec.num_layers))
    counts: Counter[frozenset[int]] = Counter()
    for threshold in thresholds:
        counts.update(kept_histogram(scores, threshold))
    del counts[full], counts[frozenset()]
    frequent = sorted(counts, key=lambda kept: (-counts[kept], sorted(kept)))[:ADAPTER_SETS]
    reach = quality.floor - ADAPTER_REACH
    return sorted((kept for kept in frequent if quality.unaided(kept) >= reach), key=sorted)


class QualityFloor:
    """Teacher-forced top-1 agreement of decoding with a kept set, measured once per set;
    a set passes if it keeps `floor` of the full model's greedy tokens. With trained skip
    adapters (`training`), each set is measured with and without them and takes the better.
    At most MAX_MEASUREMENTS sets are measured; later candidates do not pass."""

    def __init__(self, loaded: Any, sequences: list[TrainingSequence], floor: float) -> None:
        self.model = GatedModel(loaded).eval()
        self.sequences = sequences
        self.floor = floor
        self.measured: dict[frozenset[int], float] = {}
        self.adapted: dict[frozenset[int], float] = {}
        self.training: AdapterTraining | None = None
        self.rule = ""  # which kept sets the adapters trained on (quality_floor)
        self.saved_by_rule: dict[str, float] = {}
        self.unmeasured = 0  # candidates refused unmeasured, past MAX_MEASUREMENTS

    def sibling(self) -> QualityFloor:
        """A floor on the same model, sequences and unaided measurements, for other adapters."""
        other = copy.copy(self)
        other.adapted, other.training, other.unmeasured = {}, None, 0
        return other

    def passes(self, kept: frozenset[int]) -> bool:
        if not self.measurable(kept):
            return False
        self.unaided(kept)
        if self.training is not None and kept not in self.adapted:
            adapters = as_module_dict(self.training.adapters)
            self.adapted[kept] = round(adapted_agreement(self.model, self.sequences, kept, adapters), 4)
            log.info("  with skip adapters: %.3f", self.adapted[kept])
        return self.agreement(kept) >= self.floor

    def measurable(self, kept: frozenset[int], unaided: bool = False) -> bool:
        """Whether `kept` is measured or the budget still allows it (a refusal is counted). Each
        set of adapters has its own budget; the unaided measurements, which they share, theirs."""
        counted = self.measured if unaided or self.training is None else self.adapted
        if kept not in counted and len(counted) >= MAX_MEASUREMENTS:
            self.unmeasured += 1
            return False
        return True

    def unaided(self, kept: frozenset[int]) -> float:
        """The agreement of decoding with `kept` without adapters, measured once."""
        if kept not in self.measured:
            self.measured[kept] = round(continuation_agreement(self.model, self.sequences, kept), 4)
            log.info(
                "skipping layers %s keeps %.3f of the greedy tokens (floor %.2f)",
                sorted(set(range(len(self.model.layers))) - kept),
                self.measured[kept],
                self.floor,
            )
        return self.measured[kept]

    def agreement(self, kept: frozenset[int]) -> float:
        return max(self.measured[kept], self.adapted.get(kept, 0.0))

    def adapts(self, kept: frozenset[int]) -> bool:
        """Whether decoding with `kept` keeps more with the adapters than without them."""
        return self.adapted.get(kept, 0.0) > self.measured[kept]

    def used_adapters(self, configs: list[SkipConfig]) -> dict[int, Any]:
        """The adapters of the layers an adapting configuration keeps (what the bundle stores)."""
        if self.training is None:
            return {}
        layers = {layer for config in configs if config.adapters for layer in config.kept}
        return {layer: self.training.adapters[layer] for layer in sorted(layers)}

    def report(self) -> dict[str, Any]:
        rows = [
            {"kept": sorted(kept), "agreement": self.agreement(kept), "without_adapters": agreement}
            | ({"with_adapters": self.adapted[kept]} if kept in self.adapted else {})
            for kept, agreement in self.measured.items()
        ]
        report: dict[str, Any] = {
            "min_agreement": self.floor,
            "measured_on": f"{len(self.sequences)} calibration sequences"
            + (", held out from the skip adapters' training" if self.training is not None else ""),
            "measured": rows,
            "dropped": [row for row in rows if row["agreement"] < self.floor],
            "refused_unmeasured": self.unmeasured,
        }
        if self.training is not None:
            t = self.training
            report["skip_adapters"] = {
                "rank": t.rank,
                "epochs": t.epochs,
                "steps": t.steps,
                "decode_rows": t.decode_rows,
                "kept_sets": t.kept_sets,
                "kept_sets_rule": self.rule,
                "layers_saved_per_prompt_by_rule": self.saved_by_rule,
                "seconds": round(t.seconds, 1),
                "seed": t.seed,
            }
        return report


class Unaided:
    """The floor as a routed bundle without adapters sees it: the same sequences, budget and
    measurements, each set's agreement without the adapters."""

    def __init__(self, quality: QualityFloor) -> None:
        self.quality = quality

    def passes(self, kept: frozenset[int]) -> bool:
        return self.quality.measurable(kept, unaided=True) and self.quality.unaided(kept) >= self.quality.floor
