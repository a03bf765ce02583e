"""Prompt-lookup drafts: an n-gram continuation copied from the context; no engine of its own.
The decode engine verifies [pending, d1, .., dk] with T=k+1 over token ids and writes all
layers' rows; its last row gives the bonus token when every draft is accepted, so a round
always emits accepted + 1 tokens.

Besides the registered source, three run-time variants (`register_source`): `growing_lookup`
(drafts that follow their own acceptance), `sure_lookup` (only a long match's full k: the
free first link of a chain before an engine that drafts) and `floor_guess` (a two-row bundle's
one free guess, the floor of its chains)."""

from __future__ import annotations

from adaptive_export.runtimes.backends import Backend, StepOutputs
from adaptive_export.runtimes.drafting.base import DraftSource, Proposal, decode_engine_verify, register_source
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims
from adaptive_export.runtimes.sampling import Sampler

MAX_NGRAM = 3
# Growing lookup (`GrowingLookup`): at most this many drafts a round (a T=4 pass), more than one
# only after a round whose drafts were all accepted and from a match of SURE_NGRAM tokens or more,
# over n-grams of up to GROWING_MAX_NGRAM (benchmarks/lookup_ceiling.py measured the rule).
GROWING_MOST = 3
SURE_NGRAM = 3
GROWING_MAX_NGRAM = 4


def lookup_match(context: list[int], k: int, max_ngram: int = MAX_NGRAM) -> tuple[list[int], int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n-gram,
    for the longest n up to max_ngram that occurred before, and that n ([], 0: none occurred)."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + k], n
    return [], 0


def lookup_ngram(context: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the context's last n-gram (the longest
    n from max_ngram down to min_ngram that occurred before)."""
    follow, n = lookup_match(context, k, max_ngram)
    return follow if n >= min_ngram else []


class PromptLookup(DraftSource):
    name = "prompt_lookup"
    bonus = gateable = True
    free_proposals = True

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        return Proposal(lookup_ngram(context, k))

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return decode_engine_verify(self.backend, self.config, pending, proposal.tokens, start, arena)


@register_source
class GrowingLookup(PromptLookup):
    """Prompt lookup whose draft length follows its own acceptance, decided from the tokens alone
    (so a run is deterministic, as `--mode ar` is): one draft a round, a floor round's guess, until
    a round's drafts are all accepted; then twice as many, up to the `k` it was made with, but more
    than one only from a match of SURE_NGRAM tokens; back to one at the first rejection. On two-row
    bundles, where a one-draft round costs what a plain step does, it never drafts more than the
    last round earned (docs/prompt-lookup.md, "What prompt lookup can reach")."""

    name = "growing_lookup"
    gateable = False  # its length is its own gate, decided from the tokens

    def __init__(self, backend: Backend, config: ConfigEntry, model: ModelDims, k: int) -> None:
        super().__init__(backend, config, model, k)
        self.length = 1  # drafts the next round may propose
        self.last: tuple[list[int], int] = ([], 0)  # the last proposal and the context's length then

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        self._learn(context)
        proposal, n = lookup_match(context, min(k, self.length), GROWING_MAX_NGRAM)
        proposal = proposal if n >= SURE_NGRAM else proposal[:1]
        self.last = (proposal, len(context))
        return Proposal(proposal)

    def _learn(self, context: list[int]) -> None:
        """The last round's drafts were all accepted iff the context now continues with them."""
        proposal, at = self.last
        earned = bool(proposal) and context[at : at + len(proposal)] == proposal
        self.length = min(self.k, self.length * 2) if earned else 1


@register_source
class SureLookup(PromptLookup):
    """Only the k tokens after a match of SURE_NGRAM tokens or more, over n-grams of up to
    GROWING_MAX_NGRAM: a copy that free is worth a round before a source whose drafts cost engine
    steps (the 1.5B's edit prompts beside a draft bundle: 39.8 against 53.3 ms a token without it)."""

    name = "sure_lookup"
    gateable = False

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        copied, n = lookup_match(context, k, GROWING_MAX_NGRAM)
        return Proposal(copied if n >= SURE_NGRAM and len(copied) == k else [])


@register_source
class FloorGuess(PromptLookup):
    """A floor round's one guess: prompt lookup's next token, else the last pass's in-graph guess
    (a bundle with an EAGLE head: runtimes/drafting/eagle.py), else `pending` again (a repeat is as
    good a guess as any); verified by the decode engine over [pending, guess]."""

    name = "floor_guess"
    gateable = False
    floor = True

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        guess = self.guess_for(start)
        return Proposal(lookup_ngram(context, 1) or [pending if guess is None else guess])


SOURCE = PromptLookup
