"""check's first line: the bundle's engines against the engines the model defines.

Behavioural checks sample: a few token ids, three prompts, positions below ~60. A tampered
engine that computes the right thing there and something else elsewhere (rotary tables
rewritten past position 128, a branch on one token id, an extra engine a configuration names)
passes them. So `check` rebuilds every engine from `--model`, with the plan the manifest
describes (configurations, routers, draft pieces) and its recorded build options (streamed from
a .gguf where the build streams: no fp32 model held), and compares them with the bundle's, node
for node (ops, domains, attributes, wiring), graph input and output for input and output, and
initializer for initializer (name, type, shape and every byte: GGUF-exact blocks exactly, derived
tables such as the rotary caches in full). A row names the first node or tensor that differs.

What no model defines (trained routers, skip and exit adapters, draft tables) the rebuild takes
from the bundle's own listed files, so every other node and tensor is still compared; those
trained tensors are gated by the behavioural and quality checks. The manifest's words choose
what is rebuilt, never whether: an engine no rebuild makes fails, unless `--allow-unrebuilt`
names it, and the configurations must name the engines the model's build names.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from adaptive_export.exporter.repeated_layers import GraphNames, bare_value, reads_input_shape
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.errors import UsageError

LEAN_QUANTIZE = ("native", "none")  # what the streaming build writes; int8/int4 re-quantize the float model


@dataclass(frozen=True)
class StructureRow:
    engine: str
    passed: bool
    executed: bool
    detail: str
    seconds: float


def structure_rows(bundle: Bundle, model: str, allow_unrebuilt: Collection[str] = ()) -> list[StructureRow]:
    """One row per onnx engine: equal to the rebuilt engine, or the first difference; an engine no
    rebuild makes fails unless `allow_unrebuilt` names it (then its row says it was not compared)."""
    started = time.perf_counter()
    _check_allowed(bundle, allow_unrebuilt)
    reason = _not_rebuildable(bundle, model)
    if reason is not None:
        return list(_unrebuilt_rows(sorted(bundle.manifest.graphs), reason, allow_unrebuilt))
    with tempfile.TemporaryDirectory(prefix="adaptive-export-check-") as folder:
        rebuilt = _rebuild(bundle, model, Path(folder) / "bundle", repeat_layers=True)
        rows = list(_compare_bundles(bundle, rebuilt, allow_unrebuilt, time.perf_counter() - started))
        if all(row.passed for row in rows) or bundle.manifest.backends["onnx"].flavour != "portable":
            return rows
        # a difference is reported from whole traces: graphs written from short ones are only a shortcut
        rebuilt = _rebuild(bundle, model, Path(folder) / "traced", repeat_layers=False)
        return list(_compare_bundles(bundle, rebuilt, allow_unrebuilt, time.perf_counter() - started))


def _check_allowed(bundle: Bundle, allow_unrebuilt: Collection[str]) -> None:
    unknown = sorted(set(allow_unrebuilt) - set(bundle.manifest.graphs))
    if unknown:
        raise UsageError(
            f"--allow-unrebuilt names {_shown(unknown[0])}, which is no graph of the bundle",
            f"name one of its graphs ({', '.join(sorted(bundle.manifest.graphs)[:8])})",
        )


def _not_rebuildable(bundle: Bundle, model: str) -> str | None:
    """Why no engine of the bundle can be rebuilt from `model`, or None. The manifest's words
    choose what is rebuilt, never whether: a word that does not describe the engines rebuilds
    other engines, and the comparison fails."""
    onnx_entry = bundle.manifest.backends.get("onnx")
    if onnx_entry is None:
        return "the bundle has no onnx engines"
    if onnx_entry.quantize == "native" and _gguf_path(model) is None:
        return "a GGUF-exact bundle is rebuilt from its .gguf, and the reference is not one"
    return None


def _unrebuilt_rows(names: list[str], reason: str, allowed: Collection[str]) -> Iterator[StructureRow]:
    for name in names:
        if name in allowed:
            detail = f"not compared ({reason}): --allow-unrebuilt accepts it, checked by behaviour only"
            yield StructureRow(name, True, False, detail, 0.0)
        else:
            detail = f"no engine was rebuilt to compare it with ({reason}); --allow-unrebuilt {name} accepts that"
            yield StructureRow(name, False, False, detail, 0.0)


def bundle_plan(bundle: Bundle) -> Any:
    """The build plan the manifest describes (configurations, routers, each draft source's graph
    piece), read from its graph entries: what the rebuild makes. A manifest whose graphs no one
    plan makes gets the rebuild of one plan, and the engines it does not make fail."""
    from adaptive_export.graphs.drafts.early_exit import NAME as EXIT
    from adaptive_export.graphs.drafts.early_exit import ExitPlan
    from adaptive_export.graphs.drafts.precision import NAME as PRECISION
    from adaptive_export.graphs.plan import FULL_CONFIG, BuildPlan, SkipConfig

    manifest = bundle.manifest
    graphs = [bundle.graph(name) for name in manifest.graphs]
    configs = [SkipConfig(c.id, tuple(c.kept), bundle.graph(c.decode).skip_adapters) for c in manifest.configs]
    routers = any(g.kind == "prefill" and g.router_scores for g in graphs)
    plan = BuildPlan(num_layers=bundle.num_layers, configs=configs, routers=routers)
    exits = sorted({(g.exit_layer or 0, g.exit_adapter, g.draft_vocab) for g in graphs if g.kind == "draft"})
    if exits:
        layer, adapter, vocab = exits[0]
        plan.drafts[EXIT] = ExitPlan(layer, 1, adapter, vocab)  # the draft length is no part of a graph
    precisions = sorted({g.precision for g in graphs if g.precision is not None})
    if precisions:
        plan.drafts[PRECISION] = precisions[0]
    full = next((c for c in manifest.configs if c.id == FULL_CONFIG), None)
    if full is not None:
        plan.draft_fields.update(bundle.graph(full.decode).draft_fields)
    plan.draft_vocab = manifest.draft_vocab.size if manifest.draft_vocab is not None else 0
    return plan


def _rebuild(bundle: Bundle, model: str, out: Path, repeat_layers: bool) -> Bundle:
    """The manifest's plan, built from the model with the bundle's recorded options and its own
    trained parts (routers, adapters, draft tables: what no model defines; every other node and
    tensor comes from the model). Streamed from a .gguf where the build streams; `repeat_layers`:
    see ExportOptions."""
    from adaptive_export.exporter.build import ExportOptions, build_bundle
    from adaptive_export.graphs.span_graph import ModelParts
    from adaptive_export.loading.artifacts import add_trained_parts, check_reference_dims
    from adaptive_export.loading.lean_model import draft_vocab_rows, load_lean_model
    from adaptive_export.loading.model import load_model
    from adaptive_export.runtimes.bundle import load_bundle

    onnx_entry = bundle.manifest.backends["onnx"]
    lean = rebuild_streams(bundle, model)
    loaded = load_lean_model(model) if lean else load_model(model)
    check_reference_dims(bundle, loaded)
    parts = ModelParts(loaded.hf_model, loaded.spec)
    add_trained_parts(bundle, parts)
    _check_head_width(bundle, parts)
    if lean and parts.draft_vocab is not None:  # the fake LM head cannot be indexed: its rows from the file
        parts.draft_heads[int(parts.draft_vocab.numel())] = draft_vocab_rows(loaded, parts.draft_vocab)
    options = ExportOptions(
        output=out,
        max_len=bundle.max_len,
        quantize=onnx_entry.quantize,
        quant_options=dict(onnx_entry.extra.get("quant_options") or {}),
        onnx_flavour=onnx_entry.flavour,
        native_source=_gguf_path(model) if onnx_entry.quantize == "native" else None,
        progress=False,
        repeat_layers=repeat_layers,
    )
    build_bundle(loaded, bundle_plan(bundle), options, parts)
    return load_bundle(out)


def rebuild_streams(bundle: Bundle, model: str) -> bool:
    """Whether the rebuild streams the weights from a .gguf (the build's lean path) or loads the
    fp32 model (re-quantization and precision drafts read float weights)."""
    onnx_entry = bundle.manifest.backends.get("onnx")
    floats = any(bundle.graph(name).precision is not None for name in bundle.manifest.graphs)
    lean_weights = onnx_entry is not None and onnx_entry.quantize in LEAN_QUANTIZE and not floats
    return lean_weights and _gguf_path(model) is not None


def _gguf_path(model: str) -> Path | None:
    """The reference's .gguf file, whose blocks a GGUF-exact rebuild keeps (None: not a .gguf)."""
    from adaptive_export.loading.model import check_model_files

    directory, gguf_file = check_model_files(model)
    return directory / gguf_file if gguf_file is not None else None


def _check_head_width(bundle: Bundle, parts: Any) -> None:
    """The EAGLE table the bundle ships fits the width its decode graph declares (a hostile file
    whose checksum was re-signed fails in one line, not inside the export)."""
    from adaptive_export.runtimes.drafting.eagle import FIELD

    table = parts.draft_tables.get(FIELD)
    decode = bundle.manifest.graphs.get("decode_full")
    width = decode.draft_field(FIELD) if decode is not None else 0
    if table is not None and width and table.shape[0] != 5 * width:
        raise UsageError(
            f"the bundle's head file holds a head of width {table.shape[0] // 5}, its decode graph guesses "
            f"with width {width}",
            "rebuild the bundle: its head file does not belong to its engines",
        )


def _compare_bundles(
    bundle: Bundle, rebuilt: Bundle, allowed: Collection[str], seconds: float
) -> Iterator[StructureRow]:
    """Each engine's row, then the configurations: the engines each names by role, as the rebuild names them."""
    yield from _compare_engines(bundle, rebuilt, allowed, seconds)
    ours = [c.to_json() for c in bundle.manifest.configs]
    theirs = [c.to_json() for c in rebuilt.manifest.configs]
    if ours == theirs:
        yield StructureRow("configs", True, True, "each configuration names the engines the model's build names", 0.0)
    else:
        first = next((a for a, b in zip(ours, theirs) if a != b), ours[len(theirs)] if len(ours) > len(theirs) else {})
        shown = _shown(str(first.get("id", "")))
        detail = f"configuration {shown} names other engines or layers than the model's build"
        yield StructureRow("configs", False, True, detail, 0.0)


def _compare_engines(
    bundle: Bundle, rebuilt: Bundle, allowed: Collection[str], seconds: float
) -> Iterator[StructureRow]:
    ours, theirs = bundle.manifest.backends["onnx"], rebuilt.manifest.backends["onnx"]
    compared: dict[tuple[str, str], str | None] = {}
    for name, engine in ours.graphs.items():
        if name not in theirs.graphs or bundle.graph(name) != rebuilt.graph(name):
            yield from _unrebuilt_rows([name], "the model's build makes no such graph", allowed)
            continue
        pair = (engine.file, theirs.graphs[name].file)  # graphs that are one model share a file
        if pair not in compared:
            compared[pair] = engine_difference(bundle, pair[0], rebuilt, pair[1])
        difference = compared[pair]
        yield StructureRow(
            name, difference is None, True, difference or "equal to the engine the model defines", seconds
        )


def engine_difference(bundle: Bundle, file: str, rebuilt: Bundle, rebuilt_file: str) -> str | None:
    """The first difference between two engines, in words, or None."""
    a = onnx.load(str(bundle.root / file), load_external_data=False)
    b = onnx.load(str(rebuilt.root / rebuilt_file), load_external_data=False)
    for check in (_opsets, _interface, _nodes):
        found = check(a, b)
        if found is not None:
            return found
    return _initializers(bundle, a, rebuilt, b)


def _opsets(a: onnx.ModelProto, b: onnx.ModelProto) -> str | None:
    ours, theirs = (
        sorted((o.domain, o.version) for o in a.opset_import),
        sorted((o.domain, o.version) for o in b.opset_import),
    )
    return None if ours == theirs else f"opset imports {ours} differ from {theirs}"


def _interface(a: onnx.ModelProto, b: onnx.ModelProto) -> str | None:
    for kind in ("input", "output"):
        ours = [_typed_name(v) for v in getattr(a.graph, kind)]
        theirs = [_typed_name(v) for v in getattr(b.graph, kind)]
        if ours != theirs:
            return f"graph {kind}s differ from the model's"
    return None


def _typed_name(value: onnx.ValueInfoProto) -> bytes:
    """A graph input's or output's name and type."""
    return bare_value(value).SerializeToString()


class _Wiring(GraphNames):
    """What each value of a graph is, independent of its name: the graph input or output of that
    name, a model tensor (external: its name, as the runtime binds it), a constant (by content),
    or output k of node i. Two graphs compute the same exactly when their nodes, in order, have
    the same ops and attributes over the same such values: value names compute nothing (they are
    counters of the tracer, exporter/repeated_layers.py names them afresh)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        graph = model.graph
        defined = [v.name for v in graph.input] + [t.name for t in graph.initializer]
        defined += [name for node in graph.node for name in node.output if name]
        seen: set[str] = set()
        self.twice = next((name for name in defined if name in seen or seen.add(name)), None)  # type: ignore[func-returns-value]

    def value(self, name: str) -> tuple[Any, ...]:
        if not name:
            return ("none",)
        if name in self.producer:
            return ("node", *self.producer[name])
        if name in self.inputs:
            return ("input", name)
        tensor = self.initializers.get(name)
        if tensor is None:
            return ("undefined", name)
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            return ("tensor", name)
        return ("constant", *self.constant_key(name))

    def node_key(self, node: onnx.NodeProto) -> tuple[Any, ...]:
        attributes = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
        outputs = tuple(("output", n) if n in self.outputs else ("value",) if n else ("none",) for n in node.output)
        inputs = tuple(self.value(n) for n in node.input)
        if reads_input_shape(node, self.input_types):  # any input of that declared type has that shape
            inputs = (("shape of", self.input_types[node.input[0]]),)
        return node.domain, node.op_type, inputs, outputs, attributes


def _nodes(a: onnx.ModelProto, b: onnx.ModelProto) -> str | None:
    ours, theirs = a.graph.node, b.graph.node
    wiring, model_wiring = _Wiring(a), _Wiring(b)
    if wiring.twice is not None:
        return f"value {_shown(wiring.twice)} is defined more than once"
    for index, (x, y) in enumerate(zip(ours, theirs)):
        if wiring.node_key(x) != model_wiring.node_key(y):
            return (
                f"node {index} ({x.op_type} {_shown(x.name)}) differs from the model's ({y.op_type} {_shown(y.name)})"
            )
    if len(ours) != len(theirs):
        extra = ours[len(theirs)] if len(ours) > len(theirs) else None
        what = f"; the first extra is {extra.op_type} {_shown(extra.name)}" if extra is not None else ""
        return f"{len(ours)} nodes where the model defines {len(theirs)}{what}"
    for output in a.graph.output:
        if wiring.value(output.name) != model_wiring.value(output.name):
            return f"graph output {_shown(output.name)} comes from another value than the model's"
    return None


def _initializers(bundle: Bundle, a: onnx.ModelProto, rebuilt: Bundle, b: onnx.ModelProto) -> str | None:
    """The weights file's tensors, by name (the runtime binds them by name); the graph's own
    constants were compared by content where the nodes read them (_Wiring)."""
    ours = {t.name: t for t in a.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    theirs = {t.name: t for t in b.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    if ours.keys() != theirs.keys():
        extra = sorted(ours.keys() - theirs.keys())[:3]
        missing = sorted(theirs.keys() - ours.keys())[:3]
        return f"initializers differ: extra {[_shown(n) for n in extra]}, missing {[_shown(n) for n in missing]}"
    for name, tensor in ours.items():
        other = theirs[name]
        if (tensor.data_type, list(tensor.dims)) != (other.data_type, list(other.dims)):
            ours_kind, theirs_kind = f"{tensor.data_type}/{list(tensor.dims)}", f"{other.data_type}/{list(other.dims)}"
            return f"tensor {_shown(name)} has type/shape {ours_kind}, the model's {theirs_kind}"
        if _digest(bundle, tensor) != _digest(rebuilt, other):
            return f"tensor {_shown(name)} differs from what the model's weights give"
    return None


def _digest(bundle: Bundle, tensor: onnx.TensorProto) -> str:
    """sha256 of a tensor's bytes, inline or at its place in the bundle's weights file (the
    engine's own offset and length: what ONNX Runtime reads, not the manifest's table)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return hashlib.sha256(onnx.numpy_helper.to_array(tensor).tobytes()).hexdigest()
    fields = {e.key: e.value for e in tensor.external_data}
    path = bundle.root / "onnx" / fields.get("location", "")
    if path.parent != bundle.root / "onnx" or not path.is_file():
        raise UsageError(f"tensor {_shown(tensor.name)} names external data outside the bundle", "rebuild the bundle")
    offset, length = int(fields.get("offset", 0)), int(fields.get("length", path.stat().st_size))
    data = np.memmap(path, np.uint8, "r", offset=offset, shape=(length,)) if length else np.zeros(0, np.uint8)
    digest = hashlib.sha256(data).hexdigest()
    del data
    return digest


def _shown(name: str) -> str:
    return ascii(name if len(name) <= 80 else name[:77] + "...")
