"""Calibration measures by draft-source name: `calibration/drafts/<name>.py` binds the source's
`DraftMeasure` subclass to `MEASURE` (the names are runtimes/drafting/registry.py's)."""

from __future__ import annotations

from importlib import import_module

from adaptive_export.calibration.draft_sources import DraftMeasure
from adaptive_export.runtimes.drafting.registry import DRAFT_SOURCES, calibration_module


def measure_of(name: str) -> type[DraftMeasure]:
    """The registered name's measure, which must answer to that name."""
    measure = import_module(calibration_module(name)).MEASURE
    if isinstance(measure, type) and issubclass(measure, DraftMeasure) and measure.name == name:
        return measure
    raise TypeError(f"{calibration_module(name)}.MEASURE is not a DraftMeasure named {name!r}")


# in the registry's order: calibration reports the sources, and breaks ties, in this order
MEASURES: dict[str, type[DraftMeasure]] = {name: measure_of(name) for name in DRAFT_SOURCES}
