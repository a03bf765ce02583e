"""The decoders: what decodes a request's tokens after the first, one per decoding policy.

`DECODERS` is the one table from a request's `--mode` and rows to its decoder (issue #39). Each
decoder brings its own checks (before prefill's tokens are handed out), its background warm-up
of draft sessions, and its loop; `Generator` (runtimes/generate.py) asks the table once per
request and never branches on the mode itself:

| mode | rows | decoder | what runs |
|---|---|---|---|
| ar | 1 | `PlainSteps` | one T=1 decode pass per token |
| ar | 2+ | `FloorRounds` | one T=2 pass per round, over [pending, a free guess]: 1-2 tokens |
| spec | any | `Speculative` | rounds of the chosen source's drafts, ungated |
| auto | any | `GatedSpeculative` | rounds of the source that pays, drafting only while it pays (*) |
| pipelined | any | `Pipelined` | predictive pipelined decoding over the early-exit stages |
| spec, auto (not edit prompts), a draft bundle | 2+ | `PairedDrafts` | rounds of a smaller bundle's drafts |

(*) On two rows without a calibrated source: prompt lookup growing from one draft a round
(`GrowingLookup`), decided from the tokens alone.

`auto` on a one-row bundle whose verify passes would not reproduce plain steps resolves to
`PlainSteps`, so it never changes `ar`'s tokens (`GatedSpeculative.resolve`).
"""

from __future__ import annotations

import collections.abc
import enum
from dataclasses import asdict, dataclass, field

import numpy as np

from adaptive_export.runtimes.backends import Backend
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.draft_model import DRAFT_MODEL_K, DraftModel
from adaptive_export.runtimes.drafting import FREE_SOURCE, SOURCES, DraftChain, SourceEnv, make_chain
from adaptive_export.runtimes.drafting.prompt_lookup import GROWING_MOST
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import ConfigEntry
from adaptive_export.runtimes.pipelined import PipelinedDecoder, check_stages
from adaptive_export.runtimes.sampling import Sampler
from adaptive_export.runtimes.sequence import SequenceState
from adaptive_export.runtimes.speculative import (
    DraftWarmup,
    SpeculativeRunner,
    default_source,
    draft_length,
    requested_chain,
    speculation_available,
)

TokenStream = collections.abc.Generator[int, None, None]  # tokens after the first; closing it ends the decoder


class Mode(enum.Enum):
    """How tokens after the first are decoded (`run --mode`); `DECODERS` maps each to its decoder."""

    AR = "ar"  # plain steps
    SPEC = "spec"  # speculative rounds with the chosen (or calibrated) draft source
    AUTO = "auto"  # speculative rounds, gated: the calibrated source where it pays, else prompt lookup
    PIPELINED = "pipelined"  # predictive pipelined decoding over the early-exit stages (runtimes/pipelined.py)

    @classmethod
    def parse(cls, mode: Mode | str) -> Mode:
        if isinstance(mode, Mode):
            return mode
        if not isinstance(mode, str) or mode not in MODES:
            raise UsageError(f"mode {mode!r} is unknown", f"choose one of: {', '.join(MODES)}")
        return cls(mode)


MODES = tuple(mode.value for mode in Mode)


@dataclass(frozen=True)
class DecodeArgs:
    """What a decoder reads of a request (`GenerationRequest.decode_args`)."""

    max_new_tokens: int
    rows: int  # rows of every decode pass (runtimes/decode_policy.py)
    draft: str | None  # the draft source asked for (None: the calibrated one)
    draft_len: int | None  # None: the source's calibrated draft length


@dataclass(frozen=True)
class DecodeRun:
    """One sequence's decoding: its state, the request's arguments, the sampler, the draft sessions
    to wait for, and the stats' `speculation` dict the decoder fills."""

    seq: SequenceState
    args: DecodeArgs
    sampler: Sampler
    warmups: list[DraftWarmup]
    speculation: dict[str, object]


