"""Draft sources by name, resolved from the one registration (runtimes/draft_registry.py):
each name's module `runtimes/drafting/<name>.py` binds its `DraftSource` subclass to
`SOURCE`. The manifest check, the command line, the speculative loop and `check` read
`SOURCES`; calibration measures the same names (calibration/drafts/)."""

from __future__ import annotations

from importlib import import_module

from adaptive_export.runtimes.draft_registry import DRAFT_SOURCES, RENAMED_SOURCES, runtime_module
from adaptive_export.runtimes.drafting.base import PLAIN, DraftSource, Proposal
from adaptive_export.runtimes.drafting.prompt_lookup import lookup_ngram
from adaptive_export.runtimes.errors import UsageError


def _load_source(name: str) -> type[DraftSource]:
    """The registered name's runtime class, which must answer to that name."""
    source = import_module(runtime_module(name)).SOURCE
    if isinstance(source, type) and issubclass(source, DraftSource) and getattr(source, "name", None) == name:
        return source
    raise TypeError(f"{runtime_module(name)}.SOURCE is not a DraftSource named {name!r}")


SOURCES: dict[str, type[DraftSource]] = {name: _load_source(name) for name in DRAFT_SOURCES}
SOURCE_NAMES = tuple(SOURCES)
FREE_SOURCE = "prompt_lookup"  # needs no engine of its own: the default without calibration, and gated `--mode auto`


def draft_source(name: str) -> type[DraftSource]:
    if name not in SOURCES:
        raise UsageError(f"draft source {name!r} is unknown", f"choose one of: {', '.join(SOURCES)}")
    return SOURCES[name]


__all__ = [
    "DraftSource",
    "FREE_SOURCE",
    "PLAIN",
    "Proposal",
    "RENAMED_SOURCES",
    "SOURCES",
    "SOURCE_NAMES",
    "draft_source",
    "lookup_ngram",
]
