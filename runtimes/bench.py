"""`bench`: median prefill and TPOT of a bundle over repetitions, after one warm-up."""

from __future__ import annotations

import statistics
from typing import TypedDict

from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.generate import Generator
from adaptive_export.runtimes.settings import DEFAULT_DECODING, DecodingSettings


class BenchReport(TypedDict):
    """One `bench` line as printed (JSON): medians over the repetitions, and what ran."""

    prefill_ms: float
    tpot_ms: float
    tokens_per_s: float
    new_tokens: int
    prompt_tokens: int
    config: str
    mode: str
    repeat: int
    threads: int | str  # "ort-default" for 0
    provider: str


def bench_bundle(
    directory: str | Bundle,
    prompt: str,
    new_tokens: int,
    repeat: int,
    decoding: DecodingSettings = DEFAULT_DECODING,
    threads: int = 0,
    prepack: list[str] | None = None,
    provider: str = "cpu",
) -> BenchReport:
    generator = Generator(directory, threads=threads, prepack=prepack, provider=provider)
    generator.generate(prompt, max_new_tokens=new_tokens, decoding=decoding)  # warm-up
    runs = [generator.generate(prompt, max_new_tokens=new_tokens, decoding=decoding).stats for _ in range(repeat)]
    return {
        "prefill_ms": round(statistics.median(s.prefill_ms for s in runs), 2),
        "tpot_ms": round(statistics.median(s.tpot_ms for s in runs), 2),
        "tokens_per_s": round(1e3 / statistics.median(s.tpot_ms for s in runs), 1),
        "new_tokens": runs[-1].new_tokens,
        "prompt_tokens": runs[-1].prompt_tokens,
        "config": runs[-1].config,
        "mode": runs[-1].mode,
        "repeat": repeat,
        "threads": threads or "ort-default",
        "provider": provider,
    }
