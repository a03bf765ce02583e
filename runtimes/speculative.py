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
    PLAIN,
    SOURCES,
    DraftSource,
    Proposal,
    draft_source,
    lookup_ngram,
)
from adaptive_export.runtimes.drafting.prompt_lookup import GrowingLookup, PromptLookup
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.gate import DraftingGate
from adaptive_export.runtimes.kv_arena import KVArena
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


def speculation_available(bundle: Bundle, config: ConfigEntry, source: str | None = None) -> bool:
    """Whether the configuration has the engines the source needs (prompt lookup needs none)."""
    found = SOURCES.get(source or default_source(bundle, config))
    return found is not None and found.available(config)


def min_decode_rows(bundle: Bundle) -> int:
    """Rows every decode pass of this bundle runs (manifest `speculation.min_decode_rows`; 1 without)."""
    speculation = bundle.manifest.speculation
    return speculation.min_decode_rows if speculation is not None else 1


class FloorGuess(PromptLookup):
    """A floor round's one guess: prompt lookup's next token, else the last pass's in-graph guess
    (a bundle with an EAGLE head: runtimes/drafting/eagle.py), else `pending` again (a repeat is as
    good a guess as any); verified by the decode engine over [pending, guess] (runtimes/drafting/prompt_lookup.py)."""

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        guess = self.guess_for(start)
        return Proposal(lookup_ngram(context, 1) or [pending if guess is None else guess])


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
    """One round as it happened: what was proposed, the verdict, the tokens it emits, its seconds."""

    proposal: Proposal
    verdict: Verdict
    emitted: list[int]
    draft_s: float
    verify_s: float
    floor: bool = False  # a floor round: the source had no drafts, a free guess took their place


def speculative_round(
    drafter: DraftSource,
    state: SequenceState,
    context: list[int],
    k: int,
    sampler: Sampler,
    floor: DraftSource | None = None,
) -> Round:
    """Draft up to k tokens (k = 0: a plain step), verify them in one pass, apply the acceptance
    rule, crop the arena to the inputs whose KV is now valid. Where the source has no drafts and a
    `floor` is given, the floor's guess is verified instead of a one-row pass. Emits nothing itself:
    the caller makes each emitted token `pending` in turn."""
    arena, start = state.arena, state.arena.length
    started = time.perf_counter()
    proposal = drafter.propose(state.pending, context, k, start, arena, sampler) if k >= 1 else PLAIN
    verifier = drafter
    if proposal.plain and floor is not None:
        proposal, verifier = floor.propose(state.pending, context, 1, start, arena, sampler), floor
    drafted = time.perf_counter()
    outputs = verifier.verify(state.pending, proposal, start, arena)
    verified = time.perf_counter()
    verdict = judge(proposal.tokens, proposal.rows, outputs.logits[0], sampler)
    # crop: the inputs pending, d1..d(accepted) now have valid KV in every kept layer
    arena.length = start + (verdict.accepted + 1 if verdict.token is not None else verdict.accepted)
    guess = None  # the pass's guess after the token it emitted last: the row that chose that token guessed it
    if outputs.guesses is not None and verdict.token is not None:
        guess = int(outputs.guesses[0, verdict.accepted])
        if not 0 <= guess < drafter.backend.bundle.model.vocab_size:  # an engine's output is untrusted input
            guess = None
    for source in (drafter, floor) if floor is not None else (drafter,):
        source.observe_guess(arena.length, guess)
    emitted = proposal.tokens[: verdict.accepted] + ([verdict.token] if verdict.token is not None else [])
    return Round(proposal, verdict, emitted, drafted - started, verified - drafted, verifier is not drafter)


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

    def add(self, done: Round) -> None:
        self.rounds += 1
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


