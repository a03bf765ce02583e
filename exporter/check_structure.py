"""check's first line: the bundle's engines against the engines the model defines.

Behavioural checks sample: a few token ids, three prompts, positions below ~60. A tampered
engine that computes the right thing there and something else elsewhere (rotary tables
rewritten past position 128, a branch on one token id) passes them. So `check` rebuilds the
engines from `--model` with the bundle's recorded build options (the streaming build of
exporter/lean_export.py: seconds to a minute, no fp32 model held) and compares them with the
bundle's, node for node (ops, domains, attributes, wiring), graph input and output for input and
output, and initializer for initializer (name, type, shape and every byte: GGUF-exact blocks
exactly, derived tables such as the rotary caches in full). A row names the first node or tensor
that differs. What no model defines (trained routers, adapters, draft heads) has no rebuilt
engine: those graphs are listed as not rebuilt, and the behavioural checks cover them. The one
exception is a guessing head inside the plain decode graph (an EAGLE head, which `build` of a
packaged model includes by default): the rebuild takes its trained table and ids from the
bundle's own head file (listed with a checksum like every file), so every other node and tensor
of that graph is still compared with what the model defines; a head tampered in both places only
changes guesses, which verification makes lossless.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from adaptive_export.exporter.repeated_layers import GraphNames, bare_value, reads_input_shape
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.errors import UsageError

REBUILT_QUANTIZE = ("native", "none")  # what the streaming build makes; int8/int4 re-quantize a float model


@dataclass(frozen=True)
class StructureRow:
    engine: str
    passed: bool
    executed: bool
    detail: str
    seconds: float


def structure_rows(bundle: Bundle, model: str) -> list[StructureRow]:
    """One row per onnx engine: equal to the rebuilt engine, or the first difference; rows that say
    why an engine was not rebuilt."""
    started = time.perf_counter()
    reason = _not_rebuildable(bundle, model)
    if reason is None and not _plain_graphs_in(bundle):
        reason = "every graph carries calibrated parts (routers, drafts, prompt tokens): checked by behaviour"
    if reason is not None:
        return [StructureRow("all", True, False, f"engines not rebuilt: {reason}", 0.0)]
    with tempfile.TemporaryDirectory(prefix="adaptive-export-check-") as folder:
        rebuilt = _rebuild(bundle, model, Path(folder) / "bundle", repeat_layers=True)
        rows = list(_compare_engines(bundle, rebuilt, time.perf_counter() - started))
        if all(row.passed for row in rows) or bundle.manifest.backends["onnx"].flavour != "portable":
            return rows
        # a difference is reported from whole traces: graphs written from short ones are only a shortcut
        rebuilt = _rebuild(bundle, model, Path(folder) / "traced", repeat_layers=False)
        return list(_compare_engines(bundle, rebuilt, time.perf_counter() - started))


def _not_rebuildable(bundle: Bundle, model: str) -> str | None:
    from adaptive_export.loading.model import check_model_files

    onnx_entry = bundle.manifest.backends.get("onnx")
    if onnx_entry is None:
        return "the bundle has no onnx engines"
    if onnx_entry.quantize not in REBUILT_QUANTIZE:
        return (
            f"--quantize {onnx_entry.quantize} re-quantizes a float model; the streaming build rebuilds native and none"
        )
    _, gguf_file = check_model_files(model)
    if gguf_file is None:
        return "the reference is not a .gguf (the streaming build reads .gguf files)"
    return None


def _plain_graphs_in(bundle: Bundle) -> bool:
    """Whether any of the bundle's graphs is one a plain build makes (decided from the manifest,
    before minutes of rebuilding a bundle with nothing to compare)."""
    from adaptive_export.exporter.build import flavoured
    from adaptive_export.exporter.graph_entry import manifest_graph

    flavour = bundle.manifest.backends["onnx"].flavour
    plain = flavoured(_plain_plan(bundle, bundle.num_layers).graphs(), flavour)
    return any(g.name in bundle.manifest.graphs and bundle.graph(g.name) == manifest_graph(g) for g in plain)


@dataclass(frozen=True)
class _Head:
    """The bundle's guessing head, as its own files hold it: table [5 x width, hidden], ids."""

    table: Any
    ids: Any


