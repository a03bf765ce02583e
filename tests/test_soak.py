"""Long runs on one loaded bundle: generate to max_len repeatedly; no RSS growth, same output."""
from __future__ import annotations

import resource
from pathlib import Path

from runtimes import Generator, SamplingParams


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_repeated_generation_to_max_len_is_stable(tiny_bundle: Path) -> None:
    generator = Generator(tiny_bundle)
    prompt = generator.codec.encode("The quick brown fox", raw=True)
    budget = generator.bundle.max_len - len(prompt)
    generator.codec.eos_ids = set()  # run all the way to max_len every time
    modes = [("full", "ar", SamplingParams()), ("auto", "auto", SamplingParams()), ("full", "ar", SamplingParams(temperature=0.8, seed=3))]
    first: dict[int, list[int]] = {}
    baseline = None
    for repetition in range(12):
        config, mode, sampling = modes[repetition % len(modes)]
        result = generator.generate(prompt, max_new_tokens=budget, config=config, mode=mode, sampling=sampling)
        assert len(result.tokens) == budget and generator.arena.length == generator.bundle.max_len - 1
        first.setdefault(repetition % len(modes), result.tokens)
        assert result.tokens == first[repetition % len(modes)], "output changed across repetitions"
        if repetition == len(modes) - 1:
            baseline = rss_mb()
    assert baseline is not None
    assert rss_mb() - baseline < 20, "RSS grew across repetitions"
