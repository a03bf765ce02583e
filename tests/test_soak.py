"""Long runs on one loaded bundle: generate to max_len repeatedly, alternating skip
configurations, decoding modes and sampling; output identical per setting, RSS flat.

The bundle is the routed tiny bundle (full + skip configurations, each its own decode
engine), so alternating really switches engines. RSS is measured once every setting has
run (sessions, arena and buffers all exist) and may grow by at most GROWTH_LIMIT_MB over
the remaining repetitions: a leak of even one arena or logits buffer per generation
(about 0.2 MB here) exceeds it within the run.
"""

from __future__ import annotations

import resource
from pathlib import Path

from adaptive_export.runtimes import Generator, SamplingParams

GROWTH_LIMIT_MB = 2.0
ROUNDS = 4


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_repeated_generation_to_max_len_is_stable(router_setup: tuple[Path, Path, Path]) -> None:
    _, routed, _ = router_setup
    generator = Generator(routed)
    configs = [c.id for c in generator.bundle.manifest.configs]
    assert len(configs) >= 2, "the soak needs a bundle with skip configurations"
    prompt = generator.codec.encode("The quick brown fox", raw=True)
    budget = generator.bundle.max_len - len(prompt)
    generator.codec.eos_ids = set()  # run all the way to max_len every time
    settings = [(c, "ar", SamplingParams()) for c in configs]
    settings += [
        ("auto", "auto", SamplingParams()),
        (configs[-1], "ar", SamplingParams(temperature=0.8, seed=3)),
        ("full", "spec", SamplingParams()),
    ]
    first: dict[int, list[int]] = {}
    baseline = None
    for repetition in range(ROUNDS * len(settings)):
        index = repetition % len(settings)
        config, mode, sampling = settings[index]
        result = generator.generate(prompt, max_new_tokens=budget, config=config, mode=mode, sampling=sampling)
        assert len(result.tokens) == budget and generator.arena.length >= generator.bundle.max_len - 2
        first.setdefault(index, result.tokens)
        assert result.tokens == first[index], f"output of setting {settings[index][:2]} changed across repetitions"
        if repetition == len(settings) - 1:
            baseline = rss_mb()
    assert baseline is not None
    growth = rss_mb() - baseline
    assert growth < GROWTH_LIMIT_MB, f"RSS grew {growth:.2f} MB across {ROUNDS - 1} rounds of {len(settings)} settings"
