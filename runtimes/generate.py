"""The generation loop, once above every backend: prefill, pick a configuration, decode.

Prefill always runs every layer and (when the bundle has routers) returns each router's
sequence-mean score; the configuration is then fixed for the whole sequence, so every
kept layer has KV for every earlier position. Decoding is autoregressive here; the
self-speculative loop lives in runtimes/speculative.py and shares this state.

The loop is one generator (`_loop`): `stream()` hands it to the caller, who gets each piece
of text as its token is decoded, and `generate()` consumes it (docs/architecture.md section 6).
"""

from __future__ import annotations

import collections.abc
import enum
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from adaptive_export.runtimes.backends import Backend, make_backend
from adaptive_export.runtimes.bundle import Bundle, load_bundle
from adaptive_export.runtimes.decode_policy import DecodePolicy, prompt_policy
from adaptive_export.runtimes.drafting import FREE_SOURCE, SOURCES, draft_source
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, check_decode_rows, check_draft_len
from adaptive_export.runtimes.manifest import ConfigEntry
from adaptive_export.runtimes.pipelined import PipelinedDecoder, check_stages
from adaptive_export.runtimes.sampling import Sampler, SamplingParams, make_sampler
from adaptive_export.runtimes.selection import choose_config
from adaptive_export.runtimes.sequence import SequenceState
from adaptive_export.runtimes.speculative import (
    DraftWarmup,
    SpeculativeRunner,
    default_source,
    min_decode_rows,
    speculation_available,
)
from adaptive_export.runtimes.text import StreamDecoder, TextCodec

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+
    from typing_extensions import Unpack


class Mode(enum.Enum):
    """How tokens after the first are decoded (`run --mode`)."""

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

    @property
    def loop(self) -> str:
        """The loop that runs it, as the stats report it: "ar" (plain steps), "spec" (rounds) or "pipelined"."""
        if self in (Mode.AR, Mode.PIPELINED):
            return self.value
        return "spec"


MODES = tuple(mode.value for mode in Mode)


@dataclass
class GenerationStats:
    backend: str
    mode: str  # Mode.loop: "ar", "spec" or "pipelined"
    config: str
    kept_layers: list[int]
    skipped_layers: int
    prompt_tokens: int
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    tpot_ms: float = 0.0
    stop_reason: str = "length"  # "length", "eos", "stop" (a stop string) or "cancelled" (should_stop)
    decode_rows: int = 1  # rows of every decode pass (runtimes/decode_policy.py)
    policy: str = "fixed"  # why: "lookup" (an edit prompt), "plain", or "fixed" (the caller's or bundle's rows)
    speculation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("speculation"))
        return data


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_ids: list[int]
    stats: GenerationStats


@dataclass(frozen=True)
class GenerationRequest:
    """One generation's arguments, checked (`Generator._request`)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    config: str  # "auto" or a configuration id
    mode: Mode
    draft: str | None  # the draft source for Mode.SPEC (None: the calibrated one)
    draft_len: int | None  # None: the source's calibrated draft length
    # asked once per token, after the token is counted: True ends the generation there (stop_reason
    # "cancelled"); a server passes "has the client gone?", so a departed client costs at most one token
    should_stop: Callable[[], bool] | None = None
    policy: DecodePolicy = DecodePolicy(1, "fixed")  # rows of every decode pass, chosen from the prompt


class GenerateArguments(TypedDict, total=False):
    """The keyword arguments of `Generator.generate` and `stream`; defaults and checks in `_request`."""

    max_new_tokens: int  # default 64
    sampling: SamplingParams | None  # None: greedy
    stop: Sequence[str]
    raw: bool  # True: no chat template
    config: str  # "auto" (default) or a configuration id
    mode: Mode | str  # default "ar"
    draft: str | None
    draft_len: int | None


Loop = collections.abc.Generator[str, None, GenerationResult]


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise UsageError(
            f"stop must be a list of strings, got {type(stop).__name__}", "pass stop=[] or a list such as ['\\n\\n']"
        )
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise UsageError(
            f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters are allowed",
            "pass fewer or shorter stop strings",
        )
    return list(stop)


class _Run:
    """Iterating yields the text deltas of one generation; `result` is set once it is exhausted."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self.loop

    def finished(self) -> GenerationResult:
        if self.result is None:
            raise RuntimeError("the generation loop has not run to its end")
        return self.result


