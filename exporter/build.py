"""`adaptive-export build`: model -> static graphs -> ONNX with shared weights -> bundle."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx
from tqdm import tqdm

from adaptive_export.exporter.backends import COMPILERS, needs_portable_onnx
from adaptive_export.exporter.graph_entry import manifest_graph
from adaptive_export.exporter.lean_export import LazyWeights, cached_lean_graph, fake_names, placeholder_array
from adaptive_export.exporter.onnx_export import OPSET, export_graph
from adaptive_export.exporter.tokenizer_export import chat_format, save_tokenizer, special_tokens
from adaptive_export.exporter.weights import WeightStore, canonicalize_names, externalize, externalize_tensor
from adaptive_export.graphs.drafts import engine_roles
from adaptive_export.graphs.fused_graph import packed_weights
from adaptive_export.graphs.plan import FULL_CONFIG, BuildPlan
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts, draft_head
from adaptive_export.loading.lean_model import LeanModel, is_fake
from adaptive_export.loading.model import LoadedModel
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import (
    BackendEntry,
    ChatFormat,
    ConfigEntry,
    DraftVocab,
    EngineEntry,
    Manifest,
    ModelDims,
    PromptRows,
    Speculation,
    TensorEntry,
    TokenizerEntry,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_LEN = 2048
WEIGHTS_FILE = "weights.bin"
DRAFT_VOCAB_FILE = "draft_vocab.bin"  # VocabTrim's token ids, little-endian int32, ascending
ONNX_FLAVOURS = ("ort", "portable")


@dataclass
class ExportOptions:
    """How to export and write one bundle (what `build` decided after calibration)."""

    output: Path
    backends: tuple[str, ...] = ("onnx",)
    max_len: int = DEFAULT_MAX_LEN
    force: bool = False
    router_threshold: float = 0.5
    speculation: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None
    extra_files: dict[str, bytes] = field(default_factory=dict)
    progress: bool = True
    quantize: str = "none"
    quant_options: dict[str, Any] = field(default_factory=dict)  # block_size, accuracy_level[, native_form]
    # "ort": ONNX Runtime's fused kernels (the fast default); "portable": standard ops, the
    # graphs TensorRT parses (a build with the tensorrt backend is always portable).
    onnx_flavour: str = "ort"
    native_source: Path | None = None  # the quantized .gguf whose blocks --quantize native keeps
    # check's rebuild: a uniform stack's portable graphs written from short traces
    # (exporter/repeated_layers.py) where this machine has no trace cached
    repeat_layers: bool = False
    coreml_precision: str = "float16"
    trt_precision: str = "fp16"
    # Runs on the staged bundle (provisional manifest written) before the final manifest:
    # calibration times the real engines here and may update manifest and calibration.json.
    after_export: Callable[[Path, dict[str, Any]], None] | None = None


def flavoured(graphs: list[GraphSpec], flavour: str) -> list[GraphSpec]:
    """The plan's graphs in the chosen ONNX flavour. In the fused flavour the full model's
    decode graph also returns the router scores, so it is the prefill graph too: one engine,
    one session, one prepacked copy of the weights (ONNX Runtime prepacks per session)."""
    if flavour not in ONNX_FLAVOURS:
        raise UsageError(f"ONNX flavour {flavour!r} is unknown", f"choose one of: {', '.join(ONNX_FLAVOURS)}")
    if flavour == "portable":
        return graphs
    routers = any(g.router_scores for g in graphs)
    out = []
    for graph in graphs:
        graph = replace(graph, flavour="ort")
        if graph.kind == "decode" and graph.config == FULL_CONFIG and graph.precision is None:
            graph = replace(graph, router_scores=routers)
        out.append(graph)
    return out


def export_onnx(
    root: Path,
    parts: ModelParts,
    graphs: list[GraphSpec],
    progress: bool,
    quantize: str = "none",
    quant_options: dict[str, Any] | None = None,
    max_len: int = DEFAULT_MAX_LEN,
    native_source: Path | None = None,
    lazy: LazyWeights | None = None,
    repeat_layers: bool = False,
) -> BackendEntry:
    """Export every graph to root/onnx with one shared weights file (optionally weight-quantized).
    With `lazy` (the memory-lean build), the parts' large weights are fake and read from the file
    only where the bundle keeps them as floats (exporter/lean_export.py)."""
    folder = root / "onnx"
    folder.mkdir()
    flavour, quant_options = graphs[0].flavour, quant_options or {}
    packed = packed_weights(parts, max_len) if flavour == "ort" else None
    native = _native_weights(parts, quantize, flavour, native_source)
    if native is not None and native_form(quant_options) == "packed":
        from adaptive_export.exporter.packed_native import check_packed_types

        check_packed_types(native)  # a type the op library does not read fails before any graph is exported
    engines: dict[str, EngineEntry] = {}
    written: dict[tuple[Any, ...], EngineEntry] = {}
    names = fake_names(parts, packed) if lazy is not None else {}
    with WeightStore(folder / WEIGHTS_FILE) as store:
        _name_weights(store, parts, packed, graphs)
        read = (lambda init: placeholder_array(init, lazy)) if lazy is not None else None

        def emit(inits: list[onnx.TensorProto]) -> list[onnx.TensorProto]:  # each linear's blocks, written at once
            return [externalize_tensor(init, store, WEIGHTS_FILE) for init in inits]

        for graph in tqdm(graphs, desc="export ONNX", unit="graph", disable=not progress):
            key = manifest_graph(graph).engine_key()
            if key not in written:
                model = (
                    cached_lean_graph(parts, graph, packed, names, max_len, repeat_layers)
                    if lazy
                    else export_graph(parts, graph, packed)
                )
                canonicalize_names(model, store)
                model = _apply_precision(model, graph, quantize, quant_options, native, emit if lazy else None)
                externalize(model, store, WEIGHTS_FILE, read)
                onnx.save(model, str(folder / f"{graph.name}.onnx"))
                external = (i.name for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
                written[key] = EngineEntry(file=f"onnx/{graph.name}.onnx", initializers=tuple(sorted(external)))
            engines[graph.name] = written[key]
        tensors = {t.name: TensorEntry(t.dtype, tuple(t.shape), t.offset, t.length) for t in store.tensors.values()}
        weight_bytes = store.total_bytes
    extra = {"opset": OPSET, "quant_options": quant_options, "quant_bits": native.dtype if native else quantize}
    return BackendEntry(
        "onnx", engines, f"onnx/{WEIGHTS_FILE}", weight_bytes, tensors, flavour, quantize, extra=extra,
        key_order=("weights", "weight_bytes", "opset", "flavour", "quantize", "quant_options", "quant_bits"),
    )  # fmt: skip


def _native_weights(parts: ModelParts, quantize: str, flavour: str, native_source: Path | None) -> Any:
    """A GGUF-exact build's blocks (--quantize native), or None."""
    if quantize != "native":
        return None
    from adaptive_export.exporter.native_quant import NativeWeights

    if flavour != "ort" or native_source is None:
        raise UsageError(
            "--quantize native needs the ort ONNX flavour and a quantized .gguf model",
            "drop --onnx-flavour portable / --backend tensorrt, or use --quantize int8|int4",
        )
    return NativeWeights.from_gguf(native_source, parts.spec)


