"""Real engine latencies for the speculation choice, measured on the staged bundle.

Acceptance alone does not say whether speculation pays: a verify pass of T tokens is not
free on a CPU, and the draft engine pays for the whole LM head on every token. So after
the ONNX engines are exported (still in the staging directory), the build times them with
the runtime's own backend on an arena holding a realistic prefix:
- decode (full configuration) at T = 1 .. max_k + 1: plain decoding, and prompt-lookup
  verification of k drafts plus the bonus position;
- draft at T = 1 and verify at T = 1 .. max_k, when early-exit engines were built;
- the precision draft at T = 1, when one was built (its acceptance is measured by running
  the staged engines themselves, `measure_precision_acceptance`).
`choose_measured` then turns the simulated acceptance (calibration/measure.py) into
expected time per token for each source and k, and picks the fastest, or plain decoding.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.calibration.drafts import MEASURES
from adaptive_export.runtimes.bundle import load_bundle
from adaptive_export.runtimes.drafting import FREE_SOURCE
from adaptive_export.runtimes.generate import Generator

PREFIX_TOKENS = 64  # a typical chat prompt plus some generated tokens
REPEATS = 7
MIN_SPEEDUP = 1.05  # below this, auto keeps plain decoding: not worth the variance


def _median_ms(call: Callable[[], Any], repeats: int = REPEATS) -> float:
    call()  # warm-up: first-run allocations and kernel selection
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(samples), 3)


def measure_engine_latencies(
    bundle_dir: Path, max_k: int, threads: int = 0, prepack: bool | None = False
) -> dict[str, Any]:
    """Median ms per engine call on the full configuration: decode[T], draft (T=1), verify[T],
    precision draft (T=1).

    `prepack`: True: with ONNX Runtime's weight prepacking on the decode and verify engines
    (`run --prepack decode`), which makes T > 1 passes much cheaper on CPU; False: none;
    None: the runtime's default (what `run` does).
    """
    bundle = load_bundle(bundle_dir, verify="size")
    engines = bundle.config("full").engines
    choice = (
        None if prepack is None else [engines["decode"], engines.get("verify", engines["decode"])] if prepack else []
    )
    gen = Generator(bundle, threads=threads, prepack=choice)
    backend, arena = gen.backend, gen.arena
    prefix = min(PREFIX_TOKENS, gen.bundle.max_len - 2 * (max_k + 1))
    backend.run("prefill", np.ones((1, prefix), dtype=np.int64), arena, 0)
    decode = {
        t: _median_ms(lambda t=t: backend.run(engines["decode"], np.ones((1, t), dtype=np.int64), arena, prefix))
        for t in range(1, max_k + 2)
    }
    result: dict[str, Any] = {"prefix_tokens": prefix, "threads": threads, "prepack": prepack, "decode_ms": decode}
    if "draft" in engines and "verify" in engines:
        hidden = np.zeros((1, max_k, gen.bundle.model.hidden_size), dtype=np.float32)
        result["draft_ms"] = _median_ms(
            lambda: backend.run(engines["draft"], np.ones((1, 1), dtype=np.int64), arena, prefix)
        )
        result["verify_ms"] = {
            t: _median_ms(lambda t=t: backend.run(engines["verify"], hidden[:, :t], arena, prefix))
            for t in range(1, max_k + 1)
        }
    if "precision_draft" in engines:
        result["precision_draft_ms"] = _median_ms(
            lambda: backend.run(engines["precision_draft"], np.ones((1, 1), dtype=np.int64), arena, prefix)
        )
    return result


PRECISION_PROMPTS = 8
PRECISION_TOKENS = 32


def measure_precision_acceptance(bundle_dir: Path, prompts: list[str], max_k: int, threads: int = 0) -> dict[str, Any]:
    """Acceptance of the precision draft as built: real greedy speculative runs of the staged
    engines on the calibration prompts, per draft length k. (Simulating it on the PyTorch
    model would miss exactly what differs: the engines' quantized weights and activations.)"""
    gen = Generator(load_bundle(bundle_dir, verify="size"), threads=threads)
    per_k: dict[str, Any] = {}
    for k in range(1, max_k + 1):
        drafted = accepted = rounds = 0
        for prompt in prompts[:PRECISION_PROMPTS]:
            stats = gen.generate(
                prompt, max_new_tokens=PRECISION_TOKENS, mode="spec", draft="precision", draft_len=k
            ).stats.speculation
            drafted, accepted, rounds = (
                drafted + stats["drafted"],
                accepted + stats["accepted"],
                rounds + stats["rounds"],
            )
        per_k[str(k)] = {
            "acceptance": round(accepted / max(drafted, 1), 4),
            "tokens_per_round": round((accepted + rounds) / max(rounds, 1), 4),
        }  # a round emits accepted + 1
    return {"prompts": min(len(prompts), PRECISION_PROMPTS), "new_tokens": PRECISION_TOKENS, "per_k": per_k}


def choose_measured(
    measured: dict[str, Any],
    latencies: dict[str, Any],
    exit_layer: int | None,
    sources: Collection[str] | None = None,
) -> dict[str, Any]:
    """Expected speed-up over plain decoding per (source, k) from acceptance x measured latency.

    Each source prices its rounds (calibration/drafts/<name>.py): prompt lookup one decode pass
    at T = k + 1 (drafts plus the bonus position) or a T = 1 pass without drafts; early exit k
    draft calls plus one verify pass at T = k; precision k precision-draft calls plus one decode
    pass at T = k + 1. Speed-up = tokens per round x (T=1 decode ms) / round ms.
    """
    # the free source (no engines of its own) first: it wins ties
    measures = sorted(MEASURES.values(), key=lambda measure: measure.name != FREE_SOURCE)
    if sources is not None:  # only these sources may be chosen
        measures = [measure for measure in measures if measure.name in sources]
    candidates = [c for measure in measures for c in measure.latency_candidates(measured, latencies, exit_layer)]
    best = max(candidates, key=lambda c: c["expected_speedup"])
    by_source = {
        source: max((c for c in candidates if c["source"] == source), key=lambda c: c["expected_speedup"])
        for source in {c["source"] for c in candidates}
    }
    return {
        "best": best,
        "by_source": by_source,
        "candidates": candidates,
        "auto_enabled": best["expected_speedup"] > MIN_SPEEDUP,
        "min_speedup": MIN_SPEEDUP,
    }


def verify_costs(decode_ms: dict[int, float]) -> dict[str, float]:
    """Cost of verifying k lookup drafts (a T=k+1 pass) in T=1 passes, per k."""
    return {str(k): round(decode_ms[k + 1] / decode_ms[1], 3) for k in decode_ms if k + 1 in decode_ms}
