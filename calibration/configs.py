"""Choose which skip configurations get a decode engine (docs/architecture.md section 2,
"Skip configurations and the superset rule").

At run time a sequence uses the cheapest compiled configuration whose kept set contains
every layer its routers kept (the superset rule; the full model always qualifies). So a
compiled set of configurations is worth sum over calibration prompts of the layers it
lets each prompt skip. Candidates are the observed kept sets and the unions of pairs of
them (a union serves both), and each observed set with one of its skipped layers kept
again (a smaller step back when a set fails the quality floor); up to K are chosen
greedily by marginal layers saved, then improved by swapping one chosen set for a
candidate while that saves more (greedy alone can miss the optimum: tests/test_routers.py
has a histogram where it does). With `acceptable` (the quality floor), a candidate is only
chosen if it passes, so a failing set gives way to the best passing one rather than
leaving its prompts on the full model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from itertools import combinations

KeptSet = frozenset[int]
# Each pick measures at most this many candidates against the quality floor, best first:
# a measurement is a teacher-forced pass over the calibration set (~15 s for SmolLM2).
MAX_TRIES_PER_PICK = 6


def layers_saved(histogram: Counter[KeptSet], compiled: Iterable[KeptSet], num_layers: int) -> int:
    """Total layers skipped over the calibration prompts when these sets (plus full) are compiled."""
    compiled = list(compiled)
    total = 0
    for kept, count in histogram.items():
        best = min((len(c) for c in compiled if kept <= c), default=num_layers)
        total += count * (num_layers - best)
    return total


def choose_configs(
    histogram: Counter[KeptSet], num_layers: int, max_configs: int, acceptable: Callable[[KeptSet], bool] | None = None
) -> list[KeptSet]:
    """At most max_configs kept sets (besides full) that save the most layers; each passes `acceptable`."""
    full = frozenset(range(num_layers))
    observed = [k for k in histogram if k != full]
    candidates = set(observed) | {a | b for a, b in combinations(observed, 2)}
    candidates |= {kept | {layer} for kept in observed for layer in full - kept}
    candidates -= {full, frozenset()}  # full is always compiled; a graph needs a layer
    passes = acceptable or (lambda kept: True)
    chosen: list[KeptSet] = []
    current = 0
    for _ in range(max_configs):
        gains = {c: layers_saved(histogram, chosen + [c], num_layers) - current for c in candidates}
        ranked = sorted((c for c in candidates if gains[c] > 0), key=lambda c: (-gains[c], len(c), sorted(c)))
        best = next((c for c in ranked[:MAX_TRIES_PER_PICK] if passes(c)), None)
        if best is None:
            break
        chosen.append(best)
        candidates.discard(best)
        current += gains[best]
    return _improve_by_swaps(histogram, chosen, candidates, num_layers, passes)


def _improve_by_swaps(
    histogram: Counter[KeptSet],
    chosen: list[KeptSet],
    candidates: set[KeptSet],
    num_layers: int,
    passes: Callable[[KeptSet], bool],
) -> list[KeptSet]:
    best_total = layers_saved(histogram, chosen, num_layers)
    improved = True
    while improved:
        improved = False
        for index in range(len(chosen)):
            for candidate in sorted(candidates, key=lambda c: (len(c), sorted(c))):
                trial = chosen[:index] + [candidate] + chosen[index + 1 :]
                total = layers_saved(histogram, trial, num_layers)
                if total > best_total and passes(candidate):
                    candidates.add(chosen[index])
                    candidates.discard(candidate)
                    chosen, best_total, improved = trial, total, True
                    break
    return chosen


def served_share(histogram: Counter[KeptSet], chosen: list[KeptSet], num_layers: int) -> dict[KeptSet, float]:
    """Share of calibration prompts each configuration (or full) serves under the superset rule."""
    full = frozenset(range(num_layers))
    total = sum(histogram.values()) or 1
    share: Counter[KeptSet] = Counter()
    for kept, count in histogram.items():
        options = [c for c in chosen if kept <= c] or [full]
        share[min(options, key=len)] += count
    return {config: share[config] / total for config in [*chosen, full]}