def _name_weights(store: WeightStore, parts: ModelParts, packed: Any, graphs: list[GraphSpec]) -> None:
    """Every tensor an engine may take from the weights file, under its canonical name."""
    real = [(n, p) for n, p in parts.hf_model.named_parameters() if not is_fake(p)]  # fakes: named by identity
    store.name_parameters((n, p.detach().numpy()) for n, p in real)
    if packed is not None:
        store.name_parameters((n, t.detach().numpy()) for n, t in packed.named() if not is_fake(t))
    if parts.routers is not None:
        store.name_parameters([("routers.weight", parts.routers.weight.detach().numpy())])
    store.name_parameters((f"{source}.table", t.detach().numpy()) for source, t in parts.draft_tables.items())
    if parts.draft_vocab is not None:
        rows = next((draft_head(parts, g) for g in graphs if g.draft_vocab), None)
        if rows is not None:
            store.name_parameters([("draft_head.weight", rows.numpy())])
    for layer, adapter in parts.exit_adapters.items():
        store.name_parameters((f"exit_adapter.{layer}.{n}", p.detach().numpy()) for n, p in adapter.named_parameters())
    for layer, adapter in parts.skip_adapters.items():
        store.name_parameters((f"skip_adapter.{layer}.{n}", p.detach().numpy()) for n, p in adapter.named_parameters())


