"""Draft sources by name. A new source is one module with a `DraftSource` subclass
(runtimes/drafting/base.py) plus its line in SOURCES; the manifest check, the command line,
the speculative loop and `check` read this table (calibration measures the same names in
calibration/draft_sources.py)."""

from __future__ import annotations

from adaptive_export.runtimes.drafting.base import PLAIN, DraftSource, Proposal
from adaptive_export.runtimes.drafting.early_exit import EarlyExit
from adaptive_export.runtimes.drafting.precision import PrecisionDraft
from adaptive_export.runtimes.drafting.prompt_lookup import PromptLookup, lookup_ngram
from adaptive_export.runtimes.drafting.prompt_tokens import PromptTokens
from adaptive_export.runtimes.errors import UsageError

SOURCES: dict[str, type[DraftSource]] = {
    source.name: source for source in (EarlyExit, PromptLookup, PrecisionDraft, PromptTokens)
}
SOURCE_NAMES = tuple(SOURCES)
# Names a source no longer answers to: `run --draft` and the manifest point to the new name.
# "ppd" named the prompt-token source; it will name Predictive Pipelined Decoding.
RENAMED_SOURCES = {"ppd": "prompt_tokens"}
FREE_SOURCE = PromptLookup.name  # needs no engine of its own: the default without calibration, and gated `--mode auto`


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
