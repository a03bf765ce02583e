"""Bounds on every ONNX Runtime run: a memory ceiling, a time bound, and interrupts honoured mid-run.

An engine holds only allowed ops (runtimes/graph_policy.py), yet allowed ops still exhaust a
machine: a ConstantOfShape of 5 GB, a Concat that doubles, a chain of 200 MatMuls that runs
past 30 s. And `session.run` is C++: Python's SIGINT handler runs only after it returns. So
(docs/hardening.md, "Bounded engines"):

- memory: the sessions of one bundle allocate from one ONNX Runtime arena whose `max_mem` is
  `engine_memory_ceiling` (derived from the bundle's dimensions); an allocation past it fails
  that run, nothing else. Measured: this, RLIMIT_DATA and RLIMIT_AS all stop a 5 GB
  ConstantOfShape in 0.01 s; the arena was chosen because it fails only ONNX Runtime's
  allocations (a process limit also fails numpy, and aborts Rust code such as tokenizers).
- time: each run carries a RunOptions whose `terminate` a watchdog thread sets at the run's
  deadline: the first run of a session gets `first_run_seconds` (a pessimistic FLOP count at
  1 GFLOP/s, at least RUN_TIME_FLOOR_S), later runs RUN_TIME_FACTOR times the first run's
  time (scaled by their token count), at least the floor.
- interrupts: `watch_signals(fd)` gives the watchdog the read end of the CLI's signal wakeup
  pipe (`signal.set_wakeup_fd`, written by the C-level handler even while `session.run`
  holds the main thread), so SIGINT/SIGTERM set `terminate` on every live run at once.

Per step this costs two attribute writes; the watchdog wakes WATCH_TICK_S apart.
"""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import Manifest

T = TypeVar("T")
_FIX = "rebuild the bundle with `adaptive-export build`; engines may only do what the exporter emits"


def engine_memory_ceiling(manifest: Manifest, weight_bytes: int) -> int:
    """Bytes ONNX Runtime may allocate for a bundle: two copies of the weights (a prepacked copy),
    the KV arena, ACTIVATION_FACTOR times the largest fp32 activation at T = max_len, a margin."""
    model, max_len = manifest.model, manifest.max_len
    intermediate = model.extra.get("intermediate_size")
    widest = max(
        model.num_heads * max_len,  # attention scores of one layer
        model.vocab_size,
        intermediate if isinstance(intermediate, int) else 4 * model.hidden_size,
        model.head_dim * (model.num_heads + 2 * model.num_kv_heads),
    )
    arena = model.num_layers * 2 * max_len * model.num_kv_heads * model.head_dim * 4
    activations = limits.ACTIVATION_FACTOR * 4 * max_len * widest
    return 2 * weight_bytes + arena + activations + limits.ENGINE_MEMORY_MARGIN


def check_ceiling_fits(manifest: Manifest, weight_bytes: int) -> None:
    """Refuse a bundle whose arena ceiling exceeds the machine's available memory, before any session:
    the ceiling follows the manifest's max_len, so a bundle that claims 65,536 positions would let
    ONNX Runtime grow until the OOM killer stops the process, with no error line. Set
    ADAPTIVE_EXPORT_SKIP_MEMORY_CHECK=1 to run anyway (the ceiling is an upper bound)."""
    if os.environ.get(limits.SKIP_MEMORY_CHECK_VARIABLE) == "1":
        return
    ceiling, available = engine_memory_ceiling(manifest, weight_bytes), limits.machine_memory()
    if available is not None and ceiling > available:
        raise UsageError(
            f"the bundle's engines may allocate up to {ceiling / 2**30:.1f} GiB at its max_len of "
            f"{manifest.max_len}, and this machine has {available / 2**30:.1f} GiB available",
            "rebuild the bundle with a smaller --max-len, or run it on a machine with more free memory "
            f"(or set {limits.SKIP_MEMORY_CHECK_VARIABLE}=1 to start anyway)",
        )


def first_run_seconds(manifest: Manifest, weight_bytes: int, tokens: int) -> float:
    """The time bound of a session's first run: its FLOPs counted pessimistically (every weight
    used per token, attention over max_len) at WORST_CASE_FLOPS, never under the floor."""
    model = manifest.model
    attention = 4 * model.num_layers * model.num_heads * model.head_dim * manifest.max_len
    flops = tokens * (2 * weight_bytes + attention)  # weight_bytes >= parameters (4 bytes per fp32 one)
    return max(limits.RUN_TIME_FLOOR_S, flops / limits.WORST_CASE_FLOPS)


@dataclass
class _Live:
    """A run in flight: its options (the watchdog sets `terminate`) and deadline."""

    options: Any
    deadline: float
    expired: bool = False
    interrupted: bool = False


