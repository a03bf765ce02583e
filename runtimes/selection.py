"""Configuration choice at prefill: the superset rule (docs/architecture.md section 2, "Skip configurations")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from adaptive_export.runtimes.manifest import ConfigEntry


def choose_config(configs: Sequence[ConfigEntry], kept: Iterable[int]) -> ConfigEntry:
    """The cheapest compiled configuration whose kept set contains every layer the routers kept.

    Never skips a layer the routers wanted; the full model always qualifies. Ties go to
    the configuration listed first (the manifest lists them by calibration share).
    """
    wanted = set(kept)
    candidates = [c for c in configs if wanted.issubset(c.kept)]
    if not candidates:
        raise ValueError("no configuration contains the kept layers; the bundle lacks the full configuration")
    return min(candidates, key=lambda c: len(c.kept))