@dataclass
class DecodeContext:
    """What every decoder reads: the bundle, its backend, and the draft sessions being created."""

    bundle: Bundle
    backend: Backend
    warmups: dict[str, DraftWarmup] = field(default_factory=dict)  # draft engine -> its background creation
    draft_model: DraftModel | None = None  # `--draft-bundle`: a smaller bundle that drafts (runtimes/draft_model.py)

    def chain(
        self, config: ConfigEntry, names: tuple[str, ...], k: int | None, rows: int, name: str | None = None
    ) -> DraftChain:
        """The named sources for this configuration, each drafting k a round (None: its calibrated
        length); on two rows or more with the floor guess asked last. `name`: what stats call it."""
        env = SourceEnv(self.backend, config, self.bundle.model, self.draft_model)
        lengths = {source: draft_length(self.bundle, source, k) for source in names}
        return make_chain(env, names, lengths, rows >= 2, name)

    def warm(self, graphs: list[str]) -> list[DraftWarmup]:
        """Start creating these engines' sessions in the background (once per engine); the warm-ups to wait for."""
        new = [graph for graph in graphs if graph not in self.warmups]
        if new:
            warmup = DraftWarmup(self.backend, new)
            self.warmups.update(dict.fromkeys(new, warmup))
        return list({id(self.warmups[graph]): self.warmups[graph] for graph in graphs}.values())


class Decoder:
    """One decoding policy. `loop` is what `stats.mode` reports; `prompt_rows` says whether the
    prompt may choose the rows (runtimes/decode_policy.py): only where the tokens stay `ar`'s."""

    loop = "ar"
    prompt_rows = False

    def resolve(self, context: DecodeContext, rows: int) -> Decoder:
        """The decoder that actually runs at these rows (itself, unless it would change the tokens)."""
        return self

    def check(self, context: DecodeContext, args: DecodeArgs, config: ConfigEntry) -> None:
        """Refuse, with one line, what this decoder cannot run on the chosen configuration."""

    def warm(self, context: DecodeContext, args: DecodeArgs) -> list[DraftWarmup]:
        """Start creating the draft sessions it will need, off the critical path (during prefill)."""
        return []

    def tokens(self, context: DecodeContext, run: DecodeRun) -> TokenStream:
        raise NotImplementedError


class PlainSteps(Decoder):
    """One T=1 decode pass per token: plain autoregressive decoding."""

    prompt_rows = True

    def tokens(self, context: DecodeContext, run: DecodeRun) -> TokenStream:
        seq, sampler, backend = run.seq, run.sampler, context.backend
        graph, arena = seq.config.decode, seq.arena
        token = np.empty((1, 1), dtype=np.int64)
        while True:
            token[0, 0] = seq.pending
            out = backend.run(graph, token, arena, arena.length)
            arena.length += 1
            seq.pending = sampler.choose(out.logits[0, -1])
            yield seq.pending


class _Rounds(Decoder):
    """Decoders that run `SpeculativeRunner` rounds; the runner's report fills `speculation` (the stats')."""

    def runner(self, context: DecodeContext, seq: SequenceState, args: DecodeArgs) -> SpeculativeRunner:
        raise NotImplementedError

    def tokens(self, context: DecodeContext, run: DecodeRun) -> TokenStream:
        runner = self.runner(context, run.seq, run.args)
        runner.warmups = run.warmups
        try:
            yield from runner.tokens(run.seq, run.args.max_new_tokens, run.sampler)
        finally:
            run.speculation.update(asdict(runner.report()))


class FloorRounds(_Rounds):
    """Plain decoding on two rows or more: every pass is T=2 over [pending, a free guess] (prompt
    lookup's next token, else `pending`), so its rows are the rows a verify pass computes and
    speculation over the same rows keeps its tokens. A right guess emits two tokens."""

    prompt_rows = True

    def runner(self, context: DecodeContext, seq: SequenceState, args: DecodeArgs) -> SpeculativeRunner:
        return SpeculativeRunner(context.bundle, context.chain(seq.config, FLOOR_CHAIN, 1, args.rows, FREE_SOURCE))


