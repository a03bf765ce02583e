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
    return getattr(module, class_name)(bundle, **options)


__all__ = ["Backend", "StepOutputs", "make_backend", "BACKEND_NAMES"]