def _apply_precision(
    model: onnx.ModelProto,
    graph: GraphSpec,
    quantize: str,
    quant_options: dict[str, Any],
    native: Any,
    emit: Any = None,
) -> onnx.ModelProto:
    """The bundle's weight precision, or a precision draft's: int8/int4 re-quantize the float
    weights (accuracy 4: int8 activations, ORT's fast CPU kernels); native4 is the GGUF's own
    blocks at accuracy 4, sharing every block initializer with the bundle's engines. A native
    bundle's weight form (`quant_options["native_form"]`) picks MatMulNBits (nbits) or the GGUF's
    rows as stored (packed) for the bundle's linears and its native4 draft alike."""
    if graph.precision == "native4":
        if native is None:
            raise UsageError(
                "--draft-precision native4 needs a GGUF-exact bundle (--quantize native)",
                "build from a quantized .gguf with --quantize native, or use --draft-precision int8|int4",
            )
        _native_rewrite(quant_options)(model, native, 4, emit)
        if graph.draft_vocab:  # the reduced head is no GGUF tensor: int8 at accuracy 4, like a float bundle's draft
            from adaptive_export.exporter.quantize import quantize as quantize_model

            return quantize_model(model, "int8", block_size=quant_options.get("block_size", 32), accuracy_level=4)
        return model
    if graph.precision is not None:
        from adaptive_export.exporter.quantize import quantize as quantize_model

        return quantize_model(model, graph.precision, block_size=quant_options.get("block_size", 32), accuracy_level=4)
    if native is not None:
        _native_rewrite(quant_options)(model, native, quant_options.get("accuracy_level", 4), emit)
        quantize_guess_head(model, quant_options.get("block_size", 32))  # names are canonical: no model weight
        return model
    if quantize != "none":
        from adaptive_export.exporter.quantize import quantize as quantize_model

        return quantize_model(model, quantize, **quant_options)
    return model


def native_form(quant_options: dict[str, Any]) -> str:
    """A native bundle's weight form: "nbits" (MatMulNBits, the default) or "packed" (the GGUF's rows)."""
    return str(quant_options.get("native_form", "nbits"))


def _native_rewrite(quant_options: dict[str, Any]) -> Any:
    """apply_native or apply_packed, as the bundle's weight form says."""
    form = native_form(quant_options)
    if form == "packed":
        from adaptive_export.exporter.packed_native import apply_packed

        return apply_packed
    if form != "nbits":
        raise UsageError(f"native weight form {form!r} is unknown", "choose --native-form nbits or packed")
    from adaptive_export.exporter.native_quant import apply_native

    return apply_native


def quantize_guess_head(model: onnx.ModelProto, block_size: int) -> None:
    """A GGUF-exact graph's guessing head (an EAGLE head's block and trimmed rows: no GGUF tensor)
    as 4-bit blocks like the model's own linears: it is read on every decode pass, and as a
    lossless draft its precision moves only its acceptance (measured in docs/eagle.md)."""
    from adaptive_export.exporter.quantize import quantize_weights
    from adaptive_export.graphs.span_graph import GUESS_PREFIX

    # canonicalize_names gave a tensor the head shares with the model (a tied embedding) the model's name
    weights = [
        init.name
        for init in model.graph.initializer
        if init.name.startswith(GUESS_PREFIX) and init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2
    ]
    if weights:
        quantize_weights(model, weights, bits=4, block_size=block_size)


