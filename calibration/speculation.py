"""Choose self-speculation for a bundle: exit layer E, draft length k, and whether it pays.

`--speculate E:k` forces them. `--speculate auto` measures, on the calibration prompts:
- early-exit agreement per candidate E: how often the head on layer E's hidden state
  (argmax) equals the full model's token, teacher-forced over the model's own greedy
  continuation (what the draft must predict to be accepted);
- prompt-lookup acceptance on the same continuations;
- with `--exit-adapter fit|FILE`: early exit only at the adapters' exits, drafts through
  the adapter (calibration/exit_adapters.py).
The exit layer E whose draft/verify engines are built is chosen with a cost model in
layer-equivalents (one decoder layer = 1; the LM head costs head_params / layer_params).
Once the engines exist, `finalize_with_latencies` times them on the staged bundle and
makes the final choice of source, k and whether `--mode auto` speculates from measured
milliseconds (calibration/latency.py); everything measured goes to calibration.json.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_export.calibration.draft_builds import SourceBuild
from adaptive_export.calibration.draft_sources import MAX_DRAFT
from adaptive_export.calibration.drafts import MEASURES
from adaptive_export.calibration.exit_adapters import (
    ExitAdapterFit,
    candidate_exits,
    greedy_runs,
    resolve_exit_adapters,
)
from adaptive_export.calibration.latency import (
    MIN_SPEEDUP,
    choose_measured,
    measure_engine_latencies,
    measure_precision_acceptance,
    verify_costs,
)
from adaptive_export.calibration.measure import calibration_prompts, measure_speculation
from adaptive_export.calibration.verify_cost import CALIBRATION_KEY, measure_verify_costs, priced_with
from adaptive_export.calibration.verify_exactness import measure_verify_exactness
from adaptive_export.graphs.drafts.early_exit import ExitPlan
from adaptive_export.loading.artifacts import ADAPTERS_FILE, adapters_bytes
from adaptive_export.runtimes.drafting import SOURCES
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest_speculation import EXACTNESS_KEY, MIN_ROWS_KEY, MULTI_ROW_KEY

DEFAULT_CALIB_TOKENS = 32


def parse_forced(text: str, num_layers: int) -> tuple[int, int]:
    try:
        exit_text, k_text = text.split(":")
        exit_layer, k = int(exit_text), int(k_text)
    except ValueError:
        raise UsageError(
            f"--speculate {text!r} is neither 'auto' nor 'E:k'", "pass --speculate auto, or e.g. --speculate 20:4"
        ) from None
    if not 0 < exit_layer < num_layers:
        raise UsageError(
            f"exit layer {exit_layer} is outside 1..{num_layers - 1}",
            f"choose an exit layer between 1 and {num_layers - 1}",
        )
    if not 0 < k <= 16:
        raise UsageError(f"draft length {k} is outside 1..16", "choose a draft length such as 3 or 4")
    return exit_layer, k


@dataclass(frozen=True)
class SpeculationOptions:
    """What `build --speculate ...` asks of speculation calibration."""

    speculate: str  # "auto", or "E:k"
    exit_adapter: str = "none"  # none | fit | an exit_adapters.safetensors file
    calib: str | None = None  # calibration prompts (JSONL); None: the built-in set
    seed: int = 0


def plan_speculation(
    options: SpeculationOptions, loaded: Any, parts: Any, built: Sequence[SourceBuild] = ()
) -> tuple[ExitPlan, dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """ExitPlan, manifest `speculation`, calibration.json entries and extra bundle files.

    `built`: the sources made by their own build options (calibration/draft_builds.py), each with
    its simulated rounds, a candidate beside the other sources.

    With `--exit-adapter fit|FILE` the early-exit candidates are the adapters' exits, their
    drafts are simulated through the adapter, and the chosen exit's adapter is shipped.
    """
    spec = loaded.spec
    option, adapter_option = options.speculate, options.exit_adapter or "none"
    if option != "auto":
        exit_layer, k = parse_forced(option, spec.num_layers)
        fit = None
        if adapter_option != "none":
            prompts = calibration_prompts(options.calib) if adapter_option == "fit" else []
            fit = resolve_exit_adapters(adapter_option, loaded, [exit_layer], prompts, None, options.seed)
            require_adapter(fit, exit_layer, adapter_option)
        adapter, files = ship_adapter(fit, exit_layer, parts)
        manifest = {
            "source": "early_exit",
            "exit_layer": exit_layer,
            "early_exit": {"draft_len": k},
            "adapter": adapter,
            "auto_enabled": False,
            "chosen_by": "forced with --speculate",
        }
        calibration: dict[str, Any] = {"forced": manifest}
        keep_built_sections(built, manifest, calibration)
        if fit is not None:
            calibration["exit_adapters"] = {**fit.report, "shipped": exit_layer}
        return ExitPlan(exit_layer, k, adapter=adapter), manifest, {"speculation": calibration}, files
    return _plan_auto(options, loaded, parts, built)


def keep_built_sections(built: Sequence[SourceBuild], manifest: dict[str, Any], calibration: dict[str, Any]) -> None:
    """A chosen speculation keeps the built sources' manifest sections and simulated rounds."""
    for source in built:
        manifest[source.name] = source.section
        calibration[source.name] = source.rounds


