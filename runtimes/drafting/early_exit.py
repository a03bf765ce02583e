"""Early-exit drafts (LayerSkip): the draft engine runs the kept layers below E plus the exit
head, T=1 per token, writing those layers' KV rows and saving each exit hidden state (the
exit query cache); the verify engine runs the layers from E on over the saved hidden states,
writing the remaining rows of the same positions. Every row is written once. No bonus token
when all k drafts are accepted (it would cost one more draft call)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from adaptive_export.runtimes.drafting.base import DraftSource, Proposal, engine_drafts
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.sampling import Sampler

if TYPE_CHECKING:  # the backends import the bundle, which imports this registry
    from adaptive_export.runtimes.backends import Backend, StepOutputs
    from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims


class EarlyExit(DraftSource):
    name = "early_exit"
    engines = ("draft", "verify")

    def __init__(self, backend: Backend, config: ConfigEntry, model: ModelDims, k: int) -> None:
        super().__init__(backend, config, model, k)
        self.hidden = np.zeros((1, k, model.hidden_size), dtype=np.float32)

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        def keep_exit_hidden(j: int, out: StepOutputs) -> None:  # the exit query cache the verify pass starts from
            self.hidden[0, j] = out.exit_hidden[0, -1]

        return engine_drafts(
            self.backend, self.config.engines["draft"], pending, k, start, arena, sampler, keep_exit_hidden
        )

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return self.backend.run(self.config.engines["verify"], self.hidden[:, : len(proposal.tokens)], arena, start)


SOURCE = EarlyExit