def build_bundle(
    loaded: LoadedModel, plan: BuildPlan, options: ExportOptions, parts: ModelParts | None = None
) -> Manifest:
    """Export, compile and write the bundle atomically; returns the manifest."""
    from adaptive_export.exporter.bundle_writer import staging_dir, write_manifest

    unknown = [b for b in options.backends if b not in COMPILERS]
    if unknown:
        raise UsageError(f"backend {unknown[0]!r} is not available for build", f"choose from {', '.join(COMPILERS)}")
    if "onnx" not in options.backends:
        raise UsageError(
            "every bundle needs the onnx backend (the reference the others are checked and built from)",
            "add onnx to --backend, e.g. --backend onnx,coreml",
        )
    parts = parts or ModelParts(loaded.hf_model, loaded.spec)
    flavour = "portable" if needs_portable_onnx(options.backends) else options.onnx_flavour
    graphs = flavoured(plan.graphs(), flavour)
    lazy = LazyWeights(loaded.weights, loaded.spec.num_layers) if isinstance(loaded, LeanModel) else None
    with staging_dir(options.output, options.force) as root:
        onnx_entry = export_onnx(
            root, parts, graphs, options.progress, options.quantize, options.quant_options, options.max_len,
            options.native_source, lazy, options.repeat_layers,
        )  # fmt: skip
        save_tokenizer(loaded.tokenizer, root / "tokenizer.json", loaded.spec.vocab_size)
        manifest = _manifest(loaded, plan, options, graphs, onnx_entry)
        _write_side_files(root, plan, parts, options)
        if options.after_export is not None:
            write_manifest(root, manifest)
            provisional = manifest.to_json()
            options.after_export(root, provisional)  # calibration may update speculation and prompt_rows
            speculation = Speculation.from_json(provisional["speculation"])
            manifest = replace(
                manifest, speculation=speculation, prompt_rows=PromptRows.from_json(provisional.get("prompt_rows"))
            )
        for backend in options.backends:
            compile_backend = COMPILERS[backend].compile
            if compile_backend is not None:
                compiled = compile_backend(root, manifest, parts, plan, options)
                entry = BackendEntry.from_json(backend, compiled, manifest.graphs)
                manifest = replace(manifest, backends={**manifest.backends, backend: entry})
        manifest = write_manifest(root, manifest)
    return manifest


def _manifest(
    loaded: LoadedModel, plan: BuildPlan, options: ExportOptions, graphs: list[GraphSpec], onnx_entry: BackendEntry
) -> Manifest:
    """The bundle's manifest before the backends are compiled and the files listed."""
    chat = chat_format(loaded.tokenizer)
    special = special_tokens(loaded.tokenizer, loaded.hf_model)
    tokenizer = TokenizerEntry(
        "tokenizer.json",
        ChatFormat(chat["prefix"], chat["suffix"]) if chat else None,
        tuple(special["eos_token_ids"]),
        tuple(special["prefix_token_ids"]),
    )
    configs = tuple(
        ConfigEntry(c.id, tuple(c.kept), {"decode": f"decode_{c.id}", **draft_engines(graphs, c.id)})
        for c in plan.configs
    )
    return Manifest(
        model=ModelDims.from_json({**loaded.spec.to_json(), "source": loaded.source}),
        max_len=options.max_len,
        dtype="float32" if options.quantize == "none" else onnx_entry.extra["quant_bits"],
        router_threshold=options.router_threshold,
        tokenizer=tokenizer,
        configs=configs,
        speculation=Speculation.from_json(options.speculation),
        graphs={g.name: manifest_graph(g) for g in graphs},
        backends={"onnx": onnx_entry},
        calibration="calibration.json" if options.calibration is not None else None,
        draft_vocab=DraftVocab(DRAFT_VOCAB_FILE, plan.draft_vocab) if plan.draft_vocab else None,
    )


def _write_side_files(root: Path, plan: BuildPlan, parts: ModelParts, options: ExportOptions) -> None:
    """The draft vocabulary, calibration.json and calibration's files (routers, adapters, ...)."""
    if plan.draft_vocab:
        (root / DRAFT_VOCAB_FILE).write_bytes(draft_vocab_bytes(parts))
    if options.calibration is not None:
        (root / "calibration.json").write_text(json.dumps(options.calibration, indent=2) + "\n")
    for name, data in options.extra_files.items():
        (root / name).write_bytes(data)


def draft_vocab_bytes(parts: ModelParts) -> bytes:
    """The reduced draft vocabulary's ids as the runtime reads them (runtimes/bundle.py)."""
    import numpy as np

    if parts.draft_vocab is None:
        raise ValueError("the plan drafts over a reduced vocabulary, but the model parts hold no token ids")
    return np.ascontiguousarray(parts.draft_vocab.numpy(), dtype="<i4").tobytes()


def draft_engines(graphs: list[GraphSpec], config_id: str) -> dict[str, str]:
    """A configuration's draft-source engines: the roles each source's graph piece gives its
    graphs (graphs/drafts/: `engine_role`)."""
    return {role: graph.name for graph in graphs if graph.config == config_id for role in engine_roles(graph)}
