"""Self-speculative decoding on the shared KV arena (docs/architecture.md sections 4 and 5).

One round, with L = arena.length and `pending` the newest token (emitted, not cached):
1. a draft source proposes up to k tokens d1..dk after `pending`;
2. one verifier pass over the inputs [pending, d1, .., d(k-1)] at positions L..L+k-1
   gives k rows of full-model logits (row j predicts the token after input j);
3. drafts are accepted while they agree (greedy) or pass the rejection rule (sampling);
   at the first rejection the verifier's token is emitted instead;
4. crop: arena.length = L + (inputs whose KV is now valid). Nothing is copied.

Draft sources (early exit, prompt lookup, precision) are `runtimes.drafting.DraftSource`s:
what drafts, which engines it needs, how its verify pass runs, whether it earns a bonus
token. A source whose verify pass scores the row after the last draft (prompt lookup,
precision) emits accepted + 1 tokens every round; otherwise (early exit) the last accepted
draft becomes `pending` and the next round starts from it.

Gated drafting (`--mode auto`; the gateable sources, prompt lookup and precision) drafts
only while drafting pays on this machine, now. The runner keeps running means of the tokens a
drafting round emits, of a drafting round's seconds and of a plain round's seconds (a T=1
step, one token), and drafts while a drafting round's seconds per token are below a plain
step's. Until both are timed it prices a drafting round with the build's measurement: k draft
steps (`draft_cost` T=1 passes each, 0 for lookup) plus one T=k+1 pass (`verify_cost` T=1
passes). A build calibrated on a busy machine, or run on another, therefore corrects itself
within a few rounds. Prompt lookup's proposals cost nothing, so plain rounds score them too
(under greedy decoding the tokens plain decoding emits are exactly those verification would
accept): a chat answer that never repeats its context decodes at plain speed without paying
for drafting rounds to find that out, and a rewrite starts drafting as soon as its proposals
would be accepted. Other sources probe with a draft every PROBE_EVERY plain rounds, and
drafting rounds re-time plain decoding every PLAIN_EVERY rounds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptive_export.runtimes.backends import Backend
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.drafting import FREE_SOURCE, SOURCES, draft_source
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import ConfigEntry
from adaptive_export.runtimes.sampling import SamplingParams, choose, probabilities

DEFAULT_LOOKUP_K = 4
DEFAULT_VERIFY_COST = 1.3  # T=k+1 pass / T=1 pass when the bundle carries no measurement
PROBE_EVERY = 16  # gated drafting: plain rounds between probe drafts while drafting does not pay
PLAIN_EVERY = 16  # gated drafting: drafting rounds between plain rounds that re-time plain decoding
PROBE_MIN_EMITTED = 1.5  # free proposals: probe only while plain rounds score them at least this well
EMA_WEIGHT = 0.3  # weight of the newest round in the running means (accepted drafts, round times)


def speculation_available(bundle: Bundle, config: ConfigEntry, source: str | None = None) -> bool:
    """Whether the configuration has the engines the source needs (prompt lookup needs none)."""
    found = SOURCES.get(source or default_source(bundle, config))
    return found is not None and found.available(config)


def default_source(bundle: Bundle, config: ConfigEntry) -> str:
    """The source calibration chose; without calibration, prompt lookup (free)."""
    chosen = bundle.manifest.speculation.source if bundle.manifest.speculation else None
    if chosen is not None and chosen in SOURCES:
        return chosen
    return FREE_SOURCE


@dataclass
class RoundResult:
    accepted: int
    drafted: int


class SpeculativeRunner:
    """Runs rounds of draft + verify, yielding each emitted token; the consumer stops it by closing it."""

    def __init__(
        self,
        bundle: Bundle,
        backend: Backend,
        config: ConfigEntry,
        stats: Any,
        source: str | None = None,
        draft_len: int | None = None,
        gated: bool = False,
    ) -> None:
        self.bundle, self.backend, self.config, self.stats = bundle, backend, config, stats
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
        self.drafter = source_class(backend, config, bundle.model, self.k)
        self.drafted = self.accepted = self.rounds = 0
        self.gated = gated and source_class.gateable
        prepacked = config.decode in getattr(backend, "prepack", ())  # ORT: T > 1 passes much cheaper
        costs = calibrated.verify_costs(prepacked)
        draft_cost = float(
            calibrated.draft_cost or 0.0
        )  # a draft engine's T=1 step in T=1 decode passes (lookup: none)
        # a drafting round in T=1 passes by the build's measurement: k draft steps and one T=k+1 pass
        self.round_passes = self.k * draft_cost + float(costs.get(str(self.k), DEFAULT_VERIFY_COST))
        self.since_probe = self.skipped = self.since_plain = 0
        self.draft_s = self.verify_s = 0.0
        # online gate: running means of tokens per drafting round, of a plain round's seconds and
        # of a drafting round's seconds
        self.mean_emitted: float | None = None
        self.plain_s: float | None = None
        self.draft_round_s: float | None = None
        self.warm: set[bool] = set()  # round kinds (drafted or not) seen once: a first round may create sessions
        # a source whose proposals cost nothing (prompt lookup) is scored on plain rounds too: its
        # proposal is compared with the tokens plain decoding then emits, which under greedy decoding
        # are exactly the tokens verification would accept, so a prompt whose drafts would not pay
        # never pays for a drafting round to find out
        self.shadowing = self.gated and source_class.free_proposals
        self.shadow: list[int] = []
        self.shadow_hits = 0

    def tokens(
        self, seq: Any, max_new_tokens: int, sampling: SamplingParams, rng: np.random.Generator
    ) -> Iterator[int]:
        """Emitted tokens, round after round; the consumer records each in seq.tokens before asking for the next."""
        context = list(seq.prompt_ids) + list(seq.tokens)
        try:
            while True:
                yield from self._round(
                    seq, self.drafter.max_drafts(max_new_tokens - len(seq.tokens)), sampling, rng, context
                )
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
                "timed_plain_ms": round(self.plain_s * 1e3, 3) if self.plain_s is not None else None,
                "timed_draft_ms_per_token": (
                    round(self.draft_round_s / self.mean_emitted * 1e3, 3)
                    if self.draft_round_s is not None and self.mean_emitted
                    else None
                ),
            }

    # ---- one round -------------------------------------------------------------------
    def _round(
        self, seq: Any, k: int, sampling: SamplingParams, rng: np.random.Generator, context: list[int]
    ) -> Iterator[int]:
        arena, start = seq.arena, seq.arena.length
        round_started = started = time.perf_counter()
        # k = 0: the budget leaves only the bonus row; a gated-out round is a plain T=1 step
        drafting = k >= 1 and not (self.gated and not self._worth_drafting())
        if drafting:
            self.shadow, self.shadow_hits = [], 0
            drafts, draft_logits = self.drafter.propose(seq.pending, context, k, start, arena, sampling, rng)
        else:
            drafts, draft_logits = [], None
            if self.shadowing and not self.shadow and k >= 1:
                self.shadow = self.drafter.propose(seq.pending, context, k, start, arena, sampling, rng)[0]
        self.draft_s += time.perf_counter() - started
        started = time.perf_counter()
        verify = self.drafter.verify(seq.pending, drafts, start, arena).logits[0]
        self.verify_s += time.perf_counter() - started
        self.rounds += 1
        self.drafted += len(drafts)
        accepted, correction = self._accept(drafts, draft_logits, verify, sampling, rng)
        self.accepted += accepted
        emitted = drafts[:accepted] + ([correction] if correction is not None else [])
        if self.gated:
            # a round whose verify pass ran T=1 (no drafts, no PPD prompt tokens) was a plain step
            self._time_round(verify.shape[0] > 1, len(emitted), time.perf_counter() - round_started)
            if self.shadow and not drafts:
                self._score_shadow(emitted[0])
        # inputs pending, d1..d(accepted) now have valid KV in every kept layer
        arena.length = start + (accepted + 1 if correction is not None else accepted)
        for token in emitted:
            seq.pending = token
            context.append(token)
            yield token

    def _time_round(self, drafting: bool, emitted: int, seconds: float) -> None:
        """Update the gate's running means with this round (a kind's first round is not timed).
        `drafting`: its pass was wider than a plain step (drafts, or PPD's prompt tokens after a
        rejection); a lookup round without an n-gram match was a plain step and times one."""
        if drafting:
            self.mean_emitted = _ema(self.mean_emitted, emitted)
        if drafting not in self.warm:
            self.warm.add(drafting)
            return
        if drafting:
            self.draft_round_s = _ema(self.draft_round_s, seconds)
        else:
            self.plain_s = _ema(self.plain_s, seconds)

    def _score_shadow(self, token: int) -> None:
        """A plain round emitted `token`: score the pending free proposal as the drafting round
        at its position would have fared (accepted drafts + the verifier's own token)."""
        if token == self.shadow[self.shadow_hits]:
            self.shadow_hits += 1
            # still matching: wait for the rest, unless the hits so far already pay for a round
            if self.shadow_hits < len(self.shadow) and not self._would_pay(self.shadow_hits + 1):
                return
        self.mean_emitted = _ema(self.mean_emitted, self.shadow_hits + 1)
        self.shadow, self.shadow_hits = [], 0

    def _would_pay(self, emitted: float) -> bool:
        """Whether drafting rounds emitting `emitted` tokens each beat plain steps: a drafting round's
        seconds per token against a plain step's seconds, timed on this run once they can be, else
        the build's costs."""
        if self.plain_s is None:
            return emitted >= self.round_passes
        round_s = self.draft_round_s if self.draft_round_s is not None else self.plain_s * self.round_passes
        return round_s / emitted < self.plain_s

    def _pays(self) -> bool:
        if self.mean_emitted is None:
            return not self.shadowing  # unknown: draft to find out, unless plain rounds can score proposals
        return self._would_pay(self.mean_emitted)

    def _worth_drafting(self) -> bool:
        """Gated drafting: draft while it pays (re-timing plain steps now and then), else plain steps
        with a probe draft now and then (for free proposals only while they get accepted at all)."""
        if self._pays():
            self.since_plain += 1
            # time plain decoding once early (a first round and a timed one), then every PLAIN_EVERY rounds
            untimed = self.plain_s is None and self.since_plain > 2
            if untimed or self.since_plain > PLAIN_EVERY:
                self.since_plain = 0
                self.skipped += 1
                return False
            return True
        self.since_probe += 1
        hopeless = self.shadowing and (self.mean_emitted or 0.0) < PROBE_MIN_EMITTED
        if self.since_probe >= PROBE_EVERY and not hopeless:
            self.since_probe = 0
            return True
        self.skipped += 1
        return False

    @staticmethod
    def _accept(
        drafts: list[int],
        draft_logits: list[np.ndarray] | None,
        verify: np.ndarray,
        sampling: SamplingParams,
        rng: np.random.Generator,
    ) -> tuple[int, int | None]:
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


def _ema(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - EMA_WEIGHT) * mean + EMA_WEIGHT * value
