"""TensorRT backend over `tensorrt` + `cuda-python` (no torch), with the KV arena on the GPU.

API use follows the TensorRT 10 Python API docs: Builder / OnnxParser (parse_from_file
resolves external weights beside the file), IBuilderConfig with FP16/INT8 and STRIP_PLAN
flags, one optimization profile with min/opt/max shapes per dynamic input, Refitter +
OnnxParserRefitter to put the weights back into a stripped engine, IExecutionContext
set_input_shape / set_tensor_address / execute_async_v3. Not executed in this project's CI
(TensorRT cannot be installed there); tests skip with the reason.

KV: a device copy of the arena [layers, 2, max_len, kv, hd]; engines read prefix pointers
and write their new rows in place on the device; the new rows (a few KB per token) are
also copied back into the host arena so speculation, `check` and the host-side
bookkeeping see the same cache. Rows the device lacks (e.g. a host arena filled by
`check`) are uploaded once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.runtimes.backends.base import Backend, StepOutputs
from adaptive_export.runtimes.bundle import Bundle, logits_width
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.graph_policy import checked_engine_bytes
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import Manifest
from adaptive_export.runtimes.user_cache import user_cache_dir

OPT_DRAFT_TOKENS = 4


def _imports() -> tuple[Any, Any]:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise UsageError(
            "the tensorrt backend needs TensorRT, which is not installed",
            "install TensorRT 10 and run `pip install adaptive-export[tensorrt]`, or use --backend onnx",
        ) from exc
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as exc:
            raise UsageError("the tensorrt backend needs cuda-python", "run `pip install cuda-python`") from exc
    return trt, cudart


def _check(result: Any) -> Any:
    """cuda-python returns (error, value...): raise on error, return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed with error {err}")
    return values[0] if len(values) == 1 else values


