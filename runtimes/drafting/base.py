"""The draft-source lifecycle of self-speculative decoding (docs/architecture.md section 7).

A draft source is asked, in the shape of llama.cpp's `common_speculative`:
- `begin(context)` once per sequence, after prefill (the prompt's tokens);
- `propose(...)` each round it is asked: up to k tokens after `pending` (a `Proposal`), or none;
- `verify(...)` when its proposal is the round's: the one pass that scores it;
- `accept(outcome)` after every round, whichever source drafted it (`RoundOutcome`).
Sources are asked in a chain (runtimes/drafting/chain.py): the first with drafts drafts the round.
The speculative loop (runtimes/speculative.py) owns everything else: acceptance
(runtimes/acceptance.py), the arena crop, stats and gating. A source is one class and one
registration: the bundle's sources by their manifest contract (runtimes/draft_registry.py), a
run-time source (no engine or manifest field of its own) by `register_source`. Calibration
measures the bundle's sources under the same names (calibration/drafts/).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from adaptive_export.runtimes.backends import Backend, StepOutputs
from adaptive_export.runtimes.draft_contracts import DraftContract
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims
from adaptive_export.runtimes.sampling import Sampler


@dataclass(frozen=True)
class Proposal:
    """One round's drafts and what its verify pass runs besides them.

    `rows`: the draft distribution's logits per draft (for the rejection rule), None when the
    drafts are deterministic (copied from the context, argmax guesses). `extra_inputs`: inputs
    the verify pass appends after the drafts (the prompt-token source's trained tokens), whose rows guess the next
    round's drafts. A proposal with neither drafts nor extra inputs is a plain step: its verify
    pass is one T=1 decode step (`PLAIN`, also what a gated-out round verifies)."""

    tokens: list[int]
    rows: list[np.ndarray] | None = None
    extra_inputs: int = 0

    @property
    def plain(self) -> bool:
        return not self.tokens and not self.extra_inputs


PLAIN = Proposal([])


@dataclass(frozen=True)
class RoundOutcome:
    """What a round did, as every source of the chain hears it (`DraftSource.accept`).

    `drafter`: the name of the source whose proposal was verified (None: a plain step). `length`:
    the arena length after the crop, where the next round starts. `guess`: the verify pass's
    in-graph guess at the token after the last one emitted (`StepOutputs.guesses`; None: none)."""

    drafter: str | None
    proposal: Proposal
    accepted: int
    emitted: tuple[int, ...]
    length: int
    guess: int | None = None


class ModelDrafter(Protocol):
    """A model that drafts on engines and an arena of its own (runtimes/draft_model.py `DraftModel`)."""

    def draft(self, context: list[int], k: int, sampler: Sampler) -> Proposal: ...


@dataclass(frozen=True)
class SourceEnv:
    """What a source is made from: the backend and configuration it drafts for, and the run-time
    resources a caller brings (a draft bundle's engines, runtimes/draft_model.py)."""

    backend: Backend
    config: ConfigEntry
    model: ModelDims
    draft_model: ModelDrafter | None = None


class DraftSource(DraftContract, ABC):
    """One way of drafting. Subclasses set the class attributes and implement propose/verify; what
    a source adds to the manifest is its contract (runtimes/draft_contracts.py), which it inherits."""

    name: ClassVar[str]
    # the configuration's engines (manifest `configs[].engines` keys) it needs besides decode
    engines: ClassVar[tuple[str, ...]] = ()
    # the verify pass also scores the row after the last draft: a round whose drafts are all
    # accepted emits one more (bonus) token, so a round may emit k + 1 tokens
    bonus: ClassVar[bool] = False
    # a round may skip drafting cheaply (its verify pass then is a plain decode step), so
    # `--mode auto` can gate it to draft only while drafts pay
    gateable: ClassVar[bool] = False
    # proposing costs nothing (no engine runs), so a gated plain round can score a proposal
    # against the tokens plain decoding emits (runtimes/speculative.py)
    free_proposals: ClassVar[bool] = False
    # every row a round keeps is written by the configuration's decode engine in one pass of
    # two rows or more, so on a bundle that decodes two rows at least (`min_decode_rows`) the
    # round computes what plain decoding computes; False where another engine writes kept rows
    decode_engine_rows: ClassVar[bool] = True
    # a floor source (a two-row bundle's free guess) proposes one token whenever it is asked, also in
    # a round the gate made plain or the budget leaves no draft for: a chain asks it last
    floor: ClassVar[bool] = False

    def __init__(self, backend: Backend, config: ConfigEntry, model: ModelDims, k: int) -> None:
        self.backend, self.config, self.k = backend, config, k

    @classmethod
    def create(cls, env: SourceEnv, k: int) -> DraftSource:
        """The source for one sequence's rounds, drafting up to k tokens a round."""
        return cls(env.backend, env.config, env.model, k)

    @classmethod
    def available(cls, config: ConfigEntry) -> bool:
        """Whether this configuration has the engines the source needs."""
        return all(name in config.engines for name in cls.engines)

    def max_drafts(self, budget: int) -> int:
        """Drafts for a round that may emit at most `budget` more tokens."""
        return min(self.k, budget - 1 if self.bonus else budget)

    # the last verify pass's in-graph guess and the arena length of the round it drafts for
    guess: int | None = None
    guess_at: int = -1

    def begin(self, context: list[int]) -> None:
        """A new sequence after prefill (`context`: its prompt): forget the last one's state."""
        self.guess, self.guess_at = None, -1

    def accept(self, outcome: RoundOutcome) -> None:
        """After each round: keep the verify pass's in-graph guess for the round it drafts for."""
        self.guess, self.guess_at = outcome.guess, outcome.length

    def guess_for(self, start: int) -> int | None:
        """The in-graph guess for the round at arena length `start`, if the last pass made one for it."""
        return self.guess if start == self.guess_at else None

    @abstractmethod
    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        """Up to k draft tokens after `pending`, drafted at arena position `start`."""

    @abstractmethod
    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        """One verifier pass at arena position `start`; its logits row j scores proposal.tokens[j]."""


def engine_drafts(
    backend: Backend,
    graph: str,
    pending: int,
    k: int,
    start: int,
    arena: KVArena,
    sampler: Sampler,
    on_step: Callable[[int, StepOutputs], None] | None = None,
    lead: Sequence[int] = (),
    stop_below: float = 0.0,
) -> Proposal:
    """k T=1 steps of a draft engine over token ids from arena position `start`: the drafts
    (argmax, or sampled from the draft's own distribution) and, when sampling, each step's
    logits row for the rejection rule (greedy acceptance never reads them: no copy per step).
    `on_step(j, outputs)` sees every step's outputs (early exit keeps its exit hidden state).
    `lead`: tokens the draft's arena still lacks before `pending` (a draft model catching up,
    runtimes/draft_model.py), run in the first step's pass at `start - len(lead)`.
    `stop_below`: end the round after a draft whose own top-1 probability is below it (a draft
    the engine doubts is likely rejected, and the steps after it with it); 0 drafts all k."""
    token = np.empty((1, 1), dtype=np.int64)
    inputs, at = np.asarray([[*lead, pending]], dtype=np.int64), start - len(lead)
    ids = backend.bundle.draft_vocab_ids if backend.bundle.graph(graph).draft_vocab else None
    drafts: list[int] = []
    rows: list[np.ndarray] | None = None if sampler.greedy else []
    for j in range(k):
        out = backend.run(graph, inputs, arena, at)
        if on_step is not None:
            on_step(j, out)
        logits = out.logits[0, -1]
        if rows is None:
            best = int(np.argmax(logits))
            drafts.append(best if ids is None else int(ids[best]))
        else:
            # the backend reuses its output buffer next step, so keep a copy (over the whole vocabulary)
            row = logits.copy() if ids is None else full_vocabulary_row(logits, ids, backend.bundle.model.vocab_size)
            rows.append(row)
            drafts.append(int(sampler.rng.choice(row.size, p=sampler.probabilities(row))))
        if stop_below and j + 1 < k and top_probability(logits) < stop_below:
            break  # (after the round's last draft there is nothing left to stop)
        token[0, 0] = drafts[-1]
        inputs, at = token, start + j + 1
    return Proposal(drafts, rows)


def top_probability(logits: np.ndarray) -> float:
    """The softmax probability of the row's largest logit."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


def full_vocabulary_row(logits: np.ndarray, ids: np.ndarray, vocab: int) -> np.ndarray:
    """A reduced draft head's logits spread over the vocabulary. Tokens outside it get a logit
    1e4 below the row's minimum: a finite value (the sampler refuses infinities) whose
    probability underflows to zero at any usual temperature. The draft samples from this same
    row, so the rejection rule stays exact whatever that remainder is."""
    row = np.full(vocab, float(logits.min()) - 1e4, dtype=np.float32)
    row[ids] = logits
    return row


def decode_engine_verify(
    backend: Backend, config: ConfigEntry, pending: int, drafts: list[int], start: int, arena: KVArena
) -> StepOutputs:
    """The configuration's decode engine over [pending, d1, .., dk] at T=k+1, writing every kept
    layer's rows: its last row scores the position after the last draft (the bonus token)."""
    inputs = np.asarray([[pending, *drafts]], dtype=np.int64)
    return backend.run(config.decode, inputs, arena, start)


# Run-time sources by name: sources with no engine or manifest field of their own (runtimes/drafting/
# prompt_lookup.py's variants, a draft bundle, or a caller's own), which `--draft` and a chain name
# beside the bundle's registered ones (runtimes/drafting/__init__.py `draft_source`).
RUNTIME_SOURCES: dict[str, type[DraftSource]] = {}


def register_source(source: type[DraftSource]) -> type[DraftSource]:
    """Register a run-time draft source under its `name` (usable as a class decorator)."""
    name = getattr(source, "name", None)
    if not (isinstance(source, type) and issubclass(source, DraftSource) and isinstance(name, str) and name):
        raise TypeError(f"{source!r} is not a DraftSource with a name")
    known = RUNTIME_SOURCES.get(name)
    if known is not None and known is not source:
        raise ValueError(f"a draft source named {name!r} is registered already ({known.__qualname__})")
    RUNTIME_SOURCES[name] = source
    return source
