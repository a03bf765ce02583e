"""The registration of draft sources and what each adds to a bundle's manifest (docs/architecture.md
sections 3, 7 and 9).

`REGISTERED` lists one contract per source: registering a source is writing its contract here
(a name, and for a source that adds to the manifest its engine roles (role -> the graph kind it
must be), integer graph fields its graph piece sets (written as `graphs[].<key>`, 0 when unset),
their validators and a trained table it ships). The manifest types (runtimes/manifest_graphs.py)
check every registered source's contract from `CONTRACTS`; the runtime class of a source
(runtimes/drafting/<name>.py) inherits its contract, so `SOURCES[name].graph_fields` and the rest
read the same declaration. This module sits below the manifest and imports no draft source,
backend or bundle: the manifest is read without importing the code that drafts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from adaptive_export.runtimes.manifest_fields import is_int, need


class DraftFieldGraph(Protocol):
    """What a contract reads of a manifest graph (runtimes/manifest_graphs.py GraphEntry)."""

    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def precision(self) -> str | None: ...

    def draft_field(self, key: str) -> int: ...


@dataclass(frozen=True)
class TableArtifact:
    """A trained table a source's graphs embed, shipped beside the engines as one safetensors file
    (`file`, tensor `key`, [1..max_rows, hidden]); loading/artifacts.py saves and loads it, and the
    reference (`check`) reads it back from a bundle. `what` names it in errors, `fix` says how to
    make one (the build option)."""

    file: str
    key: str
    max_rows: int
    what: str
    fix: str


class DraftContract:
    """A source's part of the manifest; the defaults add nothing."""

    name: ClassVar[str]
    # What the source adds to the manifest, checked by runtimes/manifest_graphs.py: engine roles
    # of its own (role -> the graph kind it must be), integer graph fields its graph piece sets
    # (written as `graphs[].<key>`, 0 when unset) and the trained table it ships, if any.
    engine_kinds: ClassVar[Mapping[str, str]] = {}
    # Roles whose engine is the model at another precision, so `check` gates its own output
    # quality against the reference (drafts that rarely agree cost time, not correctness).
    quality_gated: ClassVar[tuple[str, ...]] = ()
    graph_fields: ClassVar[tuple[str, ...]] = ()
    table: ClassVar[TableArtifact | None] = None
    # One of `graph_fields` that, set, makes the graph also output `guesses` (int64 [1, R]): per
    # row, its head's guess at the token after the token the row chooses (graphs/drafts/ `guess_head`).
    guess_field: ClassVar[str | None] = None

    @classmethod
    def check_graph_field(cls, graph: str, kind: str, key: str, value: Any) -> None:
        """One of `graph_fields` as a manifest holds it; a source narrows this (kinds, bounds)."""
        need(is_int(value) and value >= 0, f"graph {graph!r} has a bad {key}")

    @classmethod
    def check_engines(cls, config: str, engines: Mapping[str, str], graphs: Mapping[str, DraftFieldGraph]) -> None:
        """A configuration's engines of this source's roles, against the graphs they name."""
        return None


class EarlyExitContract(DraftContract):
    """Early-exit drafts (runtimes/drafting/early_exit.py): a draft graph of the layers below the
    exit and a verify graph of the rest, always as a pair."""

    name = "early_exit"
    engine_kinds = {"draft": "draft", "verify": "verify"}

    @classmethod
    def check_engines(cls, config: str, engines: Mapping[str, str], graphs: Mapping[str, DraftFieldGraph]) -> None:
        need(
            ("draft" in engines) == ("verify" in engines),
            f"config {config!r} needs both or neither of draft and verify engines",
        )


PRECISIONS = ("int8", "int4", "native4")  # a precision draft's weights (graphs/drafts/precision.py PRECISION_DRAFTS)
PRECISION_ROLE = "precision_draft"


class PrecisionContract(DraftContract):
    """Precision drafts (runtimes/drafting/precision.py): the configuration's decode graph again,
    over the same layers, at a cheaper weight precision."""

    name = "precision"
    engine_kinds = {PRECISION_ROLE: "decode"}
    quality_gated = (PRECISION_ROLE,)

    @classmethod
    def check_engines(cls, config: str, engines: Mapping[str, str], graphs: Mapping[str, DraftFieldGraph]) -> None:
        if PRECISION_ROLE in engines:
            draft, decode = graphs[engines[PRECISION_ROLE]], graphs[engines["decode"]]
            need(
                draft.precision in PRECISIONS and sorted(draft.layers) == sorted(decode.layers),
                f"config {config!r} has a precision draft that is no draft precision of its decode graph",
            )


