"""Backend registry: a backend is chosen by name; its module is imported only when chosen."""
from __future__ import annotations

import importlib
from typing import Any

from runtimes.backends.base import Backend, StepOutputs
from runtimes.bundle import Bundle
from runtimes.errors import UsageError

_REGISTRY = {
    "onnx": ("runtimes.backends.onnxruntime_backend", "OnnxRuntimeBackend"),
    "coreml": ("runtimes.backends.coreml_backend", "CoreMLBackend"),
    "tensorrt": ("runtimes.backends.tensorrt_backend", "TensorRTBackend"),
}
BACKEND_NAMES = tuple(_REGISTRY)


def make_backend(bundle: Bundle, name: str = "onnx", **options: Any) -> Backend:
    if name not in _REGISTRY:
        raise UsageError(f"backend {name!r} is unknown", f"choose one of: {', '.join(_REGISTRY)}")
    bundle.backend_entry(name)  # a clear error if the bundle lacks it
    module_name, class_name = _REGISTRY[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"backend {name!r} is not installed in this environment ({exc.name} is missing)",
                         f"run `pip install adaptive-export[{'gpu' if name == 'onnx' else name}]` or choose --backend onnx") from exc
    try:
        backend = getattr(module, class_name)(bundle, **options)
    except UsageError:
        raise
    except TypeError as exc:  # an option this backend does not take
        raise UsageError(f"backend {name!r} does not accept these options ({exc})", "check the options passed to it") from None
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
            raise UsageError(f"engine {graph!r} failed: {type(exc).__name__}: {text}",
                             "the bundle's engines do not match its manifest: rebuild it with `adaptive-export build`") from None
        info = bundle.graph(graph)
        rows = 1 if info["logits"] == "last" else first.shape[1]
        expected = (1, rows, bundle.model["vocab_size"])
        if getattr(out.logits, "shape", None) != expected:
            raise UsageError(f"engine {graph!r} returned logits of shape {getattr(out.logits, 'shape', None)}, the manifest implies {expected}",
                             "the bundle's engines do not match its manifest: rebuild it with `adaptive-export build`")
        return out

    return checked


__all__ = ["Backend", "StepOutputs", "make_backend", "BACKEND_NAMES"]
