"""ONNX Runtime backend: one session per graph, all sharing one in-memory copy of the weights.

Weights: the bundle's weights file is read once; every session receives the same numpy
memory through `SessionOptions.add_initializer`, which ORT uses in place. (Measured on
SmolLM2: 3 sessions cost +47 MB this way; `add_external_initializers` copied, +530 MB
per session.) ORT's prepacking would give each session its own packed copy (+536 MB per
session for ~10% faster decode), so it is off by default and opt-in per engine.

KV: IO binding feeds the arena's prefix views as inputs and binds the new-row outputs
straight onto the arena rows, so every row is written once, in place.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from runtimes.backends.base import Backend, StepOutputs
from runtimes.bundle import Bundle
from runtimes.errors import UsageError
from runtimes.graph_policy import checked_engine_bytes
from runtimes.kv_arena import KVArena
from runtimes.limits import check_threads

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def _import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise UsageError("the onnx backend needs onnxruntime, which is not installed", "run `pip install onnxruntime`") from exc
    return onnxruntime


class OnnxRuntimeBackend(Backend):
    name = "onnx"

    def __init__(self, bundle: Bundle, threads: int = 0, provider: str = "cpu", prepack: Iterable[str] = (),
                 profile_prefix: str | None = None) -> None:
        super().__init__(bundle)
        self.ort = _import_ort()
        if provider not in PROVIDERS:
            raise UsageError(f"provider {provider!r} is unknown", f"choose one of: {', '.join(PROVIDERS)}")
        available = self.ort.get_available_providers()
        if PROVIDERS[provider] not in available:
            raise UsageError(f"ONNX Runtime provider {provider!r} is not available here (have: {', '.join(available)})",
                             "install onnxruntime-gpu (`pip install adaptive-export[gpu]`) on a machine with a GPU, or use --provider cpu")
        self.provider = PROVIDERS[provider]
        self.threads = check_threads(threads)
        self.prepack = set(prepack)
        self.profile_prefix = profile_prefix  # ORT's per-node profiler, for benchmarks/profile_decode.py
        self.weights = np.fromfile(bundle.path(self.entry["weights"]), dtype=np.uint8)
        self._values: dict[str, Any] = {}
        self._sessions: dict[str, Any] = {}
        self._bindings: dict[str, Any] = {}
        self._out_buffers: dict[tuple[str, str, tuple[int, ...]], np.ndarray] = {}

    def _tensor(self, name: str) -> Any:
        value = self._values.get(name)
        if value is None:
            meta = self.entry["tensors"][name]
            start, size = int(meta["offset"]), int(meta["bytes"])
            if start < 0 or start + size > self.weights.size:
                raise UsageError(f"weight {name!r} lies outside the weights file", "the bundle is corrupt: rebuild it")
            array = self.weights[start : start + size].view(np.dtype(meta["dtype"])).reshape(meta["shape"])
            value = self._values[name] = self.ort.OrtValue.ortvalue_from_numpy(array)
        return value

    def session(self, graph: str) -> Any:
        session = self._sessions.get(graph)
        if session is None:
            engine = self.entry["graphs"].get(graph)
            if engine is None:
                raise UsageError(f"the onnx backend has no engine for graph {graph!r}", "rebuild the bundle")
            options = self.ort.SessionOptions()
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
            options.graph_optimization_level = self.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.log_severity_level = 4  # fatal only: a failing engine is reported once, as the UsageError
            if self.profile_prefix:
                options.enable_profiling = True
                options.profile_file_prefix = f"{self.profile_prefix}_{graph}"
            if graph not in self.prepack and self.entry.get("quantize", "none") == "none":
                options.add_session_config_entry("session.disable_prepacking", "1")
            for name in engine["initializers"]:
                options.add_initializer(name, self._tensor(name))
            model_bytes = checked_engine_bytes(self.bundle, graph)  # policy-checked; ORT gets bytes, never a path
            # every external initializer is supplied above; ORT still validates their location against this folder
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(self.bundle.path(engine["file"]).parent))
            try:
                session = self.ort.InferenceSession(model_bytes, options, providers=[self.provider])
            except Exception as exc:  # ORT raises its own exception types for invalid models
                raise UsageError(f"ONNX Runtime cannot load engine {engine['file']!r}: {str(exc).splitlines()[0]}", "rebuild the bundle") from exc
            self._sessions[graph] = session
            self._bindings[graph] = session.io_binding()
        return session

    def prepare(self, graph: str) -> None:
        self.session(graph)

    def run_named(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self.session(graph)
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds)))

    def _buffer(self, graph: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = (graph, name, shape)
        buffer = self._out_buffers.get(key)
        if buffer is None:
            buffer = self._out_buffers[key] = np.empty(shape, dtype=np.float32)
        return buffer

    def run(self, graph: str, first: np.ndarray, arena: KVArena, start: int) -> StepOutputs:
        session = self.session(graph)
        binding = self._bindings[graph]
        info = self.bundle.graph(graph)
        model = self.bundle.model
        count = first.shape[1]
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(info["inputs"][0], np.ascontiguousarray(first))
        for layer in info["layers"]:
            for kv, kind in ((0, "key"), (1, "value")):
                binding.bind_cpu_input(f"past_{kind}_{layer}", arena.prefix(layer, kv, start))
                rows = arena.rows(layer, kv, start, count)
                binding.bind_output(f"new_{kind}_{layer}", "cpu", 0, np.float32, rows.shape, rows.ctypes.data)
        logits = self._buffer(graph, "logits", (1, 1 if info["logits"] == "last" else count, model["vocab_size"]))
        binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        scores = hidden = None
        if info["router_scores"]:
            scores = self._buffer(graph, "router_scores", (len(info["layers"]),))
            binding.bind_output("router_scores", "cpu", 0, np.float32, scores.shape, scores.ctypes.data)
        if info["exit_hidden"]:
            hidden = self._buffer(graph, "exit_hidden", (1, count, model["hidden_size"]))
            binding.bind_output("exit_hidden", "cpu", 0, np.float32, hidden.shape, hidden.ctypes.data)
        session.run_with_iobinding(binding)
        return StepOutputs(logits, scores, hidden)
