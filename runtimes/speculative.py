"""Self-speculative decoding on the shared KV arena (DESIGN.md sections 2 and 4).

One round, with L = arena.length and `pending` the newest token (emitted, not cached):
1. a draft source proposes up to k tokens d1..dk after `pending`;
2. one verifier pass over the inputs [pending, d1, .., d(k-1)] at positions L..L+k-1
   gives k rows of full-model logits (row j predicts the token after input j);
3. drafts are accepted while they agree (greedy) or pass the rejection rule (sampling);
   at the first rejection the verifier's token is emitted instead;
4. crop: arena.length = L + (inputs whose KV is now valid). Nothing is copied.

Draft sources:
- early exit (LayerSkip): the draft engine runs the kept layers below E plus the exit head
  T=1 per token, writing those layers' KV rows and saving each exit hidden state (the exit
  query cache); the verify engine runs the layers from E on over the saved hidden states,
  writing the remaining rows of the same positions. Every row is written once.
- prompt lookup: n-gram continuation copied from the context; no engine. The decode engine
  verifies [pending, d1, .., dk] with T=k+1 over token ids and writes all layers' rows; its
  last row gives the bonus token when every draft is accepted, so a round always emits
  accepted + 1 tokens.
- precision (QSpec / ML-SpecQD): the same model with its weights at a cheaper precision
  (an int8/int4 copy of a float bundle, or a GGUF-exact bundle's own blocks at accuracy 4)
  drafts T=1 per token over ids, writing every layer's rows at L..L+k-1; the decode engine
  verifies as for prompt lookup and overwrites those rows with its own, so the arena again
  holds only the verifier's KV. Draft logits are kept, so sampling stays lossless.
Early exit draws no bonus token when all k drafts are accepted (it would cost one more
draft-head call); the last accepted draft becomes `pending` and the next round starts
from it.

Gated drafting (`--mode auto` with prompt lookup or precision drafts): a round with drafts
costs k draft steps (`draft_cost` T=1 passes each; 0 for lookup) plus one T=k+1 pass
(`verify_cost` T=1 passes), both measured at build time, and yields 1 + accepted tokens;
so drafting pays only while the running mean of accepted drafts is at least
k * draft_cost + verify_cost - 1. Below that, rounds are plain T=1 steps (the
cost of plain decoding) with a probe draft every PROBE_EVERY rounds, so a prompt whose
answer repeats its context (rewrite, summarise, edit) still gets the speed-up while a
chat answer decodes at plain speed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from runtimes.backends import Backend
from runtimes.bundle import Bundle
from runtimes.errors import UsageError
from runtimes.sampling import SamplingParams, choose, probabilities

SOURCES = ("early_exit", "prompt_lookup", "precision")
BONUS_SOURCES = ("prompt_lookup", "precision")  # verified by the decode engine at T=k+1: a bonus row
DEFAULT_LOOKUP_K = 4
MAX_NGRAM = 3
DEFAULT_VERIFY_COST = 1.3  # T=k+1 pass / T=1 pass when the bundle carries no measurement
PROBE_EVERY = 16  # gated lookup: rounds between probe drafts while drafting does not pay
EMA_WEIGHT = 0.3  # weight of the newest round in the running mean of accepted drafts


def speculation_available(bundle: Bundle, config: dict[str, Any], source: str | None = None) -> bool:
    """Prompt lookup always works (it needs only the decode engine); the others need engines."""
    source = source or default_source(bundle, config)
    engines = config.get("engines", {})
    if source == "early_exit":
        return "draft" in engines and "verify" in engines
    if source == "precision":
        return "precision_draft" in engines
    return source == "prompt_lookup"


def default_source(bundle: Bundle, config: dict[str, Any]) -> str:
    """The source calibration chose; without calibration, prompt lookup (free)."""
    chosen = (bundle.manifest.get("speculation") or {}).get("source")
    if chosen in SOURCES:
        return chosen
    return "prompt_lookup"


def lookup_ngram(context: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the context's last n-gram."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + k]
                if follow:
                    return follow
    return []


@dataclass
class RoundResult:
    accepted: int
    drafted: int


class SpeculativeRunner:
    """Runs rounds of draft + verify until `emit` says stop."""

    def __init__(self, bundle: Bundle, backend: Backend, config: dict[str, Any], stats: Any, source: str | None = None,
                 draft_len: int | None = None, gated: bool = False) -> None:
        self.bundle, self.backend, self.config, self.stats = bundle, backend, config, stats
        self.source = source or default_source(bundle, config)
        if self.source not in SOURCES:
            raise UsageError(f"draft source {self.source!r} is unknown", f"choose one of: {', '.join(SOURCES)}")
        if not speculation_available(bundle, config, self.source):
            raise UsageError(f"configuration {config['id']!r} has no {self.source} draft engines", "use --draft prompt_lookup, --mode ar, or rebuild with --speculate")
        calibrated = (bundle.manifest.get("speculation") or {}).get(self.source) or {}
        self.k = int(draft_len or calibrated.get("draft_len", DEFAULT_LOOKUP_K))
        if self.k < 1:
            raise UsageError(f"draft length {self.k} is not positive", "use a draft length of 1 or more")
        self.hidden = np.zeros((1, self.k, bundle.model["hidden_size"]), dtype=np.float32)
        self.drafted = self.accepted = self.rounds = 0
        self.gated = gated and self.source in BONUS_SOURCES
        prepacked = config["engines"]["decode"] in getattr(backend, "prepack", ())  # ORT: T > 1 passes much cheaper
        costs = calibrated.get("verify_cost_prepacked" if prepacked else "verify_cost") or {}
        draft_cost = float(calibrated.get("draft_cost", 0.0)) if self.source == "precision" else 0.0
        # accepted drafts a round must average to beat plain T=1 steps
        self.break_even = self.k * draft_cost + float(costs.get(str(self.k), DEFAULT_VERIFY_COST)) - 1.0
        self.mean_accepted: float | None = None
        self.since_probe = self.skipped = 0
        self.draft_s = self.verify_s = 0.0

    def run(self, seq: Any, emit: Callable[[int], bool], max_new_tokens: int, sampling: SamplingParams, rng: np.random.Generator) -> None:
        context = list(seq.prompt_ids) + list(seq.tokens)
        try:
            while True:
                budget = max_new_tokens - len(seq.tokens)
                # lookup and precision drafts emit up to k + 1 tokens a round (the bonus), early exit up to k
                k = min(self.k, budget - 1 if self.source in BONUS_SOURCES else budget)
                if self._round(seq, emit, k, sampling, rng, context):
                    return
        finally:
            self.stats.speculation = {
                "draft_source": self.source,
                "draft_len": self.k,
                "rounds": self.rounds,
                "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "mean_accepted": round(self.accepted / self.rounds, 3) if self.rounds else 0.0,
                "draft_ms": round(self.draft_s * 1e3, 3),
                "verify_ms": round(self.verify_s * 1e3, 3),
                "gated": self.gated,
                "rounds_without_drafting": self.skipped,
            }

    # ---- one round -------------------------------------------------------------------
    def _round(self, seq: Any, emit: Callable[[int], bool], k: int, sampling: SamplingParams,
               rng: np.random.Generator, context: list[int]) -> bool:
        arena, start = seq.arena, seq.arena.length
        started = time.perf_counter()
        if self.source == "early_exit":
            drafts, draft_logits = self._draft_steps(self.config["engines"]["draft"], seq.pending, k, start, arena, sampling, rng)
        elif self.source == "precision":
            drafts, draft_logits = ([], None) if k < 1 or not self._worth_drafting() else self._draft_steps(
                self.config["engines"]["precision_draft"], seq.pending, k, start, arena, sampling, rng)
        else:
            drafts, draft_logits = (lookup_ngram(context, k) if self._worth_drafting() else []), None
        self.draft_s += time.perf_counter() - started
        started = time.perf_counter()
        if self.source == "early_exit":
            out = self.backend.run(self.config["engines"]["verify"], self.hidden[:, : len(drafts)], arena, start)
        else:
            inputs = np.asarray([[seq.pending, *drafts]], dtype=np.int64)
            out = self.backend.run(self.config["engines"]["decode"], inputs, arena, start)
        verify = out.logits[0]
        self.verify_s += time.perf_counter() - started
        self.rounds += 1
        self.drafted += len(drafts)
        accepted, correction = self._accept(drafts, draft_logits, verify, sampling, rng)
        self.accepted += accepted
        if drafts and self.gated:
            self.mean_accepted = accepted if self.mean_accepted is None else (1 - EMA_WEIGHT) * self.mean_accepted + EMA_WEIGHT * accepted
        emitted = drafts[:accepted] + ([correction] if correction is not None else [])
        # inputs pending, d1..d(accepted) now have valid KV in every kept layer
        arena.length = start + (accepted + 1 if correction is not None else accepted)
        for token in emitted:
            seq.pending = token
            context.append(token)
            if emit(token):
                return True
        return False

    def _worth_drafting(self) -> bool:
        """Gated lookup: draft while accepted drafts pay for the wider verify pass, else probe."""
        if not self.gated or self.mean_accepted is None or self.mean_accepted >= self.break_even:
            return True
        self.since_probe += 1
        if self.since_probe >= PROBE_EVERY:
            self.since_probe = 0
            return True
        self.skipped += 1
        return False

    def _draft_steps(self, graph: str, pending: int, k: int, start: int, arena: Any, sampling: SamplingParams,
                     rng: np.random.Generator) -> tuple[list[int], list[np.ndarray]]:
        """k T=1 steps of a draft engine over token ids (early exit: also its exit hidden states)."""
        token = np.empty((1, 1), dtype=np.int64)
        token[0, 0] = pending
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        for j in range(k):
            out = self.backend.run(graph, token, arena, start + j)
            if out.exit_hidden is not None:
                self.hidden[0, j] = out.exit_hidden[0, -1]
            logits = out.logits[0, -1].copy()
            rows.append(logits)
            drafts.append(int(np.argmax(logits)) if sampling.greedy else int(rng.choice(logits.size, p=probabilities(logits, sampling))))
            token[0, 0] = drafts[-1]
        return drafts, rows

    @staticmethod
    def _accept(drafts: list[int], draft_logits: list[np.ndarray] | None, verify: np.ndarray, sampling: SamplingParams,
                rng: np.random.Generator) -> tuple[int, int | None]:
        """(number of accepted drafts, the verifier's token at the first rejection, or the bonus
        token from the row after the last draft when every draft is accepted and the verifier
        scored that row (prompt lookup), else None)."""
        if not drafts:  # nothing to verify: the verifier's row is a plain decode step
            return 0, choose(verify[0], sampling, rng)
        for j, draft in enumerate(drafts):
            if sampling.greedy:
                target = int(np.argmax(verify[j]))
                if target != draft:
                    return j, target
                continue
            p = probabilities(verify[j], sampling)
            q = probabilities(draft_logits[j], sampling) if draft_logits is not None else None
            accept = p[draft] if q is None else min(1.0, p[draft] / max(q[draft], 1e-30))
            if rng.random() < accept:
                continue
            residual = p.copy()
            if q is None:
                residual[draft] = 0.0
            else:
                residual = np.maximum(p - q, 0.0)
            total = residual.sum()
            residual = residual / total if total > 0 else p
            return j, int(rng.choice(residual.size, p=residual))
        return len(drafts), choose(verify[len(drafts)], sampling, rng) if verify.shape[0] > len(drafts) else None