class Speculative(_Rounds):
    """`--mode spec`: rounds of the chosen (else the calibrated) source's drafts, every round drafting."""

    loop = "spec"

    def check(self, context: DecodeContext, args: DecodeArgs, config: ConfigEntry) -> None:
        if not speculation_available(context.bundle, config, args.draft):
            name = args.draft or default_source(context.bundle, config)  # the bundle's calibrated source, named
            raise UsageError(
                f"configuration {config.id!r} has no {name} draft engines",
                "use --draft prompt_lookup, --mode ar, or rebuild with --speculate",
            )

    def warm(self, context: DecodeContext, args: DecodeArgs) -> list[DraftWarmup]:
        names = requested_chain(context.bundle, context.bundle.config("full"), args.draft)
        return [warmup for name in names for warmup in warm_source(context, name)]

    def runner(self, context: DecodeContext, seq: SequenceState, args: DecodeArgs) -> SpeculativeRunner:
        names = requested_chain(context.bundle, seq.config, args.draft)
        return SpeculativeRunner(context.bundle, context.chain(seq.config, names, args.draft_len, args.rows))


class GatedSpeculative(_Rounds):
    """`--mode auto`: the calibrated source where calibration found it pays (and it has engines for
    this configuration), else prompt lookup; drafting is gated, so a prompt whose drafts do not pay
    decodes plainly (runtimes/gate.py). On two rows, where one draft a round costs what a floor
    round does, prompt lookup grows its drafts from the tokens instead (deterministic; `--draft-len`
    keeps the gated k)."""

    loop = "spec"
    prompt_rows = True

    def resolve(self, context: DecodeContext, rows: int) -> Decoder:
        """Plain steps where a verify pass would not reproduce them: auto never changes `ar`'s
        tokens (beyond float ties). `build --speculate auto` measures it (manifest
        `speculation.verify_exactness`); without that measurement, MatMulNBits at accuracy level 4
        counts as inexact (SmolLM2's default GGUF-exact bundle: logits up to 0.98 apart,
        docs/speculation.md), fp32 and accuracy 1 as exact. Two rows or more were measured exact
        for those steps; a backend without alike rows keeps auto (its passes compute rows alike)."""
        if rows >= 2 or not context.backend.rows_alike:
            return self
        speculation = context.bundle.manifest.speculation
        measured = speculation.verify_exactness if speculation is not None else None
        if measured is not None:
            return self if measured.exact else PLAIN_STEPS
        onnx = context.bundle.manifest.backends.get("onnx")
        exact = onnx is None or onnx.quantize == "none" or onnx.accuracy_level == 1
        return self if exact else PLAIN_STEPS

    def warm(self, context: DecodeContext, args: DecodeArgs) -> list[DraftWarmup]:
        full = context.bundle.config("full")
        if not calibrated_source_pays(context.bundle, full, args.rows):
            return []  # prompt lookup, auto's source everywhere else, has no engine to create
        return warm_source(context, default_source(context.bundle, full))

    def runner(self, context: DecodeContext, seq: SequenceState, args: DecodeArgs) -> SpeculativeRunner:
        rows, bundle = args.rows, context.bundle
        calibrated = calibrated_source_pays(bundle, seq.config, rows) and speculation_available(bundle, seq.config)
        if not calibrated and rows >= 2 and args.draft_len is None:  # prompt lookup, growing from floor rounds
            return SpeculativeRunner(bundle, context.chain(seq.config, GROWING_CHAIN, GROWING_MOST, rows, FREE_SOURCE))
        names = (default_source(bundle, seq.config),) if calibrated else (FREE_SOURCE,)
        return SpeculativeRunner(bundle, context.chain(seq.config, names, args.draft_len, rows), gated=True)


class PairedDrafts(_Rounds):
    """`--draft-bundle` under spec or auto: every round drafts with the draft bundle
    (runtimes/draft_model.py) and verifies at two rows or more, the rows `--mode ar` decodes with
    beside a draft bundle (Generator), so the tokens stay ar's."""

    loop = "spec"
    prompt_rows = True

    def check(self, context: DecodeContext, args: DecodeArgs, config: ConfigEntry) -> None:
        if args.draft is not None:
            raise UsageError(f"--draft {args.draft} and --draft-bundle both name a draft source", "drop one of them")

    def runner(self, context: DecodeContext, seq: SequenceState, args: DecodeArgs) -> SpeculativeRunner:
        chain = context.chain(seq.config, PAIRED_CHAIN, args.draft_len or DRAFT_MODEL_K, args.rows, "draft_model")
        return SpeculativeRunner(context.bundle, chain)


