"""Self-speculative decoding on the shared KV arena (docs/architecture.md sections 4 and 5).

One round (`speculative_round`), with L = arena.length and `pending` the newest token
(emitted, not cached):
1. a draft source proposes up to k tokens d1..dk after `pending` (a `Proposal`);
2. one verifier pass over the inputs [pending, d1, .., d(k-1)] at positions L..L+k-1
   gives k rows of full-model logits (row j predicts the token after input j);
3. the acceptance rule (runtimes/acceptance.py) keeps drafts while they agree (greedy) or pass
   the rejection rule (sampling); at the first rejection the verifier's token is emitted instead;
4. crop: arena.length = L + (inputs whose KV is now valid). Nothing is copied.

Draft sources (early exit, prompt lookup, precision, prompt tokens) are `runtimes.drafting.DraftSource`s:
what drafts, which engines it needs, how its verify pass runs, whether it earns a bonus
token. A source whose verify pass scores the row after the last draft (prompt lookup,
precision, prompt tokens) emits accepted + 1 tokens every round; otherwise (early exit) the last accepted
draft becomes `pending` and the next round starts from it.

`SpeculativeRunner` runs rounds back to back. With `--mode auto` a gateable source drafts only
while drafting pays on this machine, now: the runner asks a `DraftingGate` (runtimes/gate.py)
before each round and tells it what the round cost and emitted; a round the gate makes plain
verifies `PLAIN`, a T=1 decode step.

On a bundle whose `min_decode_rows` is 2 a round never verifies one row: ONNX Runtime computes a
row of a one-row pass differently from the same row of a wider pass, and at accuracy level 4 that
shows in the tokens, while its passes of two rows and more compute every row alike. So a round
that would be plain is a floor round instead: one free guess after `pending` (prompt lookup's,
else `pending` again), verified by a T=2 decode pass. The guess is judged like any draft, so a
floor round emits one token or two, and plain decoding (`--mode ar`) runs floor rounds too: every
mode of such a bundle computes the same rows (docs/speculation.md, "Exact speculation at accuracy 4").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from adaptive_export.runtimes.acceptance import Verdict, judge
from adaptive_export.runtimes.backends import Backend
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.drafting import (
    FREE_SOURCE,
    SOURCES,
    DraftChain,
    Proposal,
    RoundOutcome,
    chain_names,
    draft_source,
)
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.gate import DraftingGate
from adaptive_export.runtimes.manifest import ConfigEntry
from adaptive_export.runtimes.sampling import Sampler
from adaptive_export.runtimes.sequence import SequenceState

DEFAULT_LOOKUP_K = 4
# T=k+1 pass / T=1 pass by draft length k when the bundle carries no measurement (a build without
# --speculate auto): MatMulNBits at accuracy 4 on a CPU without VNNI, the default bundle's slowest
# case (issue #24: T=2 1.1-1.3, T=3 1.4-1.7, T=5 2.1-2.4). The gate re-times rounds on the run itself.
DEFAULT_VERIFY_COSTS = {1: 1.3, 2: 1.7, 3: 2.05, 4: 2.4}


def default_verify_cost(k: int) -> float:
    """An unmeasured verify pass of k drafts, in T=1 passes (beyond the table: linear in k)."""
    return DEFAULT_VERIFY_COSTS.get(k, DEFAULT_VERIFY_COSTS[4] + 0.35 * (k - 4))


def requested_chain(bundle: Bundle, config: ConfigEntry, draft: str | None) -> tuple[str, ...]:
    """The sources a `--draft` value names, in order (None: the calibrated source alone)."""
    return chain_names(draft) if draft else (default_source(bundle, config),)


def speculation_available(bundle: Bundle, config: ConfigEntry, draft: str | None = None) -> bool:
    """Whether the configuration has the engines every source of the chain needs (prompt lookup
    needs none); `draft`: a `--draft` value (None: the calibrated source)."""
    names = requested_chain(bundle, config, draft)
    return all(draft_source(name).available(config) for name in names)


def min_decode_rows(bundle: Bundle) -> int:
    """Rows every decode pass of this bundle runs (manifest `speculation.min_decode_rows`; 1 without)."""
    speculation = bundle.manifest.speculation
    return speculation.min_decode_rows if speculation is not None else 1


def default_source(bundle: Bundle, config: ConfigEntry) -> str:
    """The source calibration chose; without calibration, prompt lookup (free)."""
    chosen = bundle.manifest.speculation.source if bundle.manifest.speculation else None
    if isinstance(chosen, str) and chosen in SOURCES:
        return chosen
    return FREE_SOURCE


class DraftWarmup:
    """Creates a draft source's engine sessions in a background thread, started before prefill.

    A one-shot `run` would otherwise create them inside its first drafting round, a cost no
    warmed-up benchmark shows (a short answer has only a few rounds). ONNX Runtime builds a
    session without the GIL, so this overlaps prefill and the first plain steps; the runner
    `wait`s before its first drafting round, so the two threads never create one session twice.
    A failure is left for that round to raise again, as the UsageError the backend makes of it."""

    def __init__(self, backend: Backend, graphs: Sequence[str]) -> None:
        self.graphs = tuple(graphs)
        self.thread = threading.Thread(target=self._prepare, args=(backend,), name="draft-session-warmup", daemon=True)
        self.thread.start()

    def _prepare(self, backend: Backend) -> None:
        try:
            for graph in self.graphs:
                backend.prepare(graph)
        except Exception:  # the drafting round creates the session again and raises it as a UsageError
            return

    def wait(self) -> None:
        self.thread.join()


@dataclass(frozen=True)
class Round:
    """One round as it happened: what was proposed and by which source (None: a plain step), the
    verdict, the tokens it emits, its seconds."""

    proposal: Proposal
    verdict: Verdict
    emitted: list[int]
    draft_s: float
    verify_s: float
    drafter: str | None = None
    floor: bool = False  # a floor round: no source had drafts, the floor's free guess took their place


def speculative_round(
    chain: DraftChain, state: SequenceState, context: list[int], budget: int, sampler: Sampler, drafting: bool = True
) -> Round:
    """Ask the chain for drafts (its drafting sources only when `drafting`; the floor always),
    verify the first proposal in one pass, apply the acceptance rule, crop the arena to the inputs
    whose KV is now valid, and tell every source the outcome. Emits nothing itself: the caller
    makes each emitted token `pending` in turn."""
    arena, start = state.arena, state.arena.length
    started = time.perf_counter()
    source, proposal = chain.propose(state.pending, context, budget, start, arena, sampler, drafting)
    drafted = time.perf_counter()
    outputs = chain.verify(source, state.pending, proposal, start, arena)
    verified = time.perf_counter()
    verdict = judge(proposal.tokens, proposal.rows, outputs.logits[0], sampler)
    # crop: the inputs pending, d1..d(accepted) now have valid KV in every kept layer
    arena.length = start + (verdict.accepted + 1 if verdict.token is not None else verdict.accepted)
    guess = None  # the pass's guess after the token it emitted last: the row that chose that token guessed it
    if outputs.guesses is not None and verdict.token is not None:
        guess = int(outputs.guesses[0, verdict.accepted])
        if not 0 <= guess < chain.env.model.vocab_size:  # an engine's output is untrusted input
            guess = None
    emitted = proposal.tokens[: verdict.accepted] + ([verdict.token] if verdict.token is not None else [])
    name = source.name if source is not None else None
    chain.accept(RoundOutcome(name, proposal, verdict.accepted, tuple(emitted), arena.length, guess))
    floor = source is not None and source.floor
    return Round(proposal, verdict, emitted, drafted - started, verified - drafted, name, floor)


@dataclass
class RoundCounts:
    """What the rounds of one sequence added up to (its `stats.speculation`)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    floor_rounds: int = 0
    floor_accepted: int = 0  # floor guesses that were the model's token
    passes: dict[int, int] = field(default_factory=dict)  # verify passes by rows T (build prices them)
    # per drafting source of a chain: [rounds it drafted, drafts, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def add(self, done: Round) -> None:
        self.rounds += 1
        if done.drafter is not None and not done.floor:
            tally = self.by_source.setdefault(done.drafter, [0, 0, 0])
            tally[0] += 1
            tally[1] += len(done.proposal.tokens)
            tally[2] += done.verdict.accepted
        rows = 1 + len(done.proposal.tokens) + done.proposal.extra_inputs
        self.passes[rows] = self.passes.get(rows, 0) + 1
        if done.floor:
            self.floor_rounds += 1
            self.floor_accepted += done.verdict.accepted
        else:
            self.drafted += len(done.proposal.tokens)
            self.accepted += done.verdict.accepted
        self.draft_s += done.draft_s
        self.verify_s += done.verify_s