def _bundle_head(bundle: Bundle) -> _Head | None:
    """The EAGLE head the bundle's plain decode graph guesses with, from its head file, or None."""
    import torch

    from adaptive_export.loading.artifacts import load_draft_table
    from adaptive_export.runtimes.drafting.eagle import FIELD, Eagle

    assert Eagle.table is not None
    decode = bundle.manifest.graphs.get("decode_full")
    ids = bundle.draft_vocab_ids
    if decode is None or not decode.draft_field(FIELD) or ids is None:
        return None
    table = load_draft_table(Eagle.table, bundle.root / Eagle.table.file, bundle.model.hidden_size)
    if table.shape[0] != 5 * decode.draft_field(FIELD):  # a hostile file whose checksum was re-signed
        raise UsageError(
            f"the bundle's {Eagle.table.file} holds a head of width {table.shape[0] // 5}, its decode graph "
            f"guesses with width {decode.draft_field(FIELD)}",
            "rebuild the bundle: its head file does not belong to its engines",
        )
    return _Head(table, torch.from_numpy(ids.astype(np.int64)))


def _plain_plan(bundle: Bundle, num_layers: int) -> Any:
    """The plain build's plan, with the bundle's guessing head where its decode graph has one
    (width and vocabulary from the manifest: no file is read to decide what to rebuild)."""
    from adaptive_export.graphs.plan import BuildPlan
    from adaptive_export.runtimes.drafting.eagle import FIELD

    plan = BuildPlan(num_layers=num_layers)
    decode = bundle.manifest.graphs.get("decode_full")
    width = decode.draft_field(FIELD) if decode is not None else 0
    if width and bundle.manifest.draft_vocab is not None:
        plan.draft_fields[FIELD] = width
        plan.draft_vocab = bundle.manifest.draft_vocab.size
    return plan


def _rebuild(bundle: Bundle, model: str, out: Path, repeat_layers: bool) -> Bundle:
    """The plain plan's engines (with the bundle's own guessing head, if any), built from the
    model with the bundle's recorded options; `repeat_layers`: see ExportOptions."""
    from adaptive_export.exporter.build import ExportOptions, build_bundle
    from adaptive_export.graphs.span_graph import ModelParts
    from adaptive_export.loading.lean_model import draft_vocab_rows, load_lean_model
    from adaptive_export.runtimes.bundle import load_bundle
    from adaptive_export.runtimes.drafting.eagle import FIELD

    onnx_entry = bundle.manifest.backends["onnx"]
    loaded = load_lean_model(model)
    assert loaded.weights is not None
    parts = ModelParts(loaded.hf_model, loaded.spec)
    head = _bundle_head(bundle)
    if head is not None:
        parts.draft_tables[FIELD], parts.draft_vocab = head.table, head.ids
        parts.draft_heads[int(head.ids.numel())] = draft_vocab_rows(loaded, head.ids)
    options = ExportOptions(
        output=out,
        max_len=bundle.max_len,
        quantize=onnx_entry.quantize,
        quant_options=dict(onnx_entry.extra.get("quant_options") or {}),
        onnx_flavour=onnx_entry.flavour,
        native_source=loaded.weights.path if onnx_entry.quantize == "native" else None,
        progress=False,
        repeat_layers=repeat_layers,
    )
    build_bundle(loaded, _plain_plan(bundle, loaded.spec.num_layers), options, parts)
    return load_bundle(out)


def _compare_engines(bundle: Bundle, rebuilt: Bundle, seconds: float) -> Iterator[StructureRow]:
    ours, theirs = bundle.manifest.backends["onnx"], rebuilt.manifest.backends["onnx"]
    not_rebuilt, compared = [], {}
    for name, engine in ours.graphs.items():
        if name not in theirs.graphs or bundle.graph(name) != rebuilt.graph(name):
            not_rebuilt.append(name)
            continue
        pair = (engine.file, theirs.graphs[name].file)  # graphs that are one model share a file
        if pair not in compared:
            compared[pair] = engine_difference(bundle, pair[0], rebuilt, pair[1])
        difference = compared[pair]
        yield StructureRow(
            name, difference is None, True, difference or "equal to the engine the model defines", seconds
        )
    if not_rebuilt:
        detail = f"no plain build makes {', '.join(sorted(not_rebuilt))} (routers, drafts): checked by behaviour"
        yield StructureRow("others", True, False, detail, 0.0)


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
