"""ONNX Runtime backend: one session per engine file, all sharing one in-memory copy of the weights.

Weights: the bundle's weights file is mapped once; every session receives the same memory
through `SessionOptions.add_initializer`, which ORT uses in place. (Measured on SmolLM2:
3 sessions cost +47 MB this way; `add_external_initializers` copied, +530 MB per session.)
A session that prepacks holds its own packed copy, so our pages of those weights are then
released (they come back from the file if ORT still reads them). Quantized engines always
prepack (MatMulNBits dequantizes per call otherwise); fp32 ones by `prepack` (default: the
fused full-model engine, see `_default_prepack`). The GGUF rows of a `--native-form packed`
bundle are read in place by the package's MatMulPacked/GatherPacked (no prepacked copy), so their
pages are kept; the op library is registered for an engine that imports its domain.

KV, portable engines: IO binding feeds the arena's prefix views as inputs and binds the
new-row outputs straight onto the arena rows, so every row is written once, in place.

KV, fused ("ort") engines: each layer's block is bound once as both the past input and the
present output of GroupQueryAttention, which writes the new rows in place; per step only
the token ids, the two length scalars (mutated in place) and, when T changes, the output
buffers are rebound. Engines that are the same ONNX file (the fused prefill and full-model
decode) share one session, so ONNX Runtime prepacks their weights once.

Threads: when a bundle has draft engines, or another bundle drafts for it (`alternate`), each
session's intra-op threads stop spinning as
soon as its run returns (`session.force_spinning_stop`). Otherwise the pool of the engine
that just ran keeps spinning while the next engine runs on the same cores: measured on
SmolLM2 (2 cores), alternating a GGUF-exact draft and verify session cost 13-14 ms per
draft step instead of 8-9 and 53 ms per verify pass instead of 28. (ORT's process-wide
pool fixes it too, but then every session of the process must use it: one thread count.)
"""

from __future__ import annotations

import contextlib
import copy
import mmap
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptive_export.runtimes.backends import PROVIDERS
from adaptive_export.runtimes.backends.base import Backend, StepOutputs
from adaptive_export.runtimes.backends.run_guard import RunGuard, create_session
from adaptive_export.runtimes.bundle import Bundle, logits_width
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.graph_policy import checked_engine
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.limits import check_threads
from adaptive_export.runtimes.manifest import GraphEntry, ModelDims
from adaptive_export.runtimes.packed_ops import require_library

if TYPE_CHECKING:  # names the session types only; imported at run time by _import_ort
    import onnxruntime


# Options each provider starts with. CUDA computes fp32 MatMuls in TF32 by default on Ampere and newer
# (10-bit mantissa): on the lent H100 that put fp32 engines 1.5x past check's tolerance against PyTorch.
# An fp32 bundle runs in fp32; a faster precision is a build's choice.
PROVIDER_OPTIONS: dict[str, dict[str, str]] = {PROVIDERS["cuda"]: {"use_tf32": "0"}}


def _import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise UsageError(
            "the onnx backend needs onnxruntime, which is not installed", "run `pip install onnxruntime`"
        ) from exc
    return onnxruntime


