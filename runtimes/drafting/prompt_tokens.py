"""Prompt-token drafts (parallel prompt decoding, Hao et al. 2024), in chain form, on the decode engine.

The bundle's full decode graph embeds ids vocab..vocab+m-1 as m trained prompt tokens
(calibration/drafts/prompt_tokens.py). Every verify pass runs [pending, d1, .., dk, P1, .., Pm] at
T = 1+k+m: rows 0..k score the drafts and the bonus token exactly as prompt lookup's pass does;
row k+i (P_i) guesses the token i places after the bonus. When every draft is accepted those
guesses were made on exactly the emitted context, so they are the next round's drafts at no
extra engine call. After a rejection they were made on a rejected draft and are dropped: the
next round has no drafts and its pass (T = 1+m) makes fresh guesses. The prompt tokens' KV
rows land past the accepted length, so the arena crop discards them like a rejected draft's.
Drafts are deterministic (argmax guesses): sampling stays lossless with the rejection rule
for q = a point mass, as for prompt lookup."""

from __future__ import annotations

import numpy as np

from adaptive_export.runtimes.backends import Backend, StepOutputs
from adaptive_export.runtimes.draft_contracts import (
    MAX_PROMPT_TOKENS,
    PROMPT_TOKENS_FIELD,
    PROMPT_TOKENS_ROLE,
    PromptTokensContract,
)
from adaptive_export.runtimes.drafting.base import DraftSource, Proposal
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims
from adaptive_export.runtimes.sampling import Sampler

# the decode graph's field (how many it embeds) and the configuration's engine role; its contract
# with the manifest (engine kind, field bounds, shipped table) is PromptTokensContract
FIELD, ROLE = PROMPT_TOKENS_FIELD, PROMPT_TOKENS_ROLE
__all__ = ["FIELD", "MAX_PROMPT_TOKENS", "ROLE", "PromptTokens"]


class PromptTokens(PromptTokensContract, DraftSource):
    name = "prompt_tokens"
    engines = (ROLE,)
    bonus = gateable = True

    def __init__(self, backend: Backend, config: ConfigEntry, model: ModelDims, k: int) -> None:
        super().__init__(backend, config, model, k)
        self.vocab = model.vocab_size
        self.prompt_tokens = backend.bundle.graph(config.engines[ROLE]).draft_field(FIELD)
        self.guesses: list[int] = []
        self.guesses_at = -1  # the arena length at which the guesses are the next drafts

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        """The last pass's guesses when they were made on exactly this context, and the prompt
        tokens that make this round's guesses (as many as the arena has room for). A round the
        gate makes plain verifies `PLAIN` instead: no prompt tokens."""
        drafts = self.guesses[:k] if start == self.guesses_at else []
        room = arena.max_len - start - (1 + len(drafts))
        return Proposal(drafts, None, extra_inputs=max(0, min(self.prompt_tokens, room)))

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        count, prompts = 1 + len(proposal.tokens), proposal.extra_inputs
        inputs = np.asarray([[pending, *proposal.tokens, *range(self.vocab, self.vocab + prompts)]], dtype=np.int64)
        out = self.backend.run(self.config.engines[ROLE], inputs, arena, start)
        logits = out.logits[0]
        self.guesses = [int(np.argmax(logits[count + i])) for i in range(prompts)]
        self.guesses_at = start + count  # valid iff the round emits every draft plus the bonus
        return out


SOURCE = PromptTokens