MAX_PROMPT_TOKENS = 16  # prompt tokens a decode graph may embed
PROMPT_TOKENS_FIELD = PROMPT_TOKENS_ROLE = "prompt_tokens"  # the decode graph's field and the configuration's role
PROMPT_TOKENS_FIX = "train prompt tokens for this model with --prompt-tokens N"


class PromptTokensContract(DraftContract):
    """Prompt-token drafts (runtimes/drafting/prompt_tokens.py): the decode graph embeds them."""

    name = "prompt_tokens"
    engine_kinds = {PROMPT_TOKENS_ROLE: "decode"}
    graph_fields = (PROMPT_TOKENS_FIELD,)
    table = TableArtifact(
        "prompt_tokens.safetensors", "prompt_tokens", MAX_PROMPT_TOKENS, "prompt tokens", PROMPT_TOKENS_FIX
    )

    @classmethod
    def check_graph_field(cls, graph: str, kind: str, key: str, value: Any) -> None:
        need(
            is_int(value) and 0 <= value <= MAX_PROMPT_TOKENS and (kind == "decode" or not value),
            f"graph {graph!r} has a bad {PROMPT_TOKENS_FIELD}"
            f" (a decode graph may embed 0..{MAX_PROMPT_TOKENS} prompt tokens)",
        )

    @classmethod
    def check_engines(cls, config: str, engines: Mapping[str, str], graphs: Mapping[str, DraftFieldGraph]) -> None:
        """Its engine is the configuration's own decode graph, embedding prompt tokens."""
        role = PROMPT_TOKENS_ROLE
        if role in engines:
            need(
                engines[role] == engines["decode"] and graphs[engines[role]].draft_field(PROMPT_TOKENS_FIELD) > 0,
                f"config {config!r} has a {role} engine that is not its decode graph with prompt tokens",
            )


MAX_EAGLE_WIDTH = 16384  # the EAGLE head's MLP width (graphs/drafts/eagle.py; its table is 5 x width rows)
EAGLE_FIELD = EAGLE_ROLE = "eagle"  # the decode graph's field (the head's width) and the configuration's role
EAGLE_FIX = "train an EAGLE head for this model with --eagle-head N"


class EagleContract(DraftContract):
    """EAGLE-head drafts (runtimes/drafting/eagle.py): the decode graph also outputs a guess per row."""

    name = "eagle"
    engine_kinds = {EAGLE_ROLE: "decode"}
    graph_fields = (EAGLE_FIELD,)
    guess_field = EAGLE_FIELD
    table = TableArtifact("eagle_head.safetensors", "eagle", 5 * MAX_EAGLE_WIDTH, "EAGLE head", EAGLE_FIX)

    @classmethod
    def check_graph_field(cls, graph: str, kind: str, key: str, value: Any) -> None:
        need(
            is_int(value) and 0 <= value <= MAX_EAGLE_WIDTH and (kind in ("decode", "prefill") or not value),
            f"graph {graph!r} has a bad {EAGLE_FIELD} (a decode or prefill graph's head width, 0..{MAX_EAGLE_WIDTH})",
        )

    @classmethod
    def check_engines(cls, config: str, engines: Mapping[str, str], graphs: Mapping[str, DraftFieldGraph]) -> None:
        """Its engine is the configuration's own decode graph, guessing with the head."""
        if EAGLE_ROLE in engines:
            need(
                engines[EAGLE_ROLE] == engines["decode"] and graphs[engines[EAGLE_ROLE]].draft_field(EAGLE_FIELD) > 0,
                f"config {config!r} has an {EAGLE_ROLE} engine that is not its decode graph with the head",
            )


class PromptLookupContract(DraftContract):
    """Prompt-lookup drafts (runtimes/drafting/prompt_lookup.py): copied from the context, they add
    nothing to the manifest."""

    name = "prompt_lookup"


# THE REGISTRATION of draft sources: one contract per source, in this order, which is the order
# calibration measures and reports the sources in, and the order of `run --draft`'s choices.
# runtimes/draft_registry.py names the sources from it.
REGISTERED: tuple[type[DraftContract], ...] = (
    EarlyExitContract,
    PromptLookupContract,
    PrecisionContract,
    PromptTokensContract,
    EagleContract,
)

# every registered source's contract, by name, in registry order
CONTRACTS: dict[str, type[DraftContract]] = {contract.name: contract for contract in REGISTERED}

# the graph fields whose graphs also output `guesses`
GUESS_FIELDS = tuple(contract.guess_field for contract in CONTRACTS.values() if contract.guess_field)