@dataclass
class _Watchdog:
    """The one thread that ends live runs at their deadline or on a signal."""

    runs: dict[int, _Live] = field(default_factory=dict)
    signal_fd: int | None = None
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="engine-run-watchdog", daemon=True)
                self.thread.start()

    def _loop(self) -> None:
        while True:
            fd = self.signal_fd
            if fd is None:
                time.sleep(limits.WATCH_TICK_S)
            elif select.select([fd], [], [], limits.WATCH_TICK_S)[0]:
                _drain(fd)
                self.terminate_all()
            now = time.monotonic()
            for live in list(self.runs.values()):
                if now > live.deadline and not live.expired:
                    live.expired = True
                    live.options.terminate = True

    def terminate_all(self) -> None:
        for live in list(self.runs.values()):
            live.interrupted = True
            live.options.terminate = True


_WATCHDOG = _Watchdog()


def _drain(fd: int) -> None:
    try:
        os.read(fd, 512)
    except (BlockingIOError, InterruptedError):
        pass


def watch_signals(fd: int) -> None:
    """Terminate every live run when `fd` (a signal wakeup pipe's read end) becomes readable."""
    _WATCHDOG.signal_fd = fd
    _WATCHDOG.start()


@dataclass
class _FirstRun:
    seconds: float
    tokens: int


class RunGuard:
    """One backend's runs: each gets RunOptions with a deadline; errors become one-line UsageErrors."""

    def __init__(self, ort: Any, manifest: Manifest, weight_bytes: int) -> None:
        check_ceiling_fits(manifest, weight_bytes)
        self.ort, self.manifest, self.weight_bytes = ort, manifest, weight_bytes
        self.first: dict[str, _FirstRun] = {}
        _WATCHDOG.start()

    def bound(self, engine: str, tokens: int) -> float:
        first = self.first.get(engine)
        if first is None:
            return first_run_seconds(self.manifest, self.weight_bytes, tokens)
        scale = max(1.0, tokens / first.tokens)
        return max(limits.RUN_TIME_FLOOR_S, limits.RUN_TIME_FACTOR * first.seconds * scale)

    def run(self, engine: str, tokens: int, call: Callable[[Any], T]) -> T:
        """call(run_options) under the engine's time bound; a terminated or failed allocation is a UsageError."""
        bound, options = self.bound(engine, tokens), self.ort.RunOptions()  # ~1 us; runs may overlap
        started = time.monotonic()
        live = _Live(options, started + bound)
        key = id(live)
        _WATCHDOG.runs[key] = live
        try:
            result = call(options)
        except Exception as exc:
            raise self._error(engine, bound, live, exc) from None
        finally:
            del _WATCHDOG.runs[key]
        if live.interrupted:
            raise KeyboardInterrupt
        if engine not in self.first:
            self.first[engine] = _FirstRun(max(time.monotonic() - started, 1e-4), max(tokens, 1))
        return result

    def _error(self, engine: str, bound: float, live: _Live, exc: Exception) -> BaseException:
        text = str(exc)
        if live.interrupted:
            return KeyboardInterrupt()
        if live.expired or "terminate flag" in text:
            return UsageError(
                f"engine {engine!r} ran past its time bound of {bound:.1f} s "
                f"({limits.RUN_TIME_FACTOR}x its first run, at least {limits.RUN_TIME_FLOOR_S:.0f} s)",
                _FIX + " (or run it on a less loaded machine)",
            )
        if "Available memory of" in text or "Failed to allocate" in text or "bad_alloc" in text:
            ceiling = engine_memory_ceiling(self.manifest, self.weight_bytes)
            return UsageError(
                f"engine {engine!r} needed more memory than the {ceiling >> 20} MB its bundle's dimensions allow",
                _FIX,
            )
        return exc


_ARENA_LOCK = threading.Lock()
_ARENA_OWNER: list[weakref.ref[RunGuard]] = []  # the guard whose ceiling ONNX Runtime's shared CPU arena has now


def create_session(ort: Any, guard: RunGuard, model: bytes, options: Any, providers: list[Any]) -> Any:
    """An InferenceSession that allocates from the arena capped at the guard's bundle's ceiling.

    ONNX Runtime's env allocator is process-wide and a session takes the one registered when it
    is created, so registration and creation happen under one lock, and one registration serves
    every session of a backend (they share the arena, so the ceiling bounds them together)."""
    options.add_session_config_entry("session.use_env_allocators", "1")
    with _ARENA_LOCK:
        if not _ARENA_OWNER or _ARENA_OWNER[0]() is not guard:
            ceiling = engine_memory_ceiling(guard.manifest, guard.weight_bytes)
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(ceiling, -1, -1, -1))
            _ARENA_OWNER[:] = [weakref.ref(guard)]
        return ort.InferenceSession(model, options, providers=providers)