class Pipelined(Decoder):
    """`--mode pipelined`: the early-exit draft of the next token runs beside the rest of this
    token's layers (runtimes/pipelined.py), two sessions at once."""

    loop = "pipelined"

    def check(self, context: DecodeContext, args: DecodeArgs, config: ConfigEntry) -> None:
        if args.draft not in (None, "early_exit"):
            raise UsageError(
                f"--draft {args.draft} does not apply to --mode pipelined (its stages are the early-exit engines)",
                "drop --draft, or use --mode spec",
            )
        check_stages(config, context.bundle.root)
        if not context.backend.parallel_sessions:
            raise UsageError(
                f"--mode pipelined runs two engines at once, which backend {context.backend.name!r} does not",
                "use --backend onnx, or another --mode",
            )

    def tokens(self, context: DecodeContext, run: DecodeRun) -> TokenStream:
        decoder = PipelinedDecoder(context.backend, run.seq.config, getattr(context.backend, "threads", 0))
        try:
            yield from decoder.tokens(run.seq, run.args.max_new_tokens, run.sampler)
        finally:
            decoder.close()
            run.speculation.update(asdict(decoder.stats))


def calibrated_source_pays(bundle: Bundle, config: ConfigEntry, rows: int) -> bool:
    """Whether auto drafts with the calibrated source: calibration found that it pays, and on two
    rows or more, its rounds keep only rows of the decode engine."""
    spec = bundle.manifest.speculation
    if spec is None or not spec.auto_enabled:
        return False
    source = SOURCES.get(default_source(bundle, config))
    return source is not None and (rows == 1 or source.decode_engine_rows)


def warm_source(context: DecodeContext, name: str) -> list[DraftWarmup]:
    """The background creation of the named source's draft sessions, where the backend can create
    sessions beside a running one and the full configuration has them."""
    source = SOURCES.get(name)
    full = context.bundle.config("full")
    if not context.backend.parallel_sessions or source is None or not source.available(full):
        return []
    return context.warm([full.engines[role] for role in source.engines])


# The chains the policies run (each a list of source names, asked in order; runtimes/drafting/chain.py);
# stats name them as before the chains (prompt_lookup, draft_model), `rounds_by_source` per link
FLOOR_CHAIN = (FREE_SOURCE,)  # `--mode ar` on two rows: one lookup draft a round, else the floor's guess
GROWING_CHAIN = ("growing_lookup",)  # auto on two rows without a calibrated source
PAIRED_CHAIN = ("sure_lookup", "draft_model")  # a draft bundle: a long match copies, else the bundle drafts

PLAIN_STEPS = PlainSteps()
# the one table: (mode, two rows or more) -> decoder
DECODERS: dict[tuple[Mode, bool], Decoder] = {
    (Mode.AR, False): PLAIN_STEPS,
    (Mode.AR, True): FloorRounds(),
    **{(Mode.SPEC, wide): Speculative() for wide in (False, True)},
    **{(Mode.AUTO, wide): GatedSpeculative() for wide in (False, True)},
    **{(Mode.PIPELINED, wide): Pipelined() for wide in (False, True)},
}


PAIRED_DRAFTS = PairedDrafts()


def decoder_for(mode: Mode, rows: int, paired: bool = False, kind: str = "", floor: bool = False) -> Decoder:
    """The decoder of a request: the table's entry for its mode and rows. Beside a draft bundle
    (`paired`) spec drafts with it, and auto on every prompt but an edit one, where prompt lookup
    and the bundle's own head paid more (the 1.5B: 43.6 against 56.2 ms, docs/draft-bundle.md).
    `floor`: growing lookup measured no cheaper than floor rounds for this kind of prompt on this
    machine (runtimes/rows_choice.py), so auto on two rows runs `--mode ar`'s rounds."""
    if paired and (mode is Mode.SPEC or (mode is Mode.AUTO and kind != "edit")):
        return PAIRED_DRAFTS
    if floor and mode is Mode.AUTO and rows >= 2:
        return DECODERS[(Mode.AR, True)]
    return DECODERS[(mode, rows >= 2)]
