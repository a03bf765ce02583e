"""Backend registry, runtime side: one entry per backend (name, runtime class, pip extra).

A backend is chosen by name; its module is imported only when chosen. This table is the one
list of backend names: the exporter's compilers (exporter/backends.py) are keyed by the same
names and checked against it, and the command line reads its choices from it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptive_export.runtimes.backends.base import Backend, StepOutputs
from adaptive_export.runtimes.bundle import Bundle, logits_width
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena


@dataclass(frozen=True)
class BackendInfo:
    """One backend as the runtime knows it."""

    name: str
    module: str  # imported only when the backend is chosen
    class_name: str  # a runtimes.backends.base.Backend subclass in `module`
    extra: str  # the pip extra that installs what it needs (`pip install adaptive-export[extra]`)
    runs_on: str  # for help texts
    takes_provider: bool = False  # runs its engines on an execution provider that `--provider` names

    def load(self) -> type[Backend]:
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            raise UsageError(
                f"backend {self.name!r} is not installed in this environment ({exc.name} is missing)",
                f"run `pip install adaptive-export[{self.extra}]` or choose --backend onnx",
            ) from exc
        return getattr(module, self.class_name)


BACKENDS: dict[str, BackendInfo] = {
    info.name: info
    for info in (
        BackendInfo(
            "onnx",
            "adaptive_export.runtimes.backends.onnxruntime_backend",
            "OnnxRuntimeBackend",
            "gpu",
            "CPU everywhere; CUDA/TensorRT providers",
            takes_provider=True,
        ),
        BackendInfo("coreml", "adaptive_export.runtimes.backends.coreml_backend", "CoreMLBackend", "coreml", "macOS"),
        BackendInfo(
            "tensorrt", "adaptive_export.runtimes.backends.tensorrt_backend", "TensorRTBackend", "tensorrt", "NVIDIA"
        ),
    )
}
BACKEND_NAMES = tuple(BACKENDS)
# ONNX Runtime's execution providers by `--provider` name (`run`, `bench`, `check`), named without importing it
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def make_backend(bundle: Bundle, name: str = "onnx", **options: Any) -> Backend:
    """The named backend on `bundle`, wrapped so that a failing engine is a bad-bundle error."""
    if name not in BACKENDS:
        raise UsageError(f"backend {name!r} is unknown", f"choose one of: {', '.join(BACKENDS)}")
    bundle.backend_entry(name)  # a clear error if the bundle lacks it
    backend_class = BACKENDS[name].load()
    try:
        backend = backend_class(bundle, **options)
    except UsageError:
        raise
    except TypeError as exc:  # an option this backend does not take
        raise UsageError(
            f"backend {name!r} does not accept these options ({exc})", "check the options passed to it"
        ) from None
    return CheckedBackend(backend)


class CheckedBackend(Backend):
    """A backend whose engine failures are bad-bundle errors (exit 2, one line): an engine that
    fails on inputs the runtime built from the manifest, or returns logits of other shapes than
    the manifest implies. Wraps the chosen backend once, at construction (`make_backend`), so the
    backend classes stay plain; anything backend-specific (ONNX Runtime's `prepack`, its
    sessions) reads through to the wrapped backend."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.bundle, self.entry = inner.bundle, inner.entry
        self.name, self.executes, self.kv_layout, self.skip_reason = (
            inner.name,
            inner.executes,
            inner.kv_layout,
            inner.skip_reason,
        )
        self.rows_alike, self.parallel_sessions = inner.rows_alike, inner.parallel_sessions

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "inner":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(attribute)
        return getattr(self.inner, attribute)

    def prepare(self, graph: str) -> None:
        self.inner.prepare(graph)

    def alternate(self) -> None:
        self.inner.alternate()

    def with_threads(self, threads: int) -> CheckedBackend:
        """The wrapped backend's `with_threads` variant, checked alike (ONNX Runtime only)."""
        return CheckedBackend(self.inner.with_threads(threads))

    def run_named(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.inner.run_named(graph, feeds)

    def run(self, graph: str, first: np.ndarray, arena: KVArena, start: int) -> StepOutputs:
        try:
            out = self.inner.run(graph, first, arena, start)
        except UsageError:
            raise
        except Exception as exc:  # ORT, CoreML and numpy raise their own types for mismatched engines
            text = (str(exc).splitlines() or [""])[0][:300]
            raise UsageError(
                f"engine {graph!r} failed: {type(exc).__name__}: {text}",
                "the bundle's engines do not match its manifest: rebuild it with `adaptive-export build`",
            ) from None
        bundle = self.bundle
        info = bundle.graph(graph)
        rows = 1 if info.logits == "last" else first.shape[1]
        expected = (1, rows, logits_width(info, bundle.model))
        if getattr(out.logits, "shape", None) != expected:
            raise UsageError(
                f"engine {graph!r} returned logits of shape {getattr(out.logits, 'shape', None)},"
                f" the manifest implies {expected}",
                "the bundle's engines do not match its manifest: rebuild it with `adaptive-export build`",
            )
        return out


__all__ = ["Backend", "StepOutputs", "BackendInfo", "BACKENDS", "BACKEND_NAMES", "CheckedBackend", "make_backend"]