class _Turn:
    """Who holds a Generator's one sequence (its KV arena and the backend's output buffers).

    Another thread waits its turn; the holding thread itself is refused: a second stream() while its
    first is live would reset the arena under the first (changing its answer), and waiting for
    itself would never end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the holding thread's ident; only that thread can see its own

    @contextmanager
    def held(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            raise UsageError(
                "a generation started on this Generator while this thread's earlier stream() (or a callback"
                " inside generate) is still live: they would share one KV arena",
                "exhaust or close() the first stream before starting another, or use one Generator per sequence",
            )
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None


class Generator:
    """Load once, generate many times. One sequence at a time (one arena): calls from several
    threads take turns; a thread's second stream() while its first is live is refused."""

    def __init__(
        self,
        bundle: Bundle | str | os.PathLike[str],
        backend: str = "onnx",
        verify: str = "full",
        decode_rows: int | None = None,
        **backend_options: Any,
    ) -> None:
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle, verify=verify)
        self.backend: Backend = make_backend(self.bundle, backend, **backend_options)
        if not self.backend.executes:
            raise UsageError(
                f"backend {backend!r} cannot execute on this machine",
                "run it on its target platform, or choose --backend onnx",
            )
        self.codec = TextCodec(self.bundle)
        model = self.bundle.model
        self.arena = KVArena(
            self.bundle.num_layers,
            self.bundle.max_len,
            model.num_kv_heads,
            model.head_dim,
            layout=self.backend.kv_layout,
        )
        self.backend.prepare("prefill")
        self.backend.prepare(self.bundle.config("full").decode)
        # rows of every decode pass (manifest `speculation.min_decode_rows`, or the caller's): 2 makes
        # plain steps floor rounds, so every mode computes the rows a verify pass computes; None:
        # chosen per request from the prompt (runtimes/decode_policy.py)
        fixed = check_decode_rows(decode_rows) if decode_rows is not None else min_decode_rows(self.bundle)
        self.fixed_rows: int | None = fixed if decode_rows is not None or fixed >= 2 else None
        self.decode_rows = fixed
        self.warmups: dict[str, DraftWarmup] = {}  # draft engine -> the background creation of its session
        self._turn = _Turn()

    # ---- public API -------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        on_text: Callable[[str], None] | None = None,
        **arguments: Unpack[GenerateArguments],
    ) -> GenerationResult:
        """Generate to the end; `on_text` gets each text delta as it is decoded. The same loop as
        `stream`, consumed here; the other arguments and their defaults are `_request`'s."""
        if on_text is not None and not callable(on_text):
            raise UsageError(
                f"on_text is {type(on_text).__name__}, not a callable", "pass a function taking one str, or None"
            )
        with self._turn.held():  # the request too: tokenizers_guard points fd 2 away for the process
            run = _Run(self._loop(self._request(prompt, **arguments)))
            for delta in run:
                if on_text is not None:
                    on_text(delta)
            return run.finished()

    def stream(self, prompt: str | Sequence[int], **arguments: Unpack[GenerateArguments]) -> Iterator[str]:
        """Yield text deltas as tokens are decoded (same arguments as `generate`, except on_text).

        The arguments are checked at the call; decoding advances as the caller iterates, and the
        full result is `last_result` once the iterator is exhausted. The stream holds the Generator
        from its first item until it is exhausted or closed: other threads wait, and this thread's
        next stream or generate is refused meanwhile."""
        with self._turn.held():
            request = self._request(prompt, **arguments)
        run = _Run(self._loop(request))

        def pieces() -> Iterator[str]:
            with self._turn.held():
                yield from run
                self.last_result = run.finished()

        return pieces()

    # ---- arguments --------------------------------------------------------------------
    def _request(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        raw: bool = False,
        config: str = "auto",
        mode: Mode | str = "ar",
        draft: str | None = None,
        draft_len: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationRequest:
        """The one list of generate's and stream's arguments with their defaults (GenerateArguments
        types them for callers): checked now, before the loop starts, and typed."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise UsageError(
                f"sampling is {type(sampling).__name__}, not SamplingParams", "pass SamplingParams(...) or None"
            )
        stop_strings = _stop_strings(stop)
        if not isinstance(config, str):
            raise UsageError(f"config {config!r} is not a configuration id", "pass 'auto' or an id from `inspect`")
        draft_len = check_draft_len(draft_len)
        if should_stop is not None and not callable(should_stop):
            raise UsageError(f"should_stop is {type(should_stop).__name__}, not a callable", "pass a function or None")
        prompt_ids = self._prompt_ids(prompt, raw)
        self._check_lengths(prompt_ids, max_new_tokens)
        parsed = Mode.parse(mode)
        policy = self._policy(prompt, prompt_ids, parsed)
        resolved = self._auto_resolved(parsed, policy.rows)
        return GenerationRequest(
            prompt_ids, max_new_tokens, sampling, stop_strings, config, resolved, draft, draft_len, should_stop, policy
        )

    def _policy(self, prompt: str | Sequence[int], prompt_ids: list[int], mode: Mode) -> DecodePolicy:
        """The rows of every decode pass: the caller's or the bundle's where fixed; else, for auto
        and ar alike (so their tokens agree), two rows with prompt lookup on an edit prompt
        (runtimes/decode_policy.py). spec and pipelined keep one row, as they always did."""
        if self.fixed_rows is not None:
            return DecodePolicy(self.fixed_rows, "fixed")
        if mode not in (Mode.AUTO, Mode.AR) or self.backend.name != "onnx":
            return DecodePolicy(1, "fixed")
        text = prompt if isinstance(prompt, str) else self.codec.decode(prompt_ids)
        return prompt_policy(text)

    def _auto_resolved(self, mode: Mode, rows: int) -> Mode:
        """auto decodes plainly where a verify pass would not reproduce plain steps: `auto` never
        changes the tokens of `--mode ar` (beyond float ties). `build --speculate auto` measures it on
        the ONNX decode engine (manifest `speculation.verify_exactness`); without that measurement,
        MatMulNBits at accuracy level 4 counts as inexact (SmolLM2's default GGUF-exact bundle: logits
        up to 0.98 apart, docs/speculation.md), fp32 and accuracy 1 as exact. A bundle that decodes two
        rows at least (`min_decode_rows`) was measured exact for those steps. `--mode spec` drafts anywhere."""
        if mode is not Mode.AUTO or self.backend.name != "onnx" or rows >= 2:
            return mode
        speculation = self.bundle.manifest.speculation
        measured = speculation.verify_exactness if speculation is not None else None
        if measured is not None:
            return mode if measured.exact else Mode.AR
        onnx = self.bundle.manifest.backends.get("onnx")
        exact = onnx is None or onnx.quantize == "none" or onnx.accuracy_level == 1
        return mode if exact else Mode.AR

    def _prompt_ids(self, prompt: str | Sequence[int], raw: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.codec.encode(prompt, raw)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            return [int(t) for t in prompt]
        raise UsageError(
            f"the prompt is {type(prompt).__name__}, neither text nor a list of token ids",
            "pass a str, or a list of int token ids (decode bytes to str first)",
        )

    def _check_lengths(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise UsageError(
                f"max-new-tokens must be a positive integer, got {max_new_tokens!r}", "pass --max-new-tokens 1 or more"
            )
        if not prompt_ids:
            raise UsageError("the prompt has no tokens", "pass a non-empty prompt")
        vocab = self.bundle.model.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise UsageError(
                f"a prompt token id is outside the vocabulary 0..{vocab - 1}", "pass ids from this bundle's tokenizer"
            )
        needed = len(prompt_ids) + max_new_tokens
        if needed > self.bundle.max_len:
            raise UsageError(
                f"prompt ({len(prompt_ids)} tokens) + max-new-tokens ({max_new_tokens}) = {needed}"
                f" exceeds the bundle's max_len {self.bundle.max_len}",
                "shorten the prompt, lower --max-new-tokens, or rebuild with a larger --max-len",
            )

    # ---- the loop ---------------------------------------------------------------------
    def _loop(self, request: GenerationRequest) -> Loop:
        """The one generation loop: prefill, then one token at a time from the decoder, each
        turned into text as it arrives. Returns (StopIteration.value) the GenerationResult."""
        sampler = make_sampler(request.sampling)
        text = StreamDecoder(self.codec, request.stop)
        started = time.perf_counter()
        warmups = self._warm_draft_sessions(request)  # off the critical path: during prefill and plain steps
        seq, stats = self._prefill(request, sampler)
        stats.prefill_ms = (time.perf_counter() - started) * 1e3
        decode_start = time.perf_counter()
        decoder = self._decoder(seq, stats, request, sampler, warmups)
        try:
            for token in itertools.chain((seq.pending,), decoder):
                seq.tokens.append(token)
                delta = text.push(token)
                if delta:
                    yield delta
                if token in self.codec.eos_ids:
                    stats.stop_reason = "eos"
                elif text.stopped:
                    stats.stop_reason = "stop"
                elif request.should_stop is not None and request.should_stop():
                    stats.stop_reason = "cancelled"
                if stats.stop_reason != "length" or len(seq.tokens) >= request.max_new_tokens:
                    break
        finally:
            decoder.close()  # a decoder that was started records its stats now
        tail = text.flush()
        if tail:
            yield tail
        stats.decode_ms = (time.perf_counter() - decode_start) * 1e3
        stats.new_tokens = len(seq.tokens)
        stats.tpot_ms = stats.decode_ms / max(1, stats.new_tokens - 1)
        return GenerationResult(text.text, list(seq.tokens), request.prompt_ids, stats)

    def _prefill(self, request: GenerationRequest, sampler: Sampler) -> tuple[SequenceState, GenerationStats]:
        prompt_ids = request.prompt_ids
        arena = self.arena
        arena.reset()
        out = self.backend.run("prefill", np.asarray([prompt_ids], dtype=np.int64), arena, 0)
        arena.length = len(prompt_ids)
        chosen = self._resolve_config(request.config, out.router_scores)
        first = sampler.choose(out.logits[0, -1])
        self._check_mode(request, chosen)
        stats = GenerationStats(
            backend=self.backend.name,
            mode=request.mode.loop,
            config=chosen.id,
            kept_layers=list(chosen.kept),
            skipped_layers=self.bundle.num_layers - len(chosen.kept),
            prompt_tokens=len(prompt_ids),
            decode_rows=request.policy.rows,
            policy=request.policy.name,
        )
        return SequenceState(arena=arena, config=chosen, prompt_ids=list(prompt_ids), tokens=[], pending=first), stats

    def _resolve_config(self, config: str, router_scores: np.ndarray | None) -> ConfigEntry:
        if config != "auto":
            return self.bundle.config(config)
        if router_scores is None:
            return self.bundle.config("full")
        threshold = float(self.bundle.manifest.router_threshold)
        kept = [i for i, score in enumerate(router_scores) if score >= threshold]
        return choose_config(self.bundle.manifest.configs, kept)

    def _check_mode(self, request: GenerationRequest, config: ConfigEntry) -> None:
        """spec needs the draft source's engines; auto always runs the speculative loop (see
        _speculative_runner), which falls back to plain steps where drafting does not pay."""
        if request.mode is Mode.AR:
            return
        if request.mode is Mode.PIPELINED:
            self._check_pipelined(request, config)
            return
        draft = request.draft
        if draft is not None:
            draft_source(draft)  # a clear error for an unknown name
        if request.mode is Mode.SPEC and not speculation_available(self.bundle, config, draft):
            name = draft or default_source(self.bundle, config)  # the bundle's calibrated source, named
            raise UsageError(
                f"configuration {config.id!r} has no {name} draft engines",
                "use --draft prompt_lookup, --mode ar, or rebuild with --speculate",
            )

    def _check_pipelined(self, request: GenerationRequest, config: ConfigEntry) -> None:
        """pipelined runs the early-exit engines as its two stages, on ONNX Runtime (two sessions at once)."""
        if request.draft not in (None, "early_exit"):
            raise UsageError(
                f"--draft {request.draft} does not apply to --mode pipelined (its stages are the early-exit engines)",
                "drop --draft, or use --mode spec",
            )
        check_stages(config, self.bundle.root)
        if self.backend.name != "onnx":
            raise UsageError(
                f"--mode pipelined runs two engines at once, which backend {self.backend.name!r} does not",
                "use --backend onnx, or another --mode",
            )

    # ---- decoders ---------------------------------------------------------------------
    def _decoder(
        self,
        seq: SequenceState,
        stats: GenerationStats,
        request: GenerationRequest,
        sampler: Sampler,
        warmups: list[DraftWarmup],
    ) -> collections.abc.Generator[int, None, None]:
        """Tokens after the first: plain steps or speculative rounds (built only if asked for a token)."""
        if request.mode is Mode.AR and request.policy.rows == 1:
            yield from self._decode_ar(seq, sampler)
            return
        if request.mode is Mode.PIPELINED:
            yield from self._decode_pipelined(seq, stats, request, sampler)
            return
        runner = self._speculative_runner(seq, request)
        runner.warmups = warmups
        try:
            yield from runner.tokens(seq, request.max_new_tokens, sampler)
        finally:
            stats.speculation = asdict(runner.report())

    def _speculative_runner(self, seq: SequenceState, request: GenerationRequest) -> SpeculativeRunner:
        """auto: the calibrated source where it pays on average (and has engines for this
        configuration), else prompt lookup; lookup and precision drafts are gated, so a prompt
        whose drafts do not pay decodes plainly."""
        draft_len, rows = request.draft_len, request.policy.rows
        if request.mode is Mode.AR:  # two rows at least: plain steps are floor rounds (one guess each)
            return SpeculativeRunner(self.bundle, self.backend, seq.config, FREE_SOURCE, 1, decode_rows=rows)
        if request.mode is Mode.AUTO:
            if not (self._auto_drafts_calibrated(seq.config, rows) and speculation_available(self.bundle, seq.config)):
                source = FREE_SOURCE
            else:  # the calibrated source, still gated: a prompt whose drafts stop paying decodes plainly
                source = None
            return SpeculativeRunner(
                self.bundle, self.backend, seq.config, source, draft_len, gated=True, decode_rows=rows
            )
        return SpeculativeRunner(self.bundle, self.backend, seq.config, request.draft, draft_len, decode_rows=rows)

    def _auto_drafts_calibrated(self, config: ConfigEntry, rows: int) -> bool:
        """Whether auto drafts with the calibrated source: calibration found that it pays, and on a
        bundle that decodes two rows at least, its rounds keep only rows of the decode engine."""
        spec = self.bundle.manifest.speculation
        if spec is None or not spec.auto_enabled:
            return False
        source = SOURCES.get(default_source(self.bundle, config))
        return source is not None and (rows == 1 or source.decode_engine_rows)

    def _warm_draft_sessions(self, request: GenerationRequest) -> list[DraftWarmup]:
        """Start creating the sessions of the draft engines this request will draft with, in the
        background (ONNX Runtime only), and only where a source with engines will run: `--mode
        spec` with one, or auto where calibration found that its source pays on this bundle.
        Prompt lookup, auto's source everywhere else, has no engine to create."""
        full = self.bundle.config("full")
        if request.mode in (Mode.AR, Mode.PIPELINED) or self.backend.name != "onnx":
            return []  # pipelined runs its stages on sessions of their own (PipelinedDecoder)
        if request.mode is Mode.AUTO and not self._auto_drafts_calibrated(full, request.policy.rows):
            return []
        name = request.draft if request.mode is Mode.SPEC and request.draft else default_source(self.bundle, full)
        source = SOURCES.get(name)
        if source is None or not source.available(full):
            return []
        graphs = [full.engines[role] for role in source.engines]
        new = [graph for graph in graphs if graph not in self.warmups]
        if new:
            warmup = DraftWarmup(self.backend, new)
            self.warmups.update(dict.fromkeys(new, warmup))
        return list({id(self.warmups[graph]): self.warmups[graph] for graph in graphs}.values())

    def _decode_pipelined(
        self, seq: SequenceState, stats: GenerationStats, request: GenerationRequest, sampler: Sampler
    ) -> Iterator[int]:
        decoder = PipelinedDecoder(self.backend, seq.config, getattr(self.backend, "threads", 0))
        try:
            yield from decoder.tokens(seq, request.max_new_tokens, sampler)
        finally:
            decoder.close()
            stats.speculation = asdict(decoder.stats)

    def _decode_ar(self, seq: SequenceState, sampler: Sampler) -> Iterator[int]:
        graph = seq.config.decode
        arena = seq.arena
        token = np.empty((1, 1), dtype=np.int64)
        while True:
            token[0, 0] = seq.pending
            out = self.backend.run(graph, token, arena, arena.length)
            arena.length += 1
            seq.pending = sampler.choose(out.logits[0, -1])
            yield seq.pending
