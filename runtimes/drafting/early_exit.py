"""Early-exit drafts (LayerSkip): the draft engine runs the kept layers below E plus the exit
head, T=1 per token, writing those layers' KV rows and saving each exit hidden state (the
exit query cache); the verify engine runs the layers from E on over the saved hidden states,
writing the remaining rows of the same positions. Every row is written once. No bonus token
when all k drafts are accepted (it would cost one more draft call).

A trained draft head (`build --draft-head`) scores only the bundle's draft_vocab ids (row j is
id ids[j], as a precision draft's) and may set `speculation.draft_stop_below`: a round stops
drafting after a draft whose own top-1 probability is below it (Kangaroo's double early exit;
calibration/draft_length.py measures it)."""

from __future__ import annotations

import numpy as np

from adaptive_export.runtimes.backends import Backend, StepOutputs
from adaptive_export.runtimes.draft_contracts import EarlyExitContract
from adaptive_export.runtimes.drafting.base import DraftSource, Proposal, engine_drafts
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims
from adaptive_export.runtimes.sampling import Sampler


class EarlyExit(EarlyExitContract, DraftSource):
    name = "early_exit"
    engines = ("draft", "verify")
    decode_engine_rows = False  # the draft engine writes layers below E, one row per pass

    def __init__(self, backend: Backend, config: ConfigEntry, model: ModelDims, k: int) -> None:
        super().__init__(backend, config, model, k)
        self.hidden = np.zeros((1, k, model.hidden_size), dtype=np.float32)
        speculation = backend.bundle.manifest.speculation
        self.stop_below = stop_threshold(speculation.extra.get("draft_stop_below") if speculation else None)

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        def keep_exit_hidden(j: int, out: StepOutputs) -> None:  # the exit query cache the verify pass starts from
            self.hidden[0, j] = out.exit_hidden[0, -1]

        graph = self.config.engines["draft"]
        return engine_drafts(
            self.backend, graph, pending, k, start, arena, sampler, keep_exit_hidden, stop_below=self.stop_below
        )

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return self.backend.run(self.config.engines["verify"], self.hidden[:, : len(proposal.tokens)], arena, start)


def stop_threshold(value: object) -> float:
    """The manifest's `speculation.draft_stop_below`: absent (0, fixed length) or a number in [0, 1)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise UsageError(
            "speculation.draft_stop_below must be a number in [0, 1)", "rebuild the bundle with --draft-head train"
        )
    return float(value)


SOURCE = EarlyExit
