"""PPD drafts (parallel prompt decoding, Hao et al. 2024), in chain form, on the decode engine.

The bundle's full decode graph embeds ids vocab..vocab+m-1 as m trained prompt tokens
(calibration/prompt_tokens.py). Every verify pass runs [pending, d1, .., dk, P1, .., Pm] at
T = 1+k+m: rows 0..k score the drafts and the bonus token exactly as prompt lookup's pass does;
row k+i (P_i) guesses the token i places after the bonus. When every draft is accepted those
guesses were made on exactly the emitted context, so they are the next round's drafts at no
extra engine call. After a rejection they were made on a rejected draft and are dropped: the
next round has no drafts and its pass (T = 1+m) makes fresh guesses. The prompt tokens' KV
rows land past the accepted length, so the arena crop discards them like a rejected draft's.
Drafts are deterministic (argmax guesses): sampling stays lossless with the rejection rule
for q = a point mass, as for prompt lookup."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from adaptive_export.runtimes.drafting.base import DraftSource
from adaptive_export.runtimes.sampling import SamplingParams

if TYPE_CHECKING:  # runtimes/manifest.py imports this package (SOURCE_NAMES)
    from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims


class PromptDecoding(DraftSource):
    name = "ppd"
    engines = ("ppd",)
    bonus = True
    gateable = True

    def __init__(self, backend: Any, config: ConfigEntry, model: ModelDims, k: int) -> None:
        super().__init__(backend, config, model, k)
        self.vocab = model.vocab_size
        self.prompt_tokens = backend.bundle.graph(config.engines["ppd"]).prompt_tokens
        self.guesses: list[int] = []
        self.guesses_at = -1  # the arena length at which the guesses are the next drafts
        self.armed = False  # this round drafts (the gate may make it a plain T=1 step)

    def propose(
        self,
        pending: int,
        context: list[int],
        k: int,
        start: int,
        arena: Any,
        sampling: SamplingParams,
        rng: np.random.Generator,
    ) -> tuple[list[int], None]:
        self.armed = True
        return (self.guesses[:k] if start == self.guesses_at else []), None

    def verify(self, pending: int, drafts: list[int], start: int, arena: Any) -> Any:
        count = 1 + len(drafts)
        prompts = min(self.prompt_tokens, arena.max_len - start - count) if self.armed else 0
        self.armed = False
        inputs = np.asarray([[pending, *drafts, *range(self.vocab, self.vocab + prompts)]], dtype=np.int64)
        out = self.backend.run(self.config.engines["ppd"], inputs, arena, start)
        logits = out.logits[0]
        self.guesses = [int(np.argmax(logits[count + i])) for i in range(prompts)]
        self.guesses_at = start + count  # valid iff the round emits every draft plus the bonus
        return out
