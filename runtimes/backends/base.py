"""The backend interface: load engines, run one on named inputs, return named outputs.

The generation loop, the KV arena, configuration choice and speculation live once above
the backends (runtimes/generate.py). A backend only has to implement `run_named`; the
default `run` feeds arena prefix views and copies the new rows back. Backends that can
write outputs in place (ONNX Runtime IO binding) override `run` to skip that copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena


@dataclass
class StepOutputs:
    logits: np.ndarray  # [1, T or 1, V]
    router_scores: np.ndarray | None = None  # [L]
    exit_hidden: np.ndarray | None = None  # [1, T, H]
    guesses: np.ndarray | None = None  # [1, R] int64: per logits row, a draft source's guess after its choice


class Backend(ABC):
    name: str = "?"
    executes: bool = True  # False where the engines can be converted but not run (CoreML off macOS)
    kv_layout: str = "seq"  # the KVArena layout this backend's engines read and write (runtimes/kv_arena.py)
    skip_reason: str = ""  # why not, when executes is False
    # passes of two rows and more compute each row alike (so two-row steps and a wider verify agree)
    rows_alike: bool = False
    parallel_sessions: bool = False  # engines' sessions can be created and run beside a running one

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle
        self.entry = bundle.backend_entry(self.name)

    @abstractmethod
    def run_named(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one engine on named numpy inputs; return its named outputs."""

    def prepare(self, graph: str) -> None:  # noqa: B027 - a backend that loads engines lazily needs nothing here
        """Load the engine ahead of first use (e.g. at start-up), so timings exclude it."""

    def alternate(self) -> None:  # noqa: B027 - a backend without thread pools of its own needs nothing here
        """Another bundle's engines will run between this one's (a draft bundle, runtimes/draft_model.py):
        let its threads go idle after each run. Called before the first session is created."""

    def with_threads(self, threads: int) -> Backend:
        """A backend over the same engines whose sessions each use `threads` intra-op threads and
        may run one engine while this one runs another (pipelined decoding, runtimes/pipelined.py).
        Only a backend whose runs are safe side by side implements it (ONNX Runtime)."""
        raise UsageError(
            f"backend {self.name!r} cannot run two engines at once (pipelined decoding)",
            "use --backend onnx, or another --mode",
        )

    def run(self, graph: str, first: np.ndarray, arena: KVArena, start: int) -> StepOutputs:
        """Run `graph` on T new positions at [start:start+T], reading KV rows [0:start]."""
        info = self.bundle.graph(graph)
        layers = info.layers
        first_name = info.inputs[0]
        feeds = {first_name: first}
        for layer in layers:
            feeds[f"past_key_{layer}"] = arena.prefix(layer, 0, start)
            feeds[f"past_value_{layer}"] = arena.prefix(layer, 1, start)
        out = self.run_named(graph, feeds)
        count = first.shape[1]
        for layer in layers:
            arena.rows(layer, 0, start, count)[...] = out[f"new_key_{layer}"]
            arena.rows(layer, 1, start, count)[...] = out[f"new_value_{layer}"]
        return StepOutputs(out["logits"], out.get("router_scores"), out.get("exit_hidden"), out.get("guesses"))