def _map_weights(path: Any) -> tuple[mmap.mmap | None, np.ndarray]:
    """The weights file as one read-only, file-backed mapping, shared by every session."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size == 0:
            return None, np.empty(0, dtype=np.uint8)
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ)  # read-only: nothing may write weights
    return mapping, np.frombuffer(mapping, dtype=np.uint8)


class FusedBinding:
    """The IO binding of one fused graph: KV blocks bound once per arena, inputs in place."""

    def __init__(self, session: Any, info: GraphEntry, model: ModelDims, guard: RunGuard, engine: str) -> None:
        self.session, self.guard, self.engine = session, guard, engine
        self.binding = session.io_binding()
        self.layers = list(info.layers)
        self.first_name = info.inputs[0]
        self.last_only = info.logits == "last"
        self.router_scores = info.router_scores
        self.exit_hidden = info.exit_hidden
        self.guesses = info.guesses
        self.vocab, self.hidden = logits_width(info, model), model.hidden_size
        self.seqlens = np.zeros(1, dtype=np.int32)
        self.total = np.zeros((), dtype=np.int32)
        self.binding.bind_cpu_input("seqlens_k", self.seqlens)
        self.binding.bind_cpu_input("total_sequence_length", self.total)
        self.arena: KVArena | None = None
        self.count: int | None = None  # T of the bound per-step buffers
        self.logits = self.scores = self.hidden_out = np.empty(0, dtype=np.float32)
        self.guessed = np.empty(0, dtype=np.int64)
        if self.router_scores:
            self.scores = np.empty(len(self.layers), dtype=np.float32)
            self.binding.bind_output("router_scores", "cpu", 0, np.float32, self.scores.shape, self.scores.ctypes.data)

    def bind_arena(self, arena: KVArena) -> None:
        for layer in self.layers:
            for kv, kind in ((0, "key"), (1, "value")):
                block = arena.block(layer, kv)
                self.binding.bind_cpu_input(f"past_{kind}_{layer}", block)
                self.binding.bind_output(
                    f"present_{kind}_{layer}", "cpu", 0, np.float32, block.shape, block.ctypes.data
                )
        self.arena = arena  # keep the bound memory alive: ORT holds only its address

    def bind_count(self, count: int) -> None:
        """Buffers whose shape depends on T: the rows to score, logits, exit hidden states."""
        rows = np.arange(count - 1 if self.last_only else 0, count, dtype=np.int64)
        self.rows = rows  # keep the memory ORT reads alive
        self.binding.bind_cpu_input("logit_rows", rows)
        self.logits = np.empty((1, rows.size, self.vocab), dtype=np.float32)
        self.binding.bind_output("logits", "cpu", 0, np.float32, self.logits.shape, self.logits.ctypes.data)
        if self.exit_hidden:
            self.hidden_out = np.empty((1, count, self.hidden), dtype=np.float32)
            self.binding.bind_output(
                "exit_hidden", "cpu", 0, np.float32, self.hidden_out.shape, self.hidden_out.ctypes.data
            )
        if self.guesses:
            self.guessed = np.empty((1, rows.size), dtype=np.int64)
            self.binding.bind_output("guesses", "cpu", 0, np.int64, self.guessed.shape, self.guessed.ctypes.data)
        self.count = count

    def run(self, first: np.ndarray, arena: KVArena, start: int) -> StepOutputs:
        count = first.shape[1]
        arena.check_room(start, count)
        if arena is not self.arena:
            self.bind_arena(arena)
        if count != self.count:
            self.bind_count(count)
        self.binding.bind_cpu_input(self.first_name, first if first.flags.c_contiguous else np.ascontiguousarray(first))
        self.seqlens[0] = start + count - 1
        self.total[...] = start + count
        self.guard.run(self.engine, count, lambda options: self.session.run_with_iobinding(self.binding, options))
        return StepOutputs(
            self.logits,
            self.scores if self.router_scores else None,
            self.hidden_out if self.exit_hidden else None,
            self.guessed if self.guesses else None,
        )


def available_provider(provider: str) -> str:
    """ONNX Runtime's name of the `--provider` named, if this installation has it: else one error line,
    before anything slow (`check` loads its reference model only after this)."""
    if provider not in PROVIDERS:
        raise UsageError(f"provider {provider!r} is unknown", f"choose one of: {', '.join(PROVIDERS)}")
    available = _import_ort().get_available_providers()
    if PROVIDERS[provider] not in available:
        raise UsageError(
            f"ONNX Runtime provider {provider!r} is not available here (have: {', '.join(available)})",
            "install onnxruntime-gpu (`pip install adaptive-export[gpu]`) on a machine with a GPU, "
            "or use --provider cpu",
        )
    return PROVIDERS[provider]


class OnnxRuntimeBackend(Backend):
    name = "onnx"
    rows_alike = True  # MatMulNBits at accuracy 4: a one-row pass differs, passes of two rows and more agree
    parallel_sessions = True  # sessions are created without the GIL and run at once (warm-up, pipelined)

    def __init__(
        self,
        bundle: Bundle,
        threads: int = 0,
        provider: str = "cpu",
        prepack: Iterable[str] | None = None,
        profile_prefix: str | None = None,
    ) -> None:
        super().__init__(bundle)
        self.ort = _import_ort()
        self.provider = available_provider(provider)
        self.threads = check_threads(threads)
        # engines that alternate within one sequence: draft and verify of any draft source
        self.alternating = any(set(c.engines) - {"decode"} for c in bundle.manifest.configs)
        self.profile_prefix = profile_prefix  # ORT's per-node profiler, for benchmarks/profile_decode.py
        self.flavour = self.entry.flavour
        self.kv_layout = "head" if self.flavour == "ort" else "seq"
        self.prepack = set(prepack) if prepack is not None else self._default_prepack()
        self._weights_map, self.weights = _map_weights(bundle.path(self.entry.weights or ""))
        self._values: dict[str, onnxruntime.OrtValue] = {}
        self._sessions: dict[str, onnxruntime.InferenceSession] = {}  # by engine file: one file, one session
        self._bindings: dict[str, onnxruntime.IOBinding] = {}
        self._fused: dict[str, FusedBinding] = {}
        self._out_buffers: dict[tuple[str, str, tuple[int, ...]], np.ndarray] = {}
        self.guard = RunGuard(self.ort, bundle.manifest, int(self.weights.size))  # memory, time, interrupts
        self._variants: dict[int, OnnxRuntimeBackend] = {}  # by thread count: sessions of their own (with_threads)

    def alternate(self) -> None:
        """Sessions made from now on stop spinning when their run returns, as a bundle with draft engines' do."""
        self.alternating = True

    def with_threads(self, threads: int) -> OnnxRuntimeBackend:
        """This backend with `threads` intra-op threads per session: pipelined decoding runs two
        engines at once, each on its own pool (runtimes/pipelined.py). It shares the mapped
        weights, their OrtValues and the run guard (one memory ceiling), and keeps sessions,
        IO bindings and output buffers of its own, so the two backends never share a binding.
        Made once per thread count; its sessions are created on first use, like this one's."""
        threads = check_threads(threads)
        if threads == self.threads:
            return self
        variant = self._variants.get(threads)
        if variant is None:
            variant = copy.copy(self)
            variant.threads = threads
            variant._sessions, variant._bindings, variant._fused, variant._out_buffers = {}, {}, {}, {}
            variant._variants = {}
            self._variants[threads] = variant
        return variant

    def _default_prepack(self) -> set[str]:
        """Fused fp32 bundles prepack the full-model engine (prefill, plain decoding and
        prompt-lookup verification in one session): faster at T=1 and much faster at T>1,
        and, with our pages released, no extra memory. Other engines read the mapped weights
        as they are, so skip configurations and draft/verify add no packed copies. Portable
        bundles have prefill and decode as two sessions: off (two packed copies)."""
        if self.flavour != "ort":
            return set()
        return {"prefill", self.bundle.config("full").decode}

    def _tensor(self, name: str) -> Any:
        value = self._values.get(name)
        if value is None:
            meta = self.entry.tensors[name]
            start, size = meta.offset, meta.bytes
            if start < 0 or start + size > self.weights.size:
                raise UsageError(f"weight {name!r} lies outside the weights file", "the bundle is corrupt: rebuild it")
            array = self.weights[start : start + size].view(np.dtype(meta.dtype)).reshape(meta.shape)
            value = self._values[name] = self.ort.OrtValue.ortvalue_from_numpy(array)
        return value

    def session(self, graph: str) -> Any:
        engine = self.entry.engine(graph)
        file, initializers = engine.file or "", engine.initializers or ()
        session = self._sessions.get(file)
        if session is None:
            options = self.ort.SessionOptions()
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
            if self.alternating:
                options.add_session_config_entry("session.force_spinning_stop", "1")
            options.graph_optimization_level = self.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.log_severity_level = 4  # fatal only: a failing engine is reported once, as the UsageError
            if self.profile_prefix:
                options.enable_profiling = True
                options.profile_file_prefix = f"{self.profile_prefix}_{graph}"
            sharing = {name for name, other in self.entry.graphs.items() if other.file == file}
            quantized = self.entry.quantize != "none" or self.bundle.graph(graph).precision is not None
            prepacked = bool(sharing & self.prepack) or quantized  # MatMulNBits dequantizes per call unless prepacked
            if not prepacked:
                options.add_session_config_entry("session.disable_prepacking", "1")
            for name in initializers:
                options.add_initializer(name, self._tensor(name))
            checked = checked_engine(self.bundle, graph)  # policy-checked; ORT gets bytes, never a path
            model_bytes = checked.data
            if checked.uses_packed_ops:
                self._register_packed_ops(options, file)
            releasable = [n for n in initializers if n not in checked.packed_only]  # packed ops read them in place
            # every external initializer is supplied above; ORT still validates their location against this folder
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(self.bundle.path(file).parent)
            )
            try:
                with self._releasing(releasable if prepacked else ()):
                    provider = (self.provider, PROVIDER_OPTIONS.get(self.provider, {}))
                    session = create_session(self.ort, self.guard, model_bytes, options, [provider])
            except Exception as exc:  # ORT raises its own exception types for invalid models
                raise UsageError(
                    f"ONNX Runtime cannot load engine {file!r}: {str(exc).splitlines()[0]}",
                    "rebuild the bundle",
                ) from exc
            self._refuse_fallback(session, file)
            self._sessions[file] = session
            if prepacked:
                self._release(releasable)
        return session

    def _register_packed_ops(self, options: Any, file: str) -> None:
        """The package's own op library (MatMulPacked, GatherPacked) for an engine that imports their
        domain: only the installed package's file (runtimes/packed_ops.py), never a path from a bundle.
        Its kernels run on the CPU provider only."""
        if self.provider != PROVIDERS["cpu"]:
            raise UsageError(
                f"engine {file!r} uses the GGUF-row ops (MatMulPacked), which run on the CPU only, not {self.provider}",
                "use --provider cpu, or rebuild the bundle with `--native-form nbits`",
            )
        library = require_library()
        try:
            options.register_custom_ops_library(str(library))
        except Exception as exc:  # a library of another build or ONNX Runtime: ORT's own exception types
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UsageError(
                f"ONNX Runtime cannot load the package's op library {library.name!r}: {reason}",
                "reinstall adaptive-export with a C++ compiler present, or rebuild the bundle with "
                "`--native-form nbits`",
            ) from exc

    def _refuse_fallback(self, session: onnxruntime.InferenceSession, file: str) -> None:
        """ONNX Runtime's Python API retries on the CPU when a GPU provider fails to start (missing
        CUDA or cuDNN libraries, say) and only warns: `--provider cuda` must run on CUDA or say why."""
        started = session.get_providers()
        if self.provider not in started:
            raise UsageError(
                f"ONNX Runtime could not start {self.provider} for engine {file!r} "
                f"(it fell back to {', '.join(started)})",
                "install the CUDA/cuDNN (or TensorRT) libraries onnxruntime-gpu needs and check `nvidia-smi`, "
                "or use --provider cpu",
            )

    @contextlib.contextmanager
    def _releasing(self, names: Iterable[str], every_s: float = 0.02) -> Iterator[None]:
        """Release pages while ONNX Runtime prepacks (it creates sessions without the GIL):
        prepacking reads every weight once, and without this the load-time peak would hold
        the mapped weights and their packed copies at once (SmolLM2 fp32: 1.16 GB)."""
        names = list(names)
        if not names or self._weights_map is None:
            yield
            return
        done = threading.Event()

        def loop() -> None:
            while not done.wait(every_s):
                self._release(names)

        worker = threading.Thread(target=loop, name="release-prepacked-pages", daemon=True)
        worker.start()
        try:
            yield
        finally:
            done.set()
            worker.join()

    def _release(self, names: Iterable[str]) -> None:
        """Drop our resident pages of weights a session has prepacked into its own buffers.

        The mapping is file-backed, so this is always safe: a page ORT still reads (a gather
        table, a weight it did not prepack) is read back from the file on its next access.
        Without it every prepacked weight would be resident twice."""
        if self._weights_map is None:
            return
        page = mmap.PAGESIZE
        for name in names:
            meta = self.entry.tensors[name]
            start = -(-meta.offset // page) * page
            end = (meta.offset + meta.bytes) // page * page
            if end > start:
                self._weights_map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def prepare(self, graph: str) -> None:
        self.session(graph)

    def run_named(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self.session(graph)
        names = [o.name for o in session.get_outputs()]
        count = next((v.shape[1] for v in feeds.values() if v.ndim == 2), 1)
        return dict(
            zip(names, self.guard.run(self._engine(graph), count, lambda options: session.run(names, feeds, options)))
        )

    def _buffer(self, graph: str, name: str, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        key = (graph, name, shape)
        buffer = self._out_buffers.get(key)
        if buffer is None:
            buffer = self._out_buffers[key] = np.empty(shape, dtype=dtype)
        return buffer

    def run(self, graph: str, first: np.ndarray, arena: KVArena, start: int) -> StepOutputs:
        if self.flavour == "ort":
            fused = self._fused.get(graph)
            if fused is None:
                fused = self._fused[graph] = FusedBinding(
                    self.session(graph), self.bundle.graph(graph), self.bundle.model, self.guard, self._engine(graph)
                )
            return fused.run(first, arena, start)
        session = self.session(graph)
        binding = self._bindings.get(graph)
        if binding is None:
            binding = self._bindings[graph] = session.io_binding()
        info = self.bundle.graph(graph)
        model = self.bundle.model
        count = first.shape[1]
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(info.inputs[0], np.ascontiguousarray(first))
        for layer in info.layers:
            for kv, kind in ((0, "key"), (1, "value")):
                binding.bind_cpu_input(f"past_{kind}_{layer}", arena.prefix(layer, kv, start))
                rows = arena.rows(layer, kv, start, count)
                binding.bind_output(f"new_{kind}_{layer}", "cpu", 0, np.float32, rows.shape, rows.ctypes.data)
        logits = self._buffer(graph, "logits", (1, 1 if info.logits == "last" else count, logits_width(info, model)))
        binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        scores = hidden = guessed = None
        if info.router_scores:
            scores = self._buffer(graph, "router_scores", (len(info.layers),))
            binding.bind_output("router_scores", "cpu", 0, np.float32, scores.shape, scores.ctypes.data)
        if info.exit_hidden:
            hidden = self._buffer(graph, "exit_hidden", (1, count, model.hidden_size))
            binding.bind_output("exit_hidden", "cpu", 0, np.float32, hidden.shape, hidden.ctypes.data)
        if info.guesses:
            guessed = self._buffer(graph, "guesses", (1, logits.shape[1]), np.int64)
            binding.bind_output("guesses", "cpu", 0, np.int64, guessed.shape, guessed.ctypes.data)
        self.guard.run(self._engine(graph), count, lambda options: session.run_with_iobinding(binding, options))
        return StepOutputs(logits, scores, hidden, guessed)

    def _engine(self, graph: str) -> str:
        """The engine file a graph runs from (graphs of one file share a session and its first-run time)."""
        return self.entry.engine(graph).file or graph