@dataclass(frozen=True)
class SpeculationReport:
    """A sequence's speculation as `stats.speculation` reports it (keys in this order)."""

    draft_source: str
    draft_len: int
    rounds: int
    drafted: int
    accepted: int
    acceptance: float  # accepted / drafted
    mean_accepted: float  # accepted drafts per round
    draft_ms: float
    verify_ms: float
    gated: bool
    rounds_without_drafting: int  # rounds the gate made plain
    timed_plain_ms: float | None  # the gate's running mean of a plain round per emitted token
    timed_draft_ms_per_token: float | None  # ... and of a drafting round per emitted token
    floor_rounds: int  # rounds verified as [pending, guess] where a one-row pass would have been (min_decode_rows 2)
    floor_accepted: int
    passes_by_rows: dict[str, int]  # verify passes by rows T
    rounds_by_source: dict[str, dict[str, int]]  # per source of the chain: rounds it drafted, drafts, accepted


def draft_length(bundle: Bundle, name: str, draft_len: int | None) -> int:
    """A source's drafts per round: asked for, else calibrated, else DEFAULT_LOOKUP_K."""
    k = int(draft_len or bundle.manifest.calibrated(name).draft_len or DEFAULT_LOOKUP_K)
    if k < 1:
        raise UsageError(f"draft length {k} is not positive", "use a draft length of 1 or more")
    return k