def _plan_auto(
    options: SpeculationOptions, loaded: Any, parts: Any, built: Sequence[SourceBuild]
) -> tuple[ExitPlan, dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """`--speculate auto`: measure every source on the calibration prompts and choose (the
    draft/verify engines are built for the best early exit either way)."""
    spec, adapter_option = loaded.spec, options.exit_adapter or "none"
    prompts = calibration_prompts(options.calib)
    fit, runs = None, None
    if adapter_option != "none":
        runs = greedy_runs(loaded, prompts, DEFAULT_CALIB_TOKENS)
        fit = resolve_exit_adapters(
            adapter_option, loaded, candidate_exits(spec.num_layers), prompts, runs, options.seed
        )
    measured = measure_speculation(
        loaded, parts, prompts, DEFAULT_CALIB_TOKENS, adapters=fit.adapters if fit else None, runs=runs
    )
    measured.update((source.name, source.rounds) for source in built)
    choice = choose(measured, spec)
    early = choice["best_early_exit"]  # draft/verify engines are built for the best early exit either way
    adapter, files = ship_adapter(fit, early["exit_layer"], parts)
    manifest = {
        "source": choice["source"],
        "auto_enabled": choice["auto_enabled"],
        "expected_speedup": choice["expected_speedup"],
        "exit_layer": early["exit_layer"],
        "adapter": adapter,
        "chosen_by": "calibration (--speculate auto)",
        **{
            source: {
                "draft_len": choice[f"best_{source}"]["draft_len"],
                "expected_speedup": choice[f"best_{source}"]["expected_speedup"],
            }
            for source in MEASURES
            if f"best_{source}" in choice
        },
    }
    calibration = {**measured, "choice": choice}
    if fit is not None:
        calibration["exit_adapters"] = {**fit.report, "shipped": early["exit_layer"]}
    return (
        ExitPlan(early["exit_layer"], early["draft_len"], adapter=adapter),
        manifest,
        {"speculation": calibration},
        files,
    )


def choose_two_rows(
    root: Path, spec: dict[str, Any], measured: dict[str, Any], priced: dict[str, Any], choice: dict[str, Any]
) -> dict[str, Any]:
    """Where T=1 steps are not what a verify pass computes: whether two-row steps are (the plain pass
    carries one guess), and if so whether speculating on them still beats T=1 plain decoding, with
    every round without drafts priced as a T=2 pass and only sources whose kept rows the decode engine
    writes. Then the bundle decodes two rows at least (`min_decode_rows`), and that choice is auto's."""
    two_rows = measure_verify_exactness(root, MAX_DRAFT, plain_rows=2)
    measured[MULTI_ROW_KEY] = spec[MULTI_ROW_KEY] = two_rows.to_json()
    if not two_rows.exact:
        return choice
    exact_sources = [name for name, source in SOURCES.items() if source.decode_engine_rows]
    floor_priced = {**priced, "floor_ms": priced["decode_ms"][2]}
    floor_choice = choose_measured(measured, floor_priced, spec.get("exit_layer"), exact_sources)
    measured["two_row_choice"] = floor_choice
    if not floor_choice["auto_enabled"]:
        return choice
    spec[MIN_ROWS_KEY] = 2
    return floor_choice


def require_adapter(fit: ExitAdapterFit, exit_layer: int, option: str) -> None:
    if exit_layer not in fit.adapters:
        raise UsageError(
            f"exit adapter file {option!r} has no adapter for exit layer {exit_layer} (it has {sorted(fit.adapters)})",
            "force an exit layer the file has with --speculate E:k, or pass --exit-adapter fit",
        )


def ship_adapter(fit: ExitAdapterFit | None, exit_layer: int, parts: Any) -> tuple[bool, dict[str, bytes]]:
    """Put the chosen exit's adapter into the graphs (weights.bin) and the bundle's adapters file."""
    adapter = fit.adapters.get(exit_layer) if fit is not None else None
    if adapter is None:
        return False, {}
    parts.exit_adapters = {exit_layer: adapter}
    return True, {ADAPTERS_FILE: adapters_bytes({exit_layer: adapter})}


def choose(measured: dict[str, Any], spec: Any) -> dict[str, Any]:
    """Best expected speed-up over plain decoding among early exit (E, k) and prompt lookup (k).

    Tokens per round come from the exact greedy simulation; a round costs k draft steps of
    (E layers + head) plus one verify pass of the other layers + head (early exit), or one
    decode pass (prompt lookup), in layer-equivalents against a full step of L layers + head.
    """
    layers, head = spec.num_layers, measured["head_cost_layers"]
    adapter = measured.get("adapter_cost_layers", 0.0)  # a draft step through the exit adapter
    candidates = [c for measure in MEASURES.values() for c in measure.cost_candidates(measured, layers, head, adapter)]
    best = max(candidates, key=lambda c: c["expected_speedup"])
    by_source = {
        source: max((c for c in candidates if c["source"] == source), key=lambda c: c["expected_speedup"])
        for source in MEASURES
        if any(c["source"] == source for c in candidates)
    }
    return {
        **best,
        "auto_enabled": best["expected_speedup"] > MIN_SPEEDUP,
        **{f"best_{s}": c for s, c in by_source.items()},
        "candidates": len(candidates),
    }


def finalize_with_latencies(
    root: Path, manifest: dict[str, Any], calibration: dict[str, Any], prompts: list[str] | None = None
) -> None:
    """Time the staged engines; choose source, k and auto from acceptance x measured latency.

    Candidates are costed with the latencies of the runtime's own defaults (`as_run`); a
    precision draft's acceptance is measured by running its staged engines on `prompts`."""
    spec = manifest["speculation"]
    latencies = measure_engine_latencies(root, MAX_DRAFT)
    prepacked = measure_engine_latencies(root, MAX_DRAFT, prepack=True)
    as_run = measure_engine_latencies(root, MAX_DRAFT, prepack=None)
    if "precision_draft_ms" in as_run and prompts:
        calibration["speculation"]["precision"] = measure_precision_acceptance(root, prompts, MAX_DRAFT)
    verify_timed = measure_verify_costs(root, MAX_DRAFT)  # T=k+1 vs T=1 on the decode engine, at the bundle's precision
    calibration["speculation"][CALIBRATION_KEY] = verify_timed.to_json()
    exactness = measure_verify_exactness(root, MAX_DRAFT)  # does that pass reproduce T=1 steps? (auto reads it)
    calibration["speculation"][EXACTNESS_KEY] = spec[EXACTNESS_KEY] = exactness.to_json()
    priced = priced_with(as_run, verify_timed)
    choice = choose_measured(calibration["speculation"], priced, spec.get("exit_layer"))
    if not exactness.exact:
        choice = choose_two_rows(root, spec, calibration["speculation"], priced, choice)
    best = choice["best"]
    spec.update(
        source=best["source"],
        auto_enabled=choice["auto_enabled"],
        expected_speedup=best["expected_speedup"],
        chosen_by="calibration (--speculate auto): simulated acceptance x measured engine latencies",
    )
    for source, candidate in choice["by_source"].items():
        spec[source] = {"draft_len": candidate["draft_len"], "expected_speedup": candidate["expected_speedup"]}
    # gated prompt lookup (runtime, --mode auto) drafts only while accepted drafts pay for this
    # both verify with the decode engine at T=k+1: the same measured costs
    verify = {
        "verify_cost": verify_costs(latencies["decode_ms"]),
        "verify_cost_prepacked": verify_costs(prepacked["decode_ms"]),
    }
    spec.setdefault("prompt_lookup", {}).update(verify)
    if "precision" in choice["by_source"]:
        spec["precision"].update(
            draft_cost=round(as_run["precision_draft_ms"] / as_run["decode_ms"][1], 3),
            acceptance=choice["by_source"]["precision"]["acceptance"],
            **verify,
        )
    for name in choice["by_source"]:  # a source whose verify pass is wider than lookup's prices its own
        for key, timed in (("verify_cost", latencies), ("verify_cost_prepacked", prepacked)):
            wide = MEASURES[name].wide_verify_costs(calibration["speculation"].get(name), timed["decode_ms"])
            if wide is not None:
                spec[name][key] = wide
    calibration["speculation"].update(
        latencies=latencies, latencies_prepacked=prepacked, latencies_as_run=as_run, measured_choice=choice
    )
    (root / "calibration.json").write_text(json.dumps(calibration, indent=2) + "\n")
