"""Choose which skip configurations get a decode engine (DESIGN.md sections 3 and 5).

At run time a sequence uses the cheapest compiled configuration whose kept set contains
every layer its routers kept (the superset rule; the full model always qualifies). So a
compiled set of configurations is worth sum over calibration prompts of the layers it
lets each prompt skip. Candidates are the observed kept sets and the unions of pairs of
them (a union serves both); up to K are chosen greedily by marginal layers saved, then
improved by swapping one chosen set for a candidate while that saves more (greedy alone
can miss the optimum: tests/test_routers.py has a histogram where it does).
"""
from __future__ import annotations

from collections import Counter
from itertools import combinations
from typing import Iterable

KeptSet = frozenset[int]


def layers_saved(histogram: Counter[KeptSet], compiled: Iterable[KeptSet], num_layers: int) -> int:
    """Total layers skipped over the calibration prompts when these sets (plus full) are compiled."""
    compiled = list(compiled)
    total = 0
    for kept, count in histogram.items():
        best = min((len(c) for c in compiled if kept <= c), default=num_layers)
        total += count * (num_layers - best)
    return total


def choose_configs(histogram: Counter[KeptSet], num_layers: int, max_configs: int) -> list[KeptSet]:
    full = frozenset(range(num_layers))
    observed = [k for k in histogram if k != full]
    candidates = set(observed) | {a | b for a, b in combinations(observed, 2)}
    candidates.discard(full)
    chosen: list[KeptSet] = []
    current = 0
    for _ in range(max_configs):
        best, best_gain = None, 0
        for candidate in sorted(candidates, key=lambda c: (len(c), sorted(c))):
            gain = layers_saved(histogram, chosen + [candidate], num_layers) - current
            if gain > best_gain:
                best, best_gain = candidate, gain
        if best is None:
            break
        chosen.append(best)
        candidates.discard(best)
        current += best_gain
    return _improve_by_swaps(histogram, chosen, candidates, num_layers)


def _improve_by_swaps(histogram: Counter[KeptSet], chosen: list[KeptSet], candidates: set[KeptSet], num_layers: int) -> list[KeptSet]:
    best_total = layers_saved(histogram, chosen, num_layers)
    improved = True
    while improved:
        improved = False
        for index in range(len(chosen)):
            for candidate in sorted(candidates, key=lambda c: (len(c), sorted(c))):
                trial = chosen[:index] + [candidate] + chosen[index + 1 :]
                total = layers_saved(histogram, trial, num_layers)
                if total > best_total:
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