def drafting_gate(bundle: Bundle, backend: Backend, chain: DraftChain) -> DraftingGate | None:
    """`--mode auto`'s gate over a gateable chain, priced by its first source's calibration: a
    drafting round is k draft steps and one T=k+1 pass, a plain one a T=1 step (T=2 with a floor)."""
    if not chain.gateable:
        return None
    first = chain.drafting[0]
    calibrated = bundle.manifest.calibrated(first.name)
    prepacked = chain.env.config.decode in getattr(backend, "prepack", ())  # ORT: T > 1 passes much cheaper
    costs = calibrated.verify_costs(prepacked)
    draft_cost = float(calibrated.draft_cost or 0.0)  # a draft engine's T=1 step in T=1 decode passes (lookup: none)
    round_passes = first.k * draft_cost + float(costs.get(str(first.k), default_verify_cost(first.k)))
    floored = any(source.floor for source in chain.sources)
    plain_passes = float(costs.get("1", default_verify_cost(1))) if floored else 1.0
    return DraftingGate(round_passes, chain.free_proposals, plain_passes)


class SpeculativeRunner:
    """Runs rounds of a draft chain, yielding each emitted token; the consumer stops it by closing it."""

    def __init__(
        self, bundle: Bundle, chain: DraftChain, gated: bool = False, warmups: Sequence[DraftWarmup] = ()
    ) -> None:
        """`gated`: `--mode auto`, where a gateable chain drafts only while its drafts pay."""
        self.chain = chain
        self.warmups = warmups  # draft sessions being created off the critical path: wait for them before drafting
        self.counts = RoundCounts()
        self.gate = drafting_gate(bundle, chain.env.backend, chain) if gated else None

    def tokens(self, state: SequenceState, max_new_tokens: int, sampler: Sampler) -> Iterator[int]:
        """Emitted tokens, round after round; the consumer records each in state.tokens before asking for the next."""
        context = list(state.prompt_ids) + list(state.tokens)
        self.chain.begin(context)
        while True:
            for token in self._round(state, max_new_tokens - len(state.tokens), sampler, context):
                state.pending = token
                context.append(token)
                yield token

    def _round(self, state: SequenceState, budget: int, sampler: Sampler, context: list[int]) -> list[int]:
        """One round, gated: the gate may make it a plain step, and learns what it cost. A budget
        that leaves only the bonus row (no drafts fit) is a plain step too."""
        chain, gate = self.chain, self.gate
        k = chain.max_drafts(budget)
        if gate is None:
            self._await_sessions(k)
            done = speculative_round(chain, state, context, budget, sampler)
            self.counts.add(done)
            return done.emitted
        started = time.perf_counter()
        drafting = k >= 1 and gate.should_draft()
        if not drafting and k >= 1 and gate.wants_shadow():  # a free proposal, scored by the plain tokens
            arena = state.arena
            shadow = chain.propose(state.pending, context, budget, arena.length, arena, sampler, floor=False)[1]
            gate.watch(shadow.tokens)
        self.counts.draft_s += time.perf_counter() - started
        self._await_sessions(k if drafting else 0)
        done = speculative_round(chain, state, context, budget, sampler, drafting)
        self.counts.add(done)
        plain = done.proposal.plain or done.floor
        gate.record_round(not plain, len(done.emitted), time.perf_counter() - started)
        if plain:  # plain decoding's tokens (a floor round's are too)
            for token in done.emitted:
                gate.record_plain_token(token)
        return done.emitted

    def _await_sessions(self, k: int) -> None:
        """Before the first round that drafts, let the background warm-up finish its sessions."""
        if k >= 1 and self.warmups:
            for warmup in self.warmups:
                warmup.wait()
            self.warmups = ()

    def report(self) -> SpeculationReport:
        """What this sequence's rounds did (`stats.speculation`)."""
        counts, gate = self.counts, self.gate
        return SpeculationReport(
            draft_source=self.chain.name,
            draft_len=self.chain.k,
            rounds=counts.rounds,
            drafted=counts.drafted,
            accepted=counts.accepted,
            acceptance=round(counts.accepted / counts.drafted, 4) if counts.drafted else 0.0,
            mean_accepted=round(counts.accepted / counts.rounds, 3) if counts.rounds else 0.0,
            draft_ms=round(counts.draft_s * 1e3, 3),
            verify_ms=round(counts.verify_s * 1e3, 3),
            gated=gate is not None,
            rounds_without_drafting=gate.skipped if gate is not None else 0,
            timed_plain_ms=gate.timed_plain_ms() if gate is not None else None,
            timed_draft_ms_per_token=gate.timed_draft_ms_per_token() if gate is not None else None,
            floor_rounds=counts.floor_rounds,
            floor_accepted=counts.floor_accepted,
            passes_by_rows={str(rows): n for rows, n in sorted(counts.passes.items())},
            rounds_by_source={
                name: {"rounds": tally[0], "drafted": tally[1], "accepted": tally[2]}
                for name, tally in counts.by_source.items()
            },
        )
