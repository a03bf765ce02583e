"""What verifying k drafts costs on the bundle's own decode engine, measured at build time.

A verify pass of T = k + 1 tokens costs a different multiple of a T=1 pass at each weight
precision: with prepacked fp32 weights a T=5 pass costs little more than a T=1 pass, while
MatMulNBits at accuracy level 4 on a CPU without VNNI costs about 2.1-2.4 T=1 passes for T=5.
Every draft source that verifies with the decode engine (prompt lookup, precision) pays exactly
that pass, so `build --speculate auto` times it here on the built engines as `run` runs them
(the runtime's own session options, the bundle's own accuracy level) and the choice of source
and draft length prices its rounds with these ratios instead of a cost model. The result is
calibration.json's `speculation.verify_cost` (docs/speculation.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.runtimes.bundle import load_bundle
from adaptive_export.runtimes.generate import Generator

MAX_VERIFY_DRAFTS = 8  # k = 1..8: a T = k + 1 pass each
REPEATS = 9  # passes per width; the median is kept
PREFIX_TOKENS = 64  # a typical chat prompt plus some generated tokens
CALIBRATION_KEY = "verify_cost"  # calibration.json: speculation.verify_cost


@dataclass(frozen=True)
class VerifyCosts:
    """Median milliseconds of the decode engine's pass per width T, and what they make of a
    verify pass of k drafts: `cost(k)` = ms(T = k + 1) / ms(T = 1)."""

    engine: str
    prefix_tokens: int
    repeats: int
    pass_ms: Mapping[int, float]  # T -> median ms

    def cost(self, k: int) -> float:
        return round(self.pass_ms[k + 1] / self.pass_ms[1], 3)

    def costs(self) -> dict[str, float]:
        """Verify cost per draft length k, in T=1 passes (keys are strings, as in the manifest)."""
        return {str(k): self.cost(k) for k in sorted(self.pass_ms) if k >= 1 and k + 1 in self.pass_ms}

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "prefix_tokens": self.prefix_tokens,
            "repeats": self.repeats,
            "pass_ms": {str(t): ms for t, ms in sorted(self.pass_ms.items())},
            "cost": self.costs(),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> VerifyCosts:
        pass_ms = {int(t): float(ms) for t, ms in obj["pass_ms"].items()}
        return cls(str(obj["engine"]), int(obj["prefix_tokens"]), int(obj["repeats"]), pass_ms)


def measure_verify_costs(
    bundle_dir: Path, max_k: int = MAX_VERIFY_DRAFTS, repeats: int = REPEATS, threads: int = 0
) -> VerifyCosts:
    """Time the full configuration's decode engine at T = 1 .. max_k + 1 over a realistic prefix,
    in a Generator with the runtime's defaults."""
    return time_decode_passes(Generator(load_bundle(bundle_dir, verify="size"), threads=threads), max_k, repeats)


def time_decode_passes(generator: Generator, max_k: int = MAX_VERIFY_DRAFTS, repeats: int = REPEATS) -> VerifyCosts:
    """The generator's full-configuration decode engine timed at T = 1 .. max_k + 1 (its arena is
    overwritten). The widths are interleaved within each repetition, so a neighbour's load on a
    shared machine shifts every width alike instead of whichever width happened to run then."""
    backend, arena, bundle = generator.backend, generator.arena, generator.bundle
    engine = bundle.config("full").decode
    prefix = max(1, min(PREFIX_TOKENS, bundle.max_len - 2 * (max_k + 1)))
    backend.run("prefill", np.ones((1, prefix), dtype=np.int64), arena, 0)
    widths = range(1, max_k + 2)
    inputs = {t: np.ones((1, t), dtype=np.int64) for t in widths}
    samples: dict[int, list[float]] = {t: [] for t in widths}
    for t in widths:  # warm-up: first-run allocations and kernel selection per shape
        backend.run(engine, inputs[t], arena, prefix)
    for _ in range(repeats):
        for t in widths:
            started = time.perf_counter()
            backend.run(engine, inputs[t], arena, prefix)
            samples[t].append((time.perf_counter() - started) * 1e3)
    pass_ms = {t: round(statistics.median(ms), 4) for t, ms in samples.items()}
    return VerifyCosts(engine, prefix, repeats, pass_ms)


def recorded_verify_costs(speculation: Mapping[str, Any]) -> VerifyCosts | None:
    """The measurement calibration.json's `speculation` section holds, if any."""
    entry = speculation.get(CALIBRATION_KEY)
    return VerifyCosts.from_json(entry) if isinstance(entry, Mapping) else None


def priced_with(latencies: Mapping[str, Any], costs: VerifyCosts) -> dict[str, Any]:
    """`latencies` (calibration/latency.py) with each decode pass of T = k + 1 priced at the
    measured verify cost times that measurement's own T=1 pass: the choice then reads the
    ratios measured here, on the same scale as its draft-engine latencies."""
    decode = {int(t): float(ms) for t, ms in latencies["decode_ms"].items()}
    step = decode[1]
    for k in range(1, max(costs.pass_ms)):
        decode[k + 1] = round(step * costs.cost(k), 3)
    return {**latencies, "decode_ms": decode}
