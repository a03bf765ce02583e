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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptive_export.runtimes.drafting.base import DraftSource, Proposal, TableArtifact
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest_fields import is_int, need
from adaptive_export.runtimes.sampling import Sampler

if TYPE_CHECKING:  # the backends import the bundle, which imports this registry
    from adaptive_export.runtimes.backends import Backend, StepOutputs
    from adaptive_export.runtimes.manifest import ConfigEntry, GraphEntry, ModelDims

MAX_PROMPT_TOKENS = 16  # prompt tokens a decode graph may embed
FIELD = ROLE = "prompt_tokens"  # the decode graph's field (how many it embeds) and the configuration's engine role
BUILD_FIX = "train prompt tokens for this model with --prompt-tokens N"


class PromptTokens(DraftSource):
    name = "prompt_tokens"
    engines = (ROLE,)
    bonus = gateable = True
    engine_kinds = {ROLE: "decode"}
    graph_fields = (FIELD,)
    table = TableArtifact("prompt_tokens.safetensors", "prompt_tokens", MAX_PROMPT_TOKENS, "prompt tokens", BUILD_FIX)

    @classmethod
    def check_graph_field(cls, graph: str, kind: str, key: str, value: Any) -> None:
        need(
            is_int(value) and 0 <= value <= MAX_PROMPT_TOKENS and (kind == "decode" or not value),
            f"graph {graph!r} has a bad {FIELD} (a decode graph may embed 0..{MAX_PROMPT_TOKENS} prompt tokens)",
        )

    @classmethod
    def check_engines(cls, config: str, engines: Mapping[str, str], graphs: Mapping[str, GraphEntry]) -> None:
        """Its engine is the configuration's own decode graph, embedding prompt tokens."""
        if ROLE in engines:
            need(
                engines[ROLE] == engines["decode"] and graphs[engines[ROLE]].draft_field(FIELD) > 0,
                f"config {config!r} has a {ROLE} engine that is not its decode graph with prompt tokens",
            )

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
