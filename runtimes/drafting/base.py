"""The draft-source protocol of self-speculative decoding (docs/architecture.md section 7).

A draft source proposes up to k tokens after `pending` and runs the verify pass that scores
them; the speculative loop (runtimes/speculative.py) owns everything else: acceptance
(greedy or the rejection rule), the arena crop, stats and gating. Calibration measures the
same sources under the same names (calibration/draft_sources.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from adaptive_export.runtimes.sampling import SamplingParams, probabilities

if TYPE_CHECKING:  # runtimes/manifest.py imports this package (SOURCE_NAMES)
    from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims


class DraftSource(ABC):
    """One way of drafting. Subclasses set the class attributes and implement propose/verify."""

    name: ClassVar[str]
    # the configuration's engines (manifest `configs[].engines` keys) it needs besides decode
    engines: ClassVar[tuple[str, ...]] = ()
    # the verify pass also scores the row after the last draft: a round whose drafts are all
    # accepted emits one more (bonus) token, so a round may emit k + 1 tokens
    bonus: ClassVar[bool] = False
    # a round may skip drafting cheaply (its verify pass then is a plain decode step), so
    # `--mode auto` can gate it to draft only while drafts pay
    gateable: ClassVar[bool] = False
    # proposing costs nothing (no engine runs), so a gated plain round can score a proposal
    # against the tokens plain decoding emits (runtimes/speculative.py)
    free_proposals: ClassVar[bool] = False

    def __init__(self, backend: Any, config: ConfigEntry, model: ModelDims, k: int) -> None:
        self.backend, self.config, self.k = backend, config, k

    @classmethod
    def available(cls, config: ConfigEntry) -> bool:
        """Whether this configuration has the engines the source needs."""
        return all(name in config.engines for name in cls.engines)

    def max_drafts(self, budget: int) -> int:
        """Drafts for a round that may emit at most `budget` more tokens."""
        return min(self.k, budget - 1 if self.bonus else budget)

    @abstractmethod
    def propose(
        self,
        pending: int,
        context: list[int],
        k: int,
        start: int,
        arena: Any,
        sampling: SamplingParams,
        rng: np.random.Generator,
    ) -> tuple[list[int], list[np.ndarray] | None]:
        """(up to k draft tokens after `pending`, the draft distribution's logits per draft or
        None when drafts are deterministic, e.g. copied from the context)."""

    @abstractmethod
    def verify(self, pending: int, drafts: list[int], start: int, arena: Any) -> Any:
        """One verifier pass at arena position `start`; its logits row j scores drafts[j]."""


def engine_drafts(
    backend: Any,
    graph: str,
    pending: int,
    k: int,
    start: int,
    arena: Any,
    sampling: SamplingParams,
    rng: np.random.Generator,
    on_step: Any = None,
) -> tuple[list[int], list[np.ndarray] | None]:
    """k T=1 steps of a draft engine over token ids from arena position `start`: the drafts
    (argmax, or sampled from the draft's own distribution) and, when sampling, each step's
    logits row for the rejection rule (greedy acceptance never reads them: no copy per step).
    `on_step(j, outputs)` sees every step's outputs (early exit keeps its exit hidden state)."""
    token = np.empty((1, 1), dtype=np.int64)
    token[0, 0] = pending
    ids = backend.bundle.draft_vocab_ids if backend.bundle.graph(graph).draft_vocab else None
    drafts: list[int] = []
    rows: list[np.ndarray] | None = None if sampling.greedy else []
    for j in range(k):
        out = backend.run(graph, token, arena, start + j)
        if on_step is not None:
            on_step(j, out)
        logits = out.logits[0, -1]
        if rows is None:
            best = int(np.argmax(logits))
            drafts.append(best if ids is None else int(ids[best]))
        else:
            # the backend reuses its output buffer next step, so keep a copy (over the whole vocabulary)
            row = logits.copy() if ids is None else full_vocabulary_row(logits, ids, backend.bundle.model.vocab_size)
            rows.append(row)
            drafts.append(int(rng.choice(row.size, p=probabilities(row, sampling))))
        token[0, 0] = drafts[-1]
    return drafts, rows


def full_vocabulary_row(logits: np.ndarray, ids: np.ndarray, vocab: int) -> np.ndarray:
    """A reduced draft head's logits spread over the vocabulary. Tokens outside it get a logit
    1e4 below the row's minimum: a finite value (the sampler refuses infinities) whose
    probability underflows to zero at any usual temperature. The draft samples from this same
    row, so the rejection rule stays exact whatever that remainder is."""
    row = np.full(vocab, float(logits.min()) - 1e4, dtype=np.float32)
    row[ids] = logits
    return row


def decode_engine_verify(
    backend: Any, config: ConfigEntry, pending: int, drafts: list[int], start: int, arena: Any
) -> Any:
    """The configuration's decode engine over [pending, d1, .., dk] at T=k+1, writing every kept
    layer's rows: its last row scores the position after the last draft (the bonus token)."""
    inputs = np.asarray([[pending, *drafts]], dtype=np.int64)
    return backend.run(config.decode, inputs, arena, start)
