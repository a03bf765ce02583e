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
from adaptive_export.runtimes.decode_policy import DecodePolicy, prompt_kind, prompt_policy
from adaptive_export.runtimes.decoders import DecodeArgs, DecodeContext, Decoder, DecodeRun, Mode, decoder_for
from adaptive_export.runtimes.draft_model import DraftModel
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, check_decode_rows
from adaptive_export.runtimes.manifest import ConfigEntry
from adaptive_export.runtimes.rows_recheck import RowsOnThisMachine, rows_here
from adaptive_export.runtimes.sampling import Sampler, SamplingParams, make_sampler
from adaptive_export.runtimes.selection import choose_config
from adaptive_export.runtimes.sequence import SequenceState
from adaptive_export.runtimes.settings import DecodingSettings
from adaptive_export.runtimes.speculative import min_decode_rows
from adaptive_export.runtimes.text import StreamDecoder, TextCodec

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+
    from typing_extensions import Unpack


@dataclass
class GenerationStats:
    backend: str
    mode: str  # the decoder's loop: "ar", "spec" or "pipelined"
    config: str
    kept_layers: list[int]
    skipped_layers: int
    prompt_tokens: int
    skip_adapters: bool = False  # the configuration's decode adapts its kept layers (FiRST's LoRA)
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    tpot_ms: float = 0.0
    stop_reason: str = "length"  # "length", "eos", "stop" (a stop string) or "cancelled" (should_stop)
    # rows of every decode pass and why, chosen at prefill (runtimes/decode_policy.py); its fields
    # reach --json under the policy's own names (DecodePolicy.to_json)
    decode_policy: DecodePolicy = DecodePolicy(1, "fixed")
    speculation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["decode_policy"]
        data.update(self.decode_policy.to_json())
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
    decoding: DecodingSettings  # the configuration, mode and draft asked for
    decoder: Decoder  # from the one table of runtimes/decoders.py: the mode and rows asked for
    # asked once per token, after the token is counted: True ends the generation there (stop_reason
    # "cancelled"); a server passes "has the client gone?", so a departed client costs at most one token
    should_stop: Callable[[], bool] | None = None
    policy: DecodePolicy = DecodePolicy(1, "fixed")  # rows of every decode pass, chosen from the prompt

    @property
    def decode_args(self) -> DecodeArgs:
        """What the decoder reads of this request."""
        decoding = self.decoding
        return DecodeArgs(self.max_new_tokens, self.policy.rows, decoding.draft, decoding.draft_len)


class GenerateArguments(TypedDict, total=False):
    """The keyword arguments of `Generator.generate` and `stream`; defaults and checks in `_request`,
    and for the decoding ones (config, mode, draft, draft_len: or all four as `decoding`) in
    runtimes/settings.py."""

    max_new_tokens: int  # default 64
    sampling: SamplingParams | None  # None: greedy
    stop: Sequence[str]
    raw: bool  # True: no chat template
    decoding: DecodingSettings
    config: str
    mode: Mode | str
    draft: str | None
    draft_len: int | None


Loop = collections.abc.Generator[str, None, GenerationResult]


