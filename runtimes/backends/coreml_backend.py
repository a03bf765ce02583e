"""CoreML backend: one multifunction .mlpackage, one MLModel per function, run on macOS.

Prediction needs macOS (Core ML framework); elsewhere the backend loads nothing and says
so (`executes` False with `skip_reason`), so `check` can report the package as converted
but not executed. Inputs follow the arena contract (KV prefixes in, new rows out), so the
generation loop above is the same as on ONNX Runtime; the base class copies new rows
into the arena.
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptive_export.runtimes.backends.base import Backend
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.errors import UsageError

if TYPE_CHECKING:  # names the model type only; imported at run time by _model (macOS)
    import coremltools


class CoreMLBackend(Backend):
    name = "coreml"

    def __init__(self, bundle: Bundle, threads: int = 0, compute_units: str = "ALL", **_: Any) -> None:
        super().__init__(bundle)
        self.package = bundle.path(self.entry.package or "")
        self.executes = platform.system() == "Darwin"
        self.skip_reason = (
            ""
            if self.executes
            else f"CoreML prediction needs macOS (this is {platform.system()}); "
            "the package was converted and checked statically"
        )
        self.compute_units = compute_units
        self.dtype = np.float16 if self.entry.precision == "float16" else np.float32
        self._models: dict[str, coremltools.models.MLModel] = {}

    def _model(self, graph: str) -> Any:
        model = self._models.get(graph)
        if model is None:
            if not self.executes:
                raise UsageError(self.skip_reason, "run the coreml backend on macOS 15 or later, or use --backend onnx")
            try:
                import coremltools as ct
            except ImportError as exc:
                raise UsageError(
                    "the coreml backend needs coremltools", "run `pip install adaptive-export[coreml]`"
                ) from exc
            function = self.entry.engine(graph).extra["function"]
            model = ct.models.MLModel(
                str(self.package), function_name=function, compute_units=getattr(ct.ComputeUnit, self.compute_units)
            )
            self._models[graph] = model
        return model

    def prepare(self, graph: str) -> None:
        if self.executes:
            self._model(graph)

    def run_named(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = {
            name: (value.astype(np.int32) if name == "input_ids" else value.astype(self.dtype))
            for name, value in feeds.items()
        }
        outputs = self._model(graph).predict(inputs)
        return {name: np.asarray(value, dtype=np.float32) for name, value in outputs.items()}
