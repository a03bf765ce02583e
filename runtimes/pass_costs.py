"""What a decode pass of T rows costs against a one-row pass, timed on the engine as it runs.

A verify pass of T = k + 1 tokens costs a different multiple of a T=1 pass on every CPU and at
every weight form (a T=2 pass of Qwen2.5-Coder-1.5B: 1.14 one-row passes with packed rows on an
AVX-512 VNNI Xeon, 1.16-1.27 with MatMulNBits on Zen 3). `build` times it on the built engines
(calibration/verify_cost.py, calibration/prompt_rows.py) and the runtime times it again on a
machine other than the build's (runtimes/rows_recheck.py): the same interleaved medians, numpy and
the backend only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptive_export.runtimes.backends.base import Backend
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.kv_arena import KVArena

PREFIX_TOKENS = 64  # a typical chat prompt plus some generated tokens


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

    def of_rows(self, rows: int) -> float:
        """A pass of `rows` rows in T=1 passes; wider than timed: extended by the last measured step."""
        widest = max(self.pass_ms)
        if rows <= widest:
            return self.cost(rows - 1)
        step = self.cost(widest - 1) - self.cost(widest - 2) if widest >= 2 else 1.0
        return self.cost(widest - 1) + (rows - widest) * step

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


def time_passes(backend: Backend, arena: KVArena, bundle: Bundle, widths: Iterable[int], repeats: int) -> VerifyCosts:
    """The full configuration's decode engine timed at each width over a prefix of PREFIX_TOKENS
    (the arena is overwritten). Widths are interleaved within each repetition, so a neighbour's
    load shifts every width alike instead of whichever width happened to run then."""
    engine = bundle.config("full").decode
    order = sorted({1, *widths})
    prefix = max(1, min(PREFIX_TOKENS, bundle.max_len - 2 * max(order)))
    backend.run("prefill", np.ones((1, prefix), dtype=np.int64), arena, 0)
    inputs = {t: np.ones((1, t), dtype=np.int64) for t in order}
    samples: dict[int, list[float]] = {t: [] for t in order}
    for t in order:  # warm-up: first-run allocations and kernel selection per shape
        backend.run(engine, inputs[t], arena, prefix)
    for _ in range(repeats):
        for t in order:
            started = time.perf_counter()
            backend.run(engine, inputs[t], arena, prefix)
            samples[t].append((time.perf_counter() - started) * 1e3)
    pass_ms = {t: round(statistics.median(ms), 4) for t, ms in samples.items()}
    return VerifyCosts(engine, prefix, repeats, pass_ms)
