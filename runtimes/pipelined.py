"""Predictive Pipelined Decoding (Yang et al., "Predictive Pipelined Decoding: A Compute-Latency
Trade-off for Exact LLM Decoding"): spare compute starts the next token before this one is known.

The two stages are the early-exit engines of a configuration (graphs/drafts/early_exit.py):
stage 1 is the draft graph at d (the kept layers below d, then the exit head; it also returns
the exit hidden state h_d), stage 2 the verify graph at d (the kept layers from d on, over h_d).
For the pending token at position s: stage 1 gives h_d and a guess of the next token; then, at
once and in two threads, stage 2 finishes position s and stage 1 already runs the guess at s+1.
Both write the one KV arena in place and touch disjoint layers (stage 2 the layers >= d at row
s, stage 1 the layers < d at row s+1), so they never race. The final token is chosen from stage
2's logits by the sampler, exactly as plain decoding chooses it (greedy: identical tokens;
sampling: the same draws from the same distribution); if it equals the guess, the next token's
stage 1 is already done, else its rows at s+1 are simply written again for the true token.
Nothing is copied back and no row past the arena's length is ever read.

One guess per token (k=1): this machine has two cores, one for each stage. k > 1 candidates would
each need scratch KV rows of their own for s+1 (the arena has one row per position) and a core
each; the match-rate table for k=1..3 is measured offline (benchmarks/pipelined.py).

Concurrency: each stage engine is an ONNX Runtime session with its own intra-op pool of half the
run's threads (`Backend.with_threads`); ONNX Runtime releases the GIL in `run`, so two Python
threads run the two sessions at the same time. Their IO bindings and output buffers are per
graph, and the run guard's shared state is only its per-run entries.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from adaptive_export.runtimes.backends import Backend
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry
from adaptive_export.runtimes.sampling import Sampler
from adaptive_export.runtimes.sequence import SequenceState

STAGE_ENGINES = ("draft", "verify")  # the configuration's engine roles: stage 1, stage 2


def has_stages(config: ConfigEntry) -> bool:
    """Whether the configuration has the early-exit draft and verify engines the stages run."""
    return all(role in config.engines for role in STAGE_ENGINES)


def check_stages(config: ConfigEntry, bundle_path: object) -> None:
    """A bundle built without --speculate has no stages: one line, exit 2."""
    if not has_stages(config):
        raise UsageError(
            f"bundle {bundle_path} (configuration {config.id!r}) has no pipeline stages",
            "rebuild it with --speculate D:k (the early-exit engines at layer D are the two stages), or use --mode ar",
        )


def stage_threads(threads: int) -> int:
    """Each stage's intra-op threads: half the run's, at least 1. For threads=0 (ONNX Runtime's
    default, one per physical core) half the CPUs this process may run on: the same on a machine
    without SMT (this one), twice ORT's default where each core runs two threads."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (threads or cpus or 2) // 2)


@dataclass(frozen=True)
class StageOne:
    """Stage 1's result for one position: the exit hidden state stage 2 starts from (a copy:
    the engine's output buffer is reused by the next stage-1 run) and the guessed next token."""

    hidden: np.ndarray  # [1, 1, hidden]
    guess: int


@dataclass
class PipelineCounts:
    """What one sequence's pipelined steps added up to."""

    tokens: int = 0  # tokens chosen from stage 2's logits
    matches: int = 0  # ... equal to the guess, so the next token's stage 1 was already done
    stage1_s: float = 0.0  # stage-1 runs on the critical path (the first one, and after each miss)
    overlapped_s: float = 0.0  # stage 2 beside the next token's stage 1


@dataclass(frozen=True)
class PipelineReport:
    """A sequence's pipelined decoding as `stats.speculation` reports it (keys in this order)."""

    exit_layer: int
    candidates: int
    stage_threads: int
    tokens: int
    matches: int
    match_rate: float  # matches / tokens
    stage1_ms: float
    overlapped_ms: float


class PipelinedDecoder:
    """Decodes one sequence in two pipelined stages (module docstring); `tokens` yields each token,
    `stats` reports the guesses; `close` ends the helper thread. One sequence at a time."""

    candidates = 1

    def __init__(self, backend: Backend, config: ConfigEntry, threads: int) -> None:
        self.threads = stage_threads(threads)
        self.backend = backend.with_threads(self.threads)
        self.draft, self.verify = (config.engines[role] for role in STAGE_ENGINES)
        info = backend.bundle.graph(self.draft)
        self.exit_layer = int(info.exit_layer or 0)
        self.ids = backend.bundle.draft_vocab_ids if info.draft_vocab else None  # a trimmed head's row -> token id
        for graph in (self.draft, self.verify):
            self.backend.prepare(graph)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipelined-stage1")
        self.counts = PipelineCounts()

    def tokens(self, seq: SequenceState, max_new_tokens: int, sampler: Sampler) -> Iterator[int]:
        """Tokens after `seq.pending`; the consumer records each in seq.tokens before asking for the next."""
        arena = seq.arena
        ahead: StageOne | None = None  # stage 1 of the pending token, when already done
        while True:
            start = arena.length
            if ahead is None:
                began = time.perf_counter()
                ahead = self._stage1(seq.pending, start, arena)
                self.counts.stage1_s += time.perf_counter() - began
            last = len(seq.tokens) + 1 >= max_new_tokens  # no token follows this one: nothing to start
            logits, guessed = self._step(ahead, start, None if last else ahead.guess, arena)
            arena.length = start + 1
            token = sampler.choose(logits)
            self.counts.tokens += 1
            matched = token == ahead.guess
            self.counts.matches += matched
            ahead = guessed if matched else None
            seq.pending = token
            yield token

    def _step(
        self, ahead: StageOne, start: int, guess: int | None, arena: KVArena
    ) -> tuple[np.ndarray, StageOne | None]:
        """Stage 2 at `start` and, beside it in the helper thread, stage 1 of `guess` at start + 1."""
        began = time.perf_counter()
        future = None if guess is None else self.pool.submit(self._stage1, guess, start + 1, arena)
        try:
            logits = self.backend.run(self.verify, ahead.hidden, arena, start).logits[0, -1]
        finally:
            if future is not None:  # never leave stage 1 writing the arena behind us, even on an error
                concurrent.futures.wait([future])
        guessed = None if future is None else future.result()
        self.counts.overlapped_s += time.perf_counter() - began
        return logits, guessed

    def _stage1(self, token: int, start: int, arena: KVArena) -> StageOne:
        """The draft engine on `token` at `start`: writes the layers below d, guesses the next token."""
        ids = np.full((1, 1), token, dtype=np.int64)  # its own array: ORT reads it during the run
        out = self.backend.run(self.draft, ids, arena, start)
        assert out.exit_hidden is not None  # a draft graph returns it (manifest checks)
        best = int(np.argmax(out.logits[0, -1]))
        return StageOne(out.exit_hidden.copy(), best if self.ids is None else int(self.ids[best]))

    @property
    def stats(self) -> PipelineReport:
        """What this decoder's sequence did so far."""
        counts = self.counts
        rate = round(counts.matches / counts.tokens, 4) if counts.tokens else 0.0
        stage1_ms, overlapped_ms = (round(seconds * 1e3, 3) for seconds in (counts.stage1_s, counts.overlapped_s))
        guesses = (counts.tokens, counts.matches, rate)
        return PipelineReport(self.exit_layer, self.candidates, self.threads, *guesses, stage1_ms, overlapped_ms)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