class SpeculativeRunner:
    """Runs rounds of draft + verify, yielding each emitted token; the consumer stops it by closing it."""

    def __init__(
        self,
        bundle: Bundle,
        backend: Backend,
        config: ConfigEntry,
        source: str | None = None,
        draft_len: int | None = None,
        gated: bool = False,
        warmups: Sequence[DraftWarmup] = (),
        decode_rows: int = 1,
        growing: bool = False,
        drafter: DraftSource | None = None,
    ) -> None:
        """`growing`: prompt lookup's drafts follow its own acceptance, up to the draft length
        (runtimes/drafting/prompt_lookup.py GrowingLookup), instead of k every round. `drafter`: a
        source made by the caller, outside the registry (runtimes/draft_model.py), drafting ungated."""
        self.warmups = warmups  # draft sessions being created off the critical path: wait for them before drafting
        # a round without drafts is a floor round (one guess, T=2) on a bundle that decodes two rows at least
        self.floor = FloorGuess(backend, config, bundle.model, 1) if decode_rows >= 2 else None
        self.counts = RoundCounts()
        self.gate: DraftingGate | None = None
        if drafter is not None:
            self.source, self.k, self.drafter = drafter.name, drafter.k, drafter
            return
        self.source = source or default_source(bundle, config)
        source_class = draft_source(self.source)
        if not source_class.available(config):
            raise UsageError(
                f"configuration {config.id!r} has no {self.source} draft engines",
                "use --draft prompt_lookup, --mode ar, or rebuild with --speculate",
            )
        calibrated = bundle.manifest.calibrated(self.source)
        self.k = int(draft_len or calibrated.draft_len or DEFAULT_LOOKUP_K)
        if self.k < 1:
            raise UsageError(f"draft length {self.k} is not positive", "use a draft length of 1 or more")
        if growing and self.source != FREE_SOURCE:
            raise ValueError(f"only prompt lookup grows its drafts, not {self.source}")
        drafter_class = GrowingLookup if growing else source_class
        self.drafter = drafter_class(backend, config, bundle.model, self.k)
        if gated and source_class.gateable:
            prepacked = config.decode in getattr(backend, "prepack", ())  # ORT: T > 1 passes much cheaper
            costs = calibrated.verify_costs(prepacked)
            draft_cost = float(
                calibrated.draft_cost or 0.0
            )  # a draft engine's T=1 step in T=1 decode passes (lookup: none)
            # a drafting round in T=1 passes by the build's measurement: k draft steps and one T=k+1 pass
            round_passes = self.k * draft_cost + float(costs.get(str(self.k), default_verify_cost(self.k)))
            plain_passes = float(costs.get("1", default_verify_cost(1))) if self.floor is not None else 1.0
            self.gate = DraftingGate(round_passes, source_class.free_proposals, plain_passes)

    def tokens(self, state: SequenceState, max_new_tokens: int, sampler: Sampler) -> Iterator[int]:
        """Emitted tokens, round after round; the consumer records each in state.tokens before asking for the next."""
        context = list(state.prompt_ids) + list(state.tokens)
        while True:
            # k = 0: the budget leaves only the bonus row, so the round is a plain T=1 step
            k = self.drafter.max_drafts(max_new_tokens - len(state.tokens))
            for token in self._round(state, k, sampler, context):
                state.pending = token
                context.append(token)
                yield token

    def _verified(self, state: SequenceState, k: int, sampler: Sampler, context: list[int]) -> Round:
        """A round of up to k drafts by the source; without drafts a plain step (T=1), or a floor round."""
        return speculative_round(self.drafter, state, context, k, sampler, self.floor)

    def _round(self, state: SequenceState, k: int, sampler: Sampler, context: list[int]) -> list[int]:
        """One round, gated: the gate may make it a plain step, and learns what it cost."""
        gate = self.gate
        if gate is None:
            self._await_sessions(k)
            done = self._verified(state, k, sampler, context)
            self.counts.add(done)
            return done.emitted
        started = time.perf_counter()
        drafting = k >= 1 and gate.should_draft()
        if not drafting and k >= 1 and gate.wants_shadow():  # a free proposal, scored by the plain tokens
            arena = state.arena
            gate.watch(self.drafter.propose(state.pending, context, k, arena.length, arena, sampler).tokens)
        self.counts.draft_s += time.perf_counter() - started
        self._await_sessions(k if drafting else 0)
        done = self._verified(state, k if drafting else 0, sampler, context)
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
            draft_source=self.source,
            draft_len=self.k,
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
        )
