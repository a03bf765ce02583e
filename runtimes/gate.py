"""Gated drafting: draft only while drafting pays on this machine, now (docs/architecture.md section 5).

`--mode auto` runs the gateable sources (prompt lookup, precision, prompt tokens) through a
`DraftingGate`. The runner asks it one question before each round, `should_draft()`, and tells
it what each round cost and emitted (`record_round`); the gate keeps running means of the
tokens a drafting round emits, of a drafting round's seconds and of a plain round's seconds (a
T=1 step, one token), and drafts while a drafting round's seconds per token are below a plain
step's. Until both are timed it prices a drafting round with the build's measurement,
`round_passes` T=1 passes (k draft steps of `draft_cost` passes each, 0 for lookup, plus one
T=k+1 pass of `verify_cost` passes) against a plain round of `plain_passes` (1; a floor round's
T=2 pass on a bundle that decodes two rows at least, which may emit two tokens: the gate keeps the
tokens per plain round too). A build calibrated on a busy machine, or run on another, therefore
corrects itself within a few rounds.

A source whose proposals cost nothing (prompt lookup) is scored on plain rounds too
(`watch` / `record_plain_token`): its proposal is compared with the tokens plain decoding then
emits, which under greedy decoding are exactly the tokens verification would accept, so a
prompt whose drafts would not pay never pays for a drafting round to find out, and a rewrite
starts drafting as soon as its proposals would be accepted. Other sources probe with a draft
every PROBE_EVERY plain rounds, and drafting rounds re-time plain decoding every PLAIN_EVERY
rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 16  # plain rounds between probe drafts while drafting does not pay
PLAIN_EVERY = 16  # drafting rounds between plain rounds that re-time plain decoding
PROBE_MIN_EMITTED = 1.5  # free proposals: probe only while plain rounds score them at least this well
EMA_WEIGHT = 0.3  # weight of the newest round in the running means (tokens per round, round times)


def ema(mean: float | None, value: float) -> float:
    """The running mean after `value` (the value itself when there is none yet)."""
    return value if mean is None else (1 - EMA_WEIGHT) * mean + EMA_WEIGHT * value


@dataclass
class ShadowProposal:
    """A free proposal made on a plain round, scored against the tokens plain decoding emits."""

    tokens: list[int]
    hits: int = 0


class DraftingGate:
    """Decides round by round whether to draft, from this run's own round times.

    `round_passes`: a drafting round's cost in T=1 passes by the build's measurement, used until
    this run has timed both kinds of round. `scores_plain_rounds`: the source's proposals are
    free, so plain rounds score them (`watch`, `record_plain_token`)."""

    def __init__(self, round_passes: float, scores_plain_rounds: bool = False, plain_passes: float = 1.0) -> None:
        self.round_passes = round_passes
        self.plain_passes = plain_passes
        self.scores_plain_rounds = scores_plain_rounds
        self.mean_emitted: float | None = None  # tokens per drafting round
        self.plain_emitted: float | None = None  # tokens per plain round (1, or 1-2 for floor rounds)
        self.plain_s: float | None = None  # a plain round's seconds
        self.draft_round_s: float | None = None  # a drafting round's seconds
        self.warm: set[bool] = set()  # round kinds (drafting or not) seen once: a first round may create sessions
        self.since_probe = self.since_plain = 0
        self.skipped = 0  # rounds the gate made plain
        self.shadow: ShadowProposal | None = None

    # ---- the question ------------------------------------------------------------------
    def should_draft(self) -> bool:
        """Draft while it pays (re-timing plain steps now and then), else plain steps with a
        probe draft now and then (for free proposals only while they get accepted at all). A
        round that drafts replaces the proposal being scored."""
        drafting = self._decide()
        if drafting:
            self.shadow = None
        return drafting

    def _decide(self) -> bool:
        if self.pays():
            self.since_plain += 1
            # time plain decoding once early (a first round and a timed one), then every PLAIN_EVERY rounds
            untimed = self.plain_s is None and self.since_plain > 2
            if untimed or self.since_plain > PLAIN_EVERY:
                self.since_plain = 0
                self.skipped += 1
                return False
            return True
        self.since_probe += 1
        hopeless = self.scores_plain_rounds and (self.mean_emitted or 0.0) < PROBE_MIN_EMITTED
        if self.since_probe >= PROBE_EVERY and not hopeless:
            self.since_probe = 0
            return True
        self.skipped += 1
        return False

    def pays(self) -> bool:
        """Whether drafting rounds pay at the tokens they emit on average."""
        if self.mean_emitted is None:
            return not self.scores_plain_rounds  # unknown: draft to find out, unless plain rounds can score proposals
        return self.would_pay(self.mean_emitted)

    def would_pay(self, emitted: float) -> bool:
        """Whether drafting rounds emitting `emitted` tokens each beat plain steps: a drafting
        round's seconds per token against a plain step's seconds, timed on this run once they
        can be, else the build's costs."""
        plain_tokens = self.plain_emitted or 1.0
        if self.plain_s is None:
            return emitted / self.round_passes >= plain_tokens / self.plain_passes
        round_s = self.draft_round_s if self.draft_round_s is not None else self.plain_s * self.round_passes
        return round_s / emitted < self.plain_s / plain_tokens

    # ---- what the runner tells it ------------------------------------------------------
    def record_round(self, drafted: bool, emitted: int, seconds: float) -> None:
        """One round: `drafted` when its verify pass was wider than a plain step (drafts, or the prompt tokens
        prompt tokens), the tokens it emitted, its seconds. A kind's first round is not timed."""
        if drafted:
            self.mean_emitted = ema(self.mean_emitted, emitted)
        else:
            self.plain_emitted = ema(self.plain_emitted, emitted)
        if drafted not in self.warm:
            self.warm.add(drafted)
            return
        if drafted:
            self.draft_round_s = ema(self.draft_round_s, seconds)
        else:
            self.plain_s = ema(self.plain_s, seconds)

    def wants_shadow(self) -> bool:
        """Whether a plain round should make a free proposal for `watch`."""
        return self.scores_plain_rounds and self.shadow is None

    def watch(self, proposal: list[int]) -> None:
        """Score `proposal` (made at this plain round's position) against the next plain tokens."""
        self.shadow = ShadowProposal(list(proposal)) if proposal else None

    def record_plain_token(self, token: int) -> None:
        """A plain round emitted `token`: score the watched proposal as the drafting round at its
        position would have fared (accepted drafts + the verifier's own token)."""
        shadow = self.shadow
        if shadow is None:
            return
        if token == shadow.tokens[shadow.hits]:
            shadow.hits += 1
            # still matching: wait for the rest, unless the hits so far already pay for a round
            if shadow.hits < len(shadow.tokens) and not self.would_pay(shadow.hits + 1):
                return
        self.mean_emitted = ema(self.mean_emitted, shadow.hits + 1)
        self.shadow = None

    # ---- what it measured --------------------------------------------------------------
    def timed_plain_ms(self) -> float | None:
        """A plain round's milliseconds per token it emits."""
        return round(self.plain_s / (self.plain_emitted or 1.0) * 1e3, 3) if self.plain_s is not None else None

    def timed_draft_ms_per_token(self) -> float | None:
        if self.draft_round_s is None or not self.mean_emitted:
            return None
        return round(self.draft_round_s / self.mean_emitted * 1e3, 3)
