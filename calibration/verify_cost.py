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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adaptive_export.runtimes.bundle import load_bundle
from adaptive_export.runtimes.generate import Generator
from adaptive_export.runtimes.pass_costs import VerifyCosts, time_passes

MAX_VERIFY_DRAFTS = 8  # k = 1..8: a T = k + 1 pass each
REPEATS = 9  # passes per width; the median is kept
CALIBRATION_KEY = "verify_cost"  # calibration.json: speculation.verify_cost


def measure_verify_costs(
    bundle_dir: Path, max_k: int = MAX_VERIFY_DRAFTS, repeats: int = REPEATS, threads: int = 0
) -> VerifyCosts:
    """Time the full configuration's decode engine at T = 1 .. max_k + 1 over a realistic prefix,
    in a Generator with the runtime's defaults."""
    return time_decode_passes(Generator(load_bundle(bundle_dir, verify="size"), threads=threads), max_k, repeats)


def time_decode_passes(generator: Generator, max_k: int = MAX_VERIFY_DRAFTS, repeats: int = REPEATS) -> VerifyCosts:
    """The generator's full-configuration decode engine timed at T = 1 .. max_k + 1 (its arena is
    overwritten; runtimes/pass_costs.py)."""
    return time_passes(generator.backend, generator.arena, generator.bundle, range(1, max_k + 2), repeats)


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
