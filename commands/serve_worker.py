"""The one thread that runs the Generator for `serve`: the runtime is not re-entrant (one KV arena),
so requests wait in a bounded queue and are generated one at a time. Each request is a `Job`;
its events (pieces of text, then the end) are handed back to the HTTP event loop thread-safely."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from collections.abc import Generator as Stream
from dataclasses import dataclass, field

from adaptive_export.commands.serve_api import Completion
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.generate import GenerationResult, Generator
from adaptive_export.runtimes.sampling import SamplingParams
from adaptive_export.runtimes.settings import DecodingSettings

log = logging.getLogger("adaptive-export")
CLIENT_GONE = 499  # nginx's "client closed request": the job was cancelled before it ran


@dataclass(frozen=True)
class JobSpec:
    """What one request asks the runtime for, and the request fields its errors name."""

    prompt: str
    raw: bool  # True: no chat template (/v1/completions)
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    prompt_field: str = "prompt"  # "messages" for chat
    budget_field: str = "max_tokens"  # or "max_completion_tokens"


@dataclass(frozen=True)
class PromptLimit:
    """The most UTF-8 bytes a prompt that fits the bundle's context can have: max_len tokens, each at most
    as long as the vocabulary's longest token, twice over for normalizers that shorten text (NFC). A
    longer prompt is refused before it is tokenized (tokenizing 4 MiB took 3-5 s and ~900 MB)."""

    max_len: int
    max_bytes: int

    @classmethod
    def of(cls, generator: Generator) -> PromptLimit:
        vocab = generator.codec.tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1)
        return cls(generator.bundle.max_len, 2 * generator.bundle.max_len * max(longest, 1))


class RequestError(Exception):
    """A request the runtime cannot serve, worded for the HTTP client: the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Started:
    """The request's arguments passed the runtime's checks; pieces follow."""


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Done:
    completion: Completion


@dataclass(frozen=True)
class Failed:
    status: int
    message: str
    param: str | None = None  # the request field at fault (OpenAI's error `param`)


Event = Started | Piece | Done | Failed


@dataclass
class ServeCounters:
    """What the worker did, for /health-style checks and the tests: how many jobs finished, were
    cancelled while running or dropped before they ran, and for each cancelled job how many tokens
    it generated after its cancel."""

    finished: int = 0
    cancelled: int = 0
    dropped: int = 0  # cancelled while queued: never ran
    tokens_after_cancel: list[int] = field(default_factory=list)


class Job:
    """One request: made on the event loop, run on the worker thread, cancellable from either."""

    def __init__(self, spec: JobSpec, loop: asyncio.AbstractEventLoop, pace: Callable[[], None] | None) -> None:
        self.spec = spec
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = loop
        self._pace = pace
        self._lock = threading.Lock()
        self._cancelled = False
        self.tokens = 0  # tokens generated so far (counted per token by should_stop)
        self.tokens_at_cancel = 0

    def cancel(self) -> None:
        """The client is gone: the generation ends at its next token (counted from here)."""
        with self._lock:
            if not self._cancelled:
                self._cancelled, self.tokens_at_cancel = True, self.tokens

    @property
    def cancelled(self) -> bool:
        with self._lock:
            return self._cancelled

    def should_stop(self) -> bool:
        """Asked by the generation loop once per token (runtimes/generate.py GenerationRequest.should_stop)."""
        if self._pace is not None:
            self._pace()
        with self._lock:
            self.tokens += 1
            return self._cancelled

    def emit(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self.events.put_nowait, event)


