"""Calibration measures by draft-source name: `calibration/drafts/<name>.py` binds the source's
`DraftMeasure` subclass to `MEASURE` (the names are runtimes/draft_registry.py's) and, for a
source made at build time by an option of its own, its `BuildStep` to `BUILD`
(calibration/draft_builds.py); a source shaped by other build options checks them in
`check_options(options, quantize)`, which `build` calls before loading the model. Torch-free
at import: the command line reads the build options."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from adaptive_export.calibration.draft_builds import BuildStep
from adaptive_export.calibration.draft_sources import DraftMeasure
from adaptive_export.runtimes.draft_registry import DRAFT_SOURCES, calibration_module


def measure_of(name: str) -> type[DraftMeasure]:
    """The registered name's measure, which must answer to that name."""
    measure = import_module(calibration_module(name)).MEASURE
    if isinstance(measure, type) and issubclass(measure, DraftMeasure) and measure.name == name:
        return measure
    raise TypeError(f"{calibration_module(name)}.MEASURE is not a DraftMeasure named {name!r}")


# in the registry's order: calibration reports the sources, and breaks ties, in this order
MEASURES: dict[str, type[DraftMeasure]] = {name: measure_of(name) for name in DRAFT_SOURCES}


def build_step_of(name: str) -> type[BuildStep] | None:
    """The registered name's build step, if the source has one."""
    step = getattr(import_module(calibration_module(name)), "BUILD", None)
    if step is None or (isinstance(step, type) and issubclass(step, BuildStep)):
        return step
    raise TypeError(f"{calibration_module(name)}.BUILD is not a BuildStep")


# the sources made at build time by their own option, in the registry's order
BUILD_STEPS: dict[str, type[BuildStep]] = {
    name: step for name in DRAFT_SOURCES if (step := build_step_of(name)) is not None
}


OptionCheck = Callable[[Any, str], None]  # (the build's options, the bundle's resolved --quantize)


# the sources' checks of the build options that shape them, in the registry's order
OPTION_CHECKS: dict[str, OptionCheck] = {
    name: check
    for name in DRAFT_SOURCES
    if (check := getattr(import_module(calibration_module(name)), "check_options", None)) is not None
}
