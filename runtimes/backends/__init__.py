"""Backend registry, runtime side: one entry per backend (name, runtime class, pip extra).

A backend is chosen by name; its module is imported only when chosen. This table is the one
list of backend names: the exporter's compilers (exporter/backends.py) are keyed by the same
names and checked against it, and the command line reads its choices from it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from adaptive_export.runtimes.backends.base import Backend, StepOutputs
from adaptive_export.runtimes.bundle import Bundle, logits_width
from adaptive_export.runtimes.errors import UsageError


@dataclass(frozen=True)
class BackendInfo:
    """One backend as the runtime knows it."""

    name: str
    module: str  # imported only when the backend is chosen
    class_name: str  # a runtimes.backends.base.Backend subclass in `module`
    extra: str  # the pip extra that installs what it needs (`pip install adaptive-export[extra]`)
    runs_on: str  # for help texts

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
        ),
        BackendInfo("coreml", "adaptive_export.runtimes.backends.coreml_backend", "CoreMLBackend", "coreml", "macOS"),
        BackendInfo(
            "tensorrt", "adaptive_export.runtimes.backends.tensorrt_backend", "TensorRTBackend", "tensorrt", "NVIDIA"
        ),
    )
}
BACKEND_NAMES = tuple(BACKENDS)


def make_backend(bundle: Bundle, name: str = "onnx", **options: Any) -> Backend:
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
    backend.run = _engine_errors_are_usage_errors(bundle, backend.run)  # type: ignore[method-assign]
    return backend


def _engine_errors_are_usage_errors(bundle: Bundle, run: Any) -> Any:
    """An engine that fails on inputs the runtime built from the manifest, or returns outputs
    of other shapes than the manifest implies, is a bad bundle: exit 2, one line."""

    def checked(graph: str, first: Any, arena: Any, start: int) -> StepOutputs:
        try:
            out = run(graph, first, arena, start)
        except UsageError:
            raise
        except Exception as exc:  # ORT, CoreML and numpy raise their own types for mismatched engines
            text = (str(exc).splitlines() or [""])[0][:300]
            raise UsageError(
                f"engine {graph!r} failed: {type(exc).__name__}: {text}",
                "the bundle's engines do not match its manifest: rebuild it with `adaptive-export build`",
            ) from None
        info = bundle.graph(graph)
        rows = 1 if info.logits == "last" else first.shape[1]
        expected = (1, rows, logits_width(info, bundle.model))
        if getattr(out.logits, "shape", None) != expected:
            raise UsageError(
                f"engine {graph!r} returned logits of shape {getattr(out.logits, 'shape', None)}, the manifest implies {expected}",
                "the bundle's engines do not match its manifest: rebuild it with `adaptive-export build`",
            )
        return out

    return checked


__all__ = ["Backend", "StepOutputs", "BackendInfo", "BACKENDS", "BACKEND_NAMES", "make_backend"]