class GenerationWorker:
    """Runs jobs one at a time on its own thread; at most `queue_size` wait behind the running one."""

    def __init__(
        self, generator: Generator, decoding: DecodingSettings, queue_size: int, default_max_tokens: int
    ) -> None:
        self.generator = generator
        self.decoding = decoding  # the server's, for every request (`serve --config/--mode/--draft/--draft-len`)
        self.default_max_tokens = default_max_tokens  # when a request names none (capped by the bundle's context)
        self.counters = ServeCounters()
        self.pace: Callable[[], None] | None = None  # called once per token (tests slow generation down with it)
        self.prompt_limit = PromptLimit.of(generator)
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._serve, name="adaptive-export-generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel what waits, let the running job end at its next token, and end the thread."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit(Failed(CLIENT_GONE, "the server is shutting down"))
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def new_job(self, spec: JobSpec) -> Job:
        return Job(spec, asyncio.get_running_loop(), self.pace)

    def submit(self, job: Job) -> bool:
        """Queue the job; False when the queue is full (the server answers 429)."""
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def waiting(self) -> int:
        """Jobs queued behind the running one."""
        return self._jobs.qsize()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            except Exception:  # a bug must not kill the thread every later request waits on
                log.exception("generation failed")
                job.emit(Failed(500, "internal error while generating; see the server's log"))

    def _run(self, job: Job) -> None:
        if job.cancelled:
            self.counters.dropped += 1
            log.info("dropped a queued request: its client left before it ran (%d so far)", self.counters.dropped)
            job.emit(Failed(CLIENT_GONE, "the client closed the request before it ran"))
            return
        try:
            pieces = self._start(job)
        except RequestError as exc:
            job.emit(Failed(400, exc.message, exc.param))
            return
        except UsageError as exc:
            job.emit(Failed(400, f"{exc.problem}; {exc.fix}"))
            return
        job.emit(Started())
        try:
            for text in pieces:
                job.emit(Piece(text))
        except UsageError as exc:  # the engine's own checks (non-finite logits): a broken bundle
            job.emit(Failed(500, f"{exc.problem}; {exc.fix}"))
            return
        finally:
            pieces.close()  # ends the loop (and frees its decoder) however the iteration ended
        self._finish(job, self.generator.last_result)

    def _start(self, job: Job) -> Stream[str, None, None]:
        """Encode the prompt the way `run` does (runtimes/text.py) and open the token stream (a generator).
        The lengths are checked here, in the request's own terms, before the runtime's checks."""
        spec, generator = job.spec, self.generator
        max_len = generator.bundle.max_len
        if len(spec.prompt.encode("utf-8")) > self.prompt_limit.max_bytes:  # the HTTP side checked it; not the API
            raise RequestError(prompt_too_long(spec.prompt_field, spec.prompt, self.prompt_limit), spec.prompt_field)
        prompt_ids = generator.codec.encode(spec.prompt, spec.raw)
        room = max_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"{spec.prompt_field}: the prompt has {len(prompt_ids)} tokens and fills the bundle's context "
                f"(max_len {max_len}); send a shorter one",
                spec.prompt_field,
            )
        if spec.max_tokens is not None and spec.max_tokens > room:
            raise RequestError(
                f"{spec.budget_field}: {spec.max_tokens} tokens after the prompt's {len(prompt_ids)} exceed the "
                f"bundle's context (max_len {max_len}); ask for {room} or fewer",
                spec.budget_field,
            )
        return generator.stream(  # type: ignore[return-value]
            prompt_ids,
            max_new_tokens=spec.max_tokens if spec.max_tokens is not None else min(self.default_max_tokens, room),
            sampling=spec.sampling,
            stop=spec.stop,
            should_stop=job.should_stop,
            decoding=self.decoding,
        )

    def _finish(self, job: Job, result: GenerationResult) -> None:
        stats = result.stats
        if stats.stop_reason == "cancelled":
            self.counters.cancelled += 1
            self.counters.tokens_after_cancel.append(job.tokens - job.tokens_at_cancel)
            job.emit(Failed(CLIENT_GONE, "the client closed the request"))
            return
        self.counters.finished += 1
        finish = "length" if stats.stop_reason == "length" else "stop"
        job.emit(Done(Completion(result.text, finish, len(result.prompt_ids), len(result.tokens), stats.to_json())))


def prompt_too_long(field: str, prompt: str, limit: PromptLimit) -> str:
    """The message for a prompt refused by its byte length alone (it was never tokenized)."""
    size = len(prompt.encode("utf-8", "surrogatepass"))
    return (
        f"{field}: the prompt is {size} bytes, more than a context of {limit.max_len} tokens (max_len) can hold "
        f"(at most {limit.max_bytes} bytes); send a shorter one"
    )