def _decoding_settings(decoding: DecodingSettings | None, fields: dict[str, Any]) -> DecodingSettings:
    """The request's decoding: the record passed, or one made from the fields passed (defaults: the
    record's; an unknown keyword is the record's TypeError)."""
    if decoding is None:
        return DecodingSettings(**fields)
    if not isinstance(decoding, DecodingSettings) or fields:
        raise UsageError(
            "decoding must be one DecodingSettings, passed without config/mode/draft/draft_len beside it",
            "pass decoding=DecodingSettings(...) or the fields alone",
        )
    return decoding


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
        draft_bundle: str | os.PathLike[str] | None = None,
        **backend_options: Any,
    ) -> None:
        """`draft_bundle`: a smaller bundle with the same tokenizer that drafts for this one under
        spec and auto (runtimes/draft_model.py); beside it every decode pass is two rows or more."""
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
        if draft_bundle is not None:
            self.backend.alternate()  # the draft bundle's engines run between this one's
        self.backend.prepare("prefill")
        self.backend.prepare(self.bundle.config("full").decode)
        # rows of every decode pass (manifest `speculation.min_decode_rows`, or the caller's): 2 makes
        # plain steps floor rounds, so every mode computes the rows a verify pass computes; None:
        # chosen per request from the prompt (runtimes/decode_policy.py)
        fixed = check_decode_rows(decode_rows) if decode_rows is not None else min_decode_rows(self.bundle)
        self.fixed_rows: int | None = fixed if decode_rows is not None or fixed >= 2 else None
        self.decode_rows = fixed
        draft = None
        if draft_bundle is not None:
            if decode_rows == 1:
                raise UsageError(
                    "a draft bundle's rounds verify two rows or more: one-row plain steps would not give their tokens",
                    "drop --decode-rows 1, or drop --draft-bundle",
                )
            own = {name: value for name, value in backend_options.items() if name != "prepack"}  # names our graphs
            draft = DraftModel.load(draft_bundle, self.bundle, self.codec, backend, verify, **own)
        self.decoding = DecodeContext(self.bundle, self.backend, draft_model=draft)  # what the decoders read
        self._turn = _Turn()
        self._rows_on_this_machine: RowsOnThisMachine | None = None

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
        should_stop: Callable[[], bool] | None = None,
        decoding: DecodingSettings | None = None,
        **decoding_fields: Any,
    ) -> GenerationRequest:
        """The one list of generate's and stream's arguments with their defaults (GenerateArguments
        types them for callers): checked now, before the loop starts, and typed. The decoding
        arguments come as one `DecodingSettings` or as its fields, whose defaults it holds."""
        decoding = _decoding_settings(decoding, decoding_fields)
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise UsageError(
                f"sampling is {type(sampling).__name__}, not SamplingParams", "pass SamplingParams(...) or None"
            )
        stop_strings = _stop_strings(stop)
        if should_stop is not None and not callable(should_stop):
            raise UsageError(f"should_stop is {type(should_stop).__name__}, not a callable", "pass a function or None")
        prompt_ids = self._prompt_ids(prompt, raw)
        self._check_lengths(prompt_ids, max_new_tokens)
        mode = decoding.parsed_mode
        policy = self._policy(prompt, prompt_ids, mode)
        paired = self.decoding.draft_model is not None
        floor = policy.name == "floor"
        decoder = decoder_for(mode, policy.rows, paired, policy.kind, floor).resolve(self.decoding, policy.rows)
        return GenerationRequest(
            prompt_ids, max_new_tokens, sampling, stop_strings, decoding, decoder, should_stop, policy
        )

    def _policy(self, prompt: str | Sequence[int], prompt_ids: list[int], mode: Mode) -> DecodePolicy:
        """The rows of every decode pass: the caller's or the bundle's where fixed; else, for the
        decoders whose tokens stay ar's (ar and auto alike, so their tokens agree), the rows the
        bundle's build measured for the prompt's kind, else two rows with prompt lookup on an edit
        prompt (runtimes/decode_policy.py). spec and pipelined keep one row. Beside a draft bundle
        every request decodes two rows or more (its rounds' verify passes), and a chat prompt drafts
        with it (policy "draft_model"); an edit prompt keeps the policy it would have had."""
        paired = self.decoding.draft_model is not None
        if self.fixed_rows is not None:
            return DecodePolicy(self.fixed_rows, "fixed", prompt_kind(self._text(prompt, prompt_ids)) if paired else "")
        if not decoder_for(mode, 1, paired).prompt_rows or not self.backend.rows_alike:
            return DecodePolicy(1, "fixed")
        text = self._text(prompt, prompt_ids)
        guessing = self.bundle.graph(self.bundle.config("full").decode).guesses
        here = self._rows_here()
        policy = prompt_policy(text, guessing, here.rows, here.measured_on)
        if not paired:
            return policy
        name = "draft_model" if policy.kind == "chat" else policy.name if policy.rows >= 2 else "lookup"
        return DecodePolicy(max(policy.rows, 2), name, policy.kind, policy.calibrated)

    def _rows_here(self) -> RowsOnThisMachine:
        """The build's per-kind choice, made again with this machine's pass costs where the bundle
        was built elsewhere (once per Generator, before the first request's prefill: it runs passes)."""
        if self._rows_on_this_machine is None:
            threads = getattr(self.backend, "threads", 0)
            self._rows_on_this_machine = rows_here(self.bundle, self.backend, self.arena, threads)
        return self._rows_on_this_machine

    def _text(self, prompt: str | Sequence[int], prompt_ids: list[int]) -> str:
        """The prompt as text (ids decoded), for the policy that reads it."""
        return prompt if isinstance(prompt, str) else self.codec.decode(prompt_ids)

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
        warmups = request.decoder.warm(self.decoding, request.decode_args)  # off the critical path: during prefill
        seq, stats = self._prefill(request, sampler)
        stats.prefill_ms = (time.perf_counter() - started) * 1e3
        decode_start = time.perf_counter()
        run = DecodeRun(seq, request.decode_args, sampler, warmups, stats.speculation)
        decoder = request.decoder.tokens(self.decoding, run)
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
        chosen = self._resolve_config(request.decoding.config, out.router_scores)
        first = sampler.choose(out.logits[0, -1])
        request.decoder.check(self.decoding, request.decode_args, chosen)
        stats = GenerationStats(
            backend=self.backend.name,
            mode=request.decoder.loop,
            config=chosen.id,
            kept_layers=list(chosen.kept),
            skipped_layers=self.bundle.num_layers - len(chosen.kept),
            prompt_tokens=len(prompt_ids),
            skip_adapters=self.bundle.manifest.graph(chosen.decode).skip_adapters,
            decode_policy=request.policy,
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