def engine_cache_dir() -> Path:
    trt, cudart = _imports()
    props = _check(cudart.cudaGetDeviceProperties(0))
    gpu = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    key = f"{gpu.replace(' ', '_')}-sm{props.major}{props.minor}-trt{trt.__version__}"
    root = user_cache_dir() / "tensorrt" / key
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_engine(onnx_path: Path, plan_path: Path, manifest: Manifest, precision: str) -> Path:
    """Build a weight-stripped engine with a profile over T (1, k, max_len) and P (0..max_len)."""
    trt, _ = _imports()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UsageError(f"TensorRT cannot parse {onnx_path.name}: {errors}", "report it; use --backend onnx meanwhile")
    config = builder.create_builder_config()
    if precision in ("fp16", "int8"):
        config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    config.set_flag(trt.BuilderFlag.STRIP_PLAN)
    config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
    max_len = manifest.max_len
    model = manifest.model
    profile = builder.create_optimization_profile()
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        if tensor.name == "input_ids":
            profile.set_shape(tensor.name, (1, 1), (1, OPT_DRAFT_TOKENS), (1, max_len))
        elif tensor.name == "exit_hidden":
            hidden = model.hidden_size
            profile.set_shape(tensor.name, (1, 1, hidden), (1, OPT_DRAFT_TOKENS, hidden), (1, max_len, hidden))
        else:
            kv = (model.num_kv_heads, model.head_dim)
            profile.set_shape(tensor.name, (0, *kv), (max_len // 2, *kv), (max_len, *kv))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UsageError(
            f"TensorRT could not build an engine for {onnx_path.name}",
            "see the TensorRT log above; use --backend onnx meanwhile",
        )
    plan_path.write_bytes(bytes(plan))
    return plan_path


def plan_name(onnx_path: Path, graph: str) -> str:
    """Cache file name of an engine: content-addressed, never built from manifest strings."""
    from adaptive_export.runtimes.bundle import sha256_of

    return f"{sha256_of(onnx_path)[:24]}-{hashlib.sha256(graph.encode('utf-8', 'replace')).hexdigest()[:8]}.plan"


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, bundle: Bundle, threads: int = 0, **_: Any) -> None:
        super().__init__(bundle)
        self.trt, self.cudart = _imports()
        self.logger = self.trt.Logger(self.trt.Logger.WARNING)
        self.runtime = self.trt.Runtime(self.logger)
        self.stream = _check(self.cudart.cudaStreamCreate())
        self.cache = engine_cache_dir()
        self._engines: dict[str, tuple[Any, Any]] = {}
        self._device_arena = 0
        self._device_rows = 0  # rows [0:n] of the device arena mirror the host arena
        self._host_arena_id = 0
        self._buffers: dict[tuple[str, int], int] = {}

    def _engine(self, graph: str) -> tuple[Any, Any]:
        if graph not in self._engines:
            onnx_path = self.bundle.path(self.entry.engine(graph).onnx or "")
            checked_engine_bytes(
                self.bundle, graph
            )  # the same graph policy as ONNX Runtime, before TensorRT parses the file
            plan = self.cache / plan_name(onnx_path, graph)
            if not plan.exists():
                build_engine(onnx_path, plan, self.bundle.manifest, self.entry.precision or "fp16")
            engine = self.runtime.deserialize_cuda_engine(plan.read_bytes())
            refitter = self.trt.Refitter(engine, self.logger)
            parser_refitter = self.trt.OnnxParserRefitter(refitter, self.logger)
            if not parser_refitter.refit_from_file(str(onnx_path)) or not refitter.refit_cuda_engine():
                raise UsageError(
                    f"refitting the TensorRT engine {graph!r} from the bundle's weights failed",
                    "delete the engine cache and run again",
                )
            self._engines[graph] = (engine, engine.create_execution_context())
        return self._engines[graph]

    def prepare(self, graph: str) -> None:
        self._engine(graph)

    def run_named(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise UsageError("the tensorrt backend runs through the KV arena only", "use Generator, not run_named")

    def _device(self, nbytes: int, key: tuple[str, int]) -> int:
        if key not in self._buffers:
            self._buffers[key] = _check(self.cudart.cudaMalloc(max(nbytes, 1)))
        return self._buffers[key]

    def _copy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        kinds = self.cudart.cudaMemcpyKind
        direction = kinds.cudaMemcpyHostToDevice if kind == "h2d" else kinds.cudaMemcpyDeviceToHost
        _check(self.cudart.cudaMemcpyAsync(dst, src, nbytes, direction, self.stream))

    def _sync_arena(self, arena: KVArena, start: int) -> int:
        if not self._device_arena:
            self._device_arena = _check(self.cudart.cudaMalloc(arena.data.nbytes))
        if id(arena) != self._host_arena_id or self._device_rows < start:
            layers, _, max_len = arena.data.shape[:3]
            row = arena.data[0, 0, 0].nbytes
            for layer in range(layers):
                for kv in range(2):
                    offset = ((layer * 2 + kv) * max_len) * row
                    self._copy(self._device_arena + offset, arena.data[layer, kv].ctypes.data, start * row, "h2d")
            self._host_arena_id = id(arena)
        self._device_rows = start
        return self._device_arena

    def run(self, graph: str, first: np.ndarray, arena: KVArena, start: int) -> StepOutputs:
        engine, context = self._engine(graph)
        info = self.bundle.graph(graph)
        count = first.shape[1]
        base = self._sync_arena(arena, start)
        max_len, row = arena.data.shape[2], arena.data[0, 0, 0].nbytes
        first = np.ascontiguousarray(first, dtype=np.int64 if info.source == "ids" else np.float32)
        first_ptr = self._device(first.nbytes, (info.inputs[0], first.nbytes))
        self._copy(first_ptr, first.ctypes.data, first.nbytes, "h2d")
        context.set_input_shape(info.inputs[0], first.shape)
        context.set_tensor_address(info.inputs[0], first_ptr)
        for layer in info.layers:
            for kv, kind in ((0, "key"), (1, "value")):
                offset = base + ((layer * 2 + kv) * max_len) * row
                context.set_input_shape(f"past_{kind}_{layer}", (start, *arena.data.shape[3:]))
                context.set_tensor_address(f"past_{kind}_{layer}", offset)
                context.set_tensor_address(f"new_{kind}_{layer}", offset + start * row)
        host: dict[str, np.ndarray] = {}
        model = self.bundle.model
        shapes = {
            "logits": (1, 1 if info.logits == "last" else count, logits_width(info, model)),
            "router_scores": (len(info.layers),),
            "exit_hidden": (1, count, model.hidden_size),
            "guesses": (1, 1 if info.logits == "last" else count),
        }
        for name in info.outputs:
            if name in shapes:
                host[name] = np.empty(shapes[name], dtype=np.int64 if name == "guesses" else np.float32)
                context.set_tensor_address(name, self._device(host[name].nbytes, (name, host[name].nbytes)))
        if not context.execute_async_v3(self.stream):
            raise RuntimeError(f"TensorRT execution of {graph!r} failed")
        for name, array in host.items():
            self._copy(array.ctypes.data, self._buffers[(name, array.nbytes)], array.nbytes, "d2h")
        for layer in info.layers:  # mirror the new rows into the host arena
            for kv in range(2):
                offset = base + ((layer * 2 + kv) * max_len + start) * row
                self._copy(arena.data[layer, kv, start].ctypes.data, offset, count * row, "d2h")
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        self._device_rows = start + count
        return StepOutputs(host["logits"], host.get("router_scores"), host.get("exit_hidden"), host.get("guesses"))
