"""Draft sources by name. The bundle's sources come from the one registration
(runtimes/draft_registry.py): each name's module `runtimes/drafting/<name>.py` binds its
`DraftSource` subclass to `SOURCE`; the manifest check, the command line, the speculative loop
and `check` read `SOURCES`, and calibration measures the same names (calibration/drafts/).
Run-time sources (no engine or manifest field of their own) register with `register_source`;
`draft_source` and `make_chain` find both kinds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import import_module

from adaptive_export.runtimes.draft_registry import DRAFT_SOURCES, RENAMED_SOURCES, runtime_module
from adaptive_export.runtimes.drafting import draft_model as _draft_model  # noqa: F401  (registers draft_model)
from adaptive_export.runtimes.drafting.base import (
    PLAIN,
    RUNTIME_SOURCES,
    DraftSource,
    Proposal,
    RoundOutcome,
    SourceEnv,
    register_source,
)
from adaptive_export.runtimes.drafting.chain import DraftChain
from adaptive_export.runtimes.drafting.prompt_lookup import lookup_ngram
from adaptive_export.runtimes.errors import UsageError

MAX_CHAIN = 4  # sources one chain may name


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
    """A bundle's or a run-time source by name."""
    found = SOURCES.get(name) or RUNTIME_SOURCES.get(name)
    if found is None:
        known = [*SOURCES, *(n for n, s in RUNTIME_SOURCES.items() if not s.floor)]
        raise UsageError(f"draft source {name!r} is unknown", f"choose one of: {', '.join(known)}")
    return found


def chain_names(draft: str) -> tuple[str, ...]:
    """A `--draft` value: one source's name, or several joined by commas, asked in that order."""
    names = tuple(part.strip() for part in draft.split(","))
    if not 1 <= len(names) <= MAX_CHAIN or not all(names) or len(set(names)) != len(names):
        raise UsageError(
            f"--draft {draft[:80]!r} is not a list of 1 to {MAX_CHAIN} distinct source names",
            "pass one name, or names joined by commas such as prompt_lookup,eagle",
        )
    for name in names:
        draft_source(name)
    return names


def make_chain(
    env: SourceEnv, names: Sequence[str], k: int | Mapping[str, int], floor: bool = False, name: str | None = None
) -> DraftChain:
    """The named sources, each drafting up to k a round (or its own k by name), asked in order;
    `floor`: a two-row bundle's free guess asked last; `name`: what stats call the chain."""
    sources = [draft_source(name).create(env, k if isinstance(k, int) else k[name]) for name in names]
    if floor:
        sources.append(draft_source("floor_guess").create(env, 1))
    return DraftChain(env, sources, name)


__all__ = [
    "DraftChain",
    "DraftSource",
    "FREE_SOURCE",
    "PLAIN",
    "Proposal",
    "RENAMED_SOURCES",
    "RoundOutcome",
    "SOURCES",
    "SOURCE_NAMES",
    "SourceEnv",
    "chain_names",
    "draft_source",
    "lookup_ngram",
    "make_chain",
    "register_source",
]
