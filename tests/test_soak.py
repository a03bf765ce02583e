"""Long runs on one loaded bundle: generate to max_len repeatedly, alternating skip
configurations, decoding modes and sampling; output identical per setting, RSS flat.

The bundle is the routed tiny bundle (full + skip configurations, each its own decode
engine), so alternating really switches engines. RSS is measured once every setting has
run (sessions, arena and buffers all exist) and may grow by at most GROWTH_LIMIT_MB over
the remaining repetitions: a leak of even one arena or logits buffer per generation
(about 0.2 MB here) exceeds it within the run. The soak runs in a child process, so the
RSS is the runtime's alone, not pytest's with every other test's fixtures and garbage.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GROWTH_LIMIT_MB = 2.0
ROUNDS = 4
ROOT = Path(__file__).parents[1]


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass(frozen=True)
class Generation:
    """One repetition: which setting, its tokens and the arena length it left."""

    setting: int
    tokens: list[int]
    arena_length: int


@dataclass(frozen=True)
class SoakRun:
    """What the child reports: the settings, every generation, and RSS before and after the
    repetitions that follow the first round."""

    configs: list[str]
    settings: list[tuple[str, str]]
    budget: int
    max_len: int
    generations: list[Generation]
    baseline_mb: float
    final_mb: float


def soak(routed: str) -> SoakRun:
    """The soak itself, run in the child: ROUNDS rounds over every setting on one Generator."""
    from adaptive_export.runtimes import Generator, SamplingParams

    generator = Generator(routed)
    configs = [c.id for c in generator.bundle.manifest.configs]
    prompt = generator.codec.encode("The quick brown fox", raw=True)
    budget = generator.bundle.max_len - len(prompt)
    generator.codec.eos_ids = set()  # run all the way to max_len every time
    settings = [(c, "ar", SamplingParams()) for c in configs]
    settings += [
        ("auto", "auto", SamplingParams()),
        (configs[-1], "ar", SamplingParams(temperature=0.8, seed=3)),
        ("full", "spec", SamplingParams()),
    ]
    generations = []
    baseline = 0.0
    for repetition in range(ROUNDS * len(settings)):
        index = repetition % len(settings)
        config, mode, sampling = settings[index]
        result = generator.generate(prompt, max_new_tokens=budget, config=config, mode=mode, sampling=sampling)
        generations.append(Generation(index, list(result.tokens), generator.arena.length))
        if repetition == len(settings) - 1:
            baseline = rss_mb()
    labels = [(config, mode) for config, mode, _ in settings]
    return SoakRun(configs, labels, budget, generator.bundle.max_len, generations, baseline, rss_mb())


def soak_in_child(routed: Path) -> SoakRun:
    code = "import json, sys; from dataclasses import asdict; from tests.test_soak import soak; "
    code += "print(json.dumps(asdict(soak(sys.argv[1]))))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(routed)], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.splitlines()[-1])
    generations = [Generation(**g) for g in data.pop("generations")]
    return SoakRun(**data, generations=generations)


def test_repeated_generation_to_max_len_is_stable(router_setup: tuple[Path, Path, Path]) -> None:
    _, routed, _ = router_setup
    run = soak_in_child(routed)
    assert len(run.configs) >= 2, "the soak needs a bundle with skip configurations"
    first: dict[int, list[int]] = {}
    for generation in run.generations:
        assert len(generation.tokens) == run.budget and generation.arena_length >= run.max_len - 2
        first.setdefault(generation.setting, generation.tokens)
        assert generation.tokens == first[generation.setting], (
            f"output of setting {run.settings[generation.setting]} changed across repetitions"
        )
    assert len(run.generations) == ROUNDS * len(run.settings)
    growth = run.final_mb - run.baseline_mb
    assert growth < GROWTH_LIMIT_MB, (
        f"RSS grew {growth:.2f} MB across {ROUNDS - 1} rounds of {len(run.settings)} settings"
    )
