"""The draft-source protocol of self-speculative decoding (docs/architecture.md section 7).

A draft source proposes up to k tokens after `pending` and runs the verify pass that scores
them; the speculative loop (runtimes/speculative.py) owns everything else: acceptance
(greedy or the rejection rule), the arena crop, stats and gating. Calibration measures the
same sources under the same names (calibration/draft_sources.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from runtimes.sampling import SamplingParams


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

    def __init__(self, backend: Any, config: dict[str, Any], model: dict[str, Any], k: int) -> None:
        self.backend, self.config, self.k = backend, config, k

    @classmethod
    def available(cls, config: dict[str, Any]) -> bool:
        """Whether this configuration has the engines the source needs."""
        engines = config.get("engines", {})
        return all(name in engines for name in cls.engines)

    def max_drafts(self, budget: int) -> int:
        """Drafts for a round that may emit at most `budget` more tokens."""
        return min(self.k, budget - 1 if self.bonus else budget)

    @abstractmethod
    def propose(self, pending: int, context: list[int], k: int, start: int, arena: Any, sampling: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        """(up to k draft tokens after `pending`, the draft distribution's logits per draft or
        None when drafts are deterministic, e.g. copied from the context)."""

    @abstractmethod
    def verify(self, pending: int, drafts: list[int], start: int, arena: Any) -> Any:
        """One verifier pass at arena position `start`; its logits row j scores drafts[j]."""
