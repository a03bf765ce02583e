"""Trace one SpanGraph to an ONNX ModelProto with T (new tokens) and P (past length) dynamic."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import onnx
import torch

from adaptive_export.exporter.graph_entry import manifest_graph
from adaptive_export.graphs.fused_graph import FusedSpanGraph, PackedWeights
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts, SpanGraph

OPSET = 18
# Example sizes for tracing only; the exported graph is generic in T and P. They avoid
# 0 and 1, which torch.export would specialise on.
_EXAMPLE_T, _EXAMPLE_P = 3, 5
MAX_DIM = 1 << 16
# onnxscript's default rewrite rules that torch.onnx.export's optimizer tries on every node, left
# out: SlicesSplit (two Slices of one input -> Split) matches a two-output pattern, which took 12.7
# to 17.4 s per pass over SmolLM2's portable decode graph (Zen 3), half its export, and fired on
# none of the graphs this project exports (tests/test_onnx_export_rules.py compares the graphs).
SKIPPED_REWRITES = ("SlicesSplit",)


def _example_inputs(parts: ModelParts, graph: GraphSpec) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    spec = parts.spec
    if graph.source == "ids":
        first = torch.zeros(1, _EXAMPLE_T, dtype=torch.int64)
    else:
        first = torch.zeros(1, _EXAMPLE_T, spec.hidden_size)
    past = tuple(torch.zeros(_EXAMPLE_P, spec.num_kv_heads, spec.head_dim) for _ in range(2 * len(graph.layers)))
    return first, past


def _fused_inputs(
    parts: ModelParts, graph: GraphSpec, max_len: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    spec = parts.spec
    first, _ = _example_inputs(parts, graph)
    control = (
        torch.arange(_EXAMPLE_T, dtype=torch.int64),
        torch.tensor([_EXAMPLE_P + _EXAMPLE_T - 1], dtype=torch.int32),
        torch.tensor(_EXAMPLE_P + _EXAMPLE_T, dtype=torch.int32),
    )
    past = tuple(torch.zeros(1, spec.num_kv_heads, max_len, spec.head_dim) for _ in range(2 * len(graph.layers)))
    return (first, *control), past


def export_graph(parts: ModelParts, graph: GraphSpec, packed: PackedWeights | None = None) -> onnx.ModelProto:
    """The graph as an ONNX model with its weights inside (see `trace_graph`)."""
    return trace_graph(parts, graph, packed).model_proto


def trace_graph(parts: ModelParts, graph: GraphSpec, packed: PackedWeights | None = None) -> Any:
    """Export with torch.export (dynamo), the exporter that keeps parameter names stable; returns
    torch's ONNXProgram (its `model` is the onnx_ir model, FakeTensor weights still unread).

    The "ort" flavour needs the build's PackedWeights and translates graphs/ort_ops.py to
    ONNX Runtime's fused contrib ops; the portable flavour uses standard ops only.
    """
    tokens = torch.export.Dim("T", min=1, max=MAX_DIM)
    translations = None
    if graph.flavour == "ort":
        from adaptive_export.exporter.ort_translations import translation_table

        if packed is None:
            raise ValueError("the ort flavour needs the build's PackedWeights")
        module: torch.nn.Module = FusedSpanGraph(parts, graph, packed).eval()
        leading, past = _fused_inputs(parts, graph, packed.max_len)
        rows = torch.export.Dim("R", min=1, max=MAX_DIM)
        dynamic_shapes = ({1: tokens}, {0: rows}, {}, {}, tuple({} for _ in past))
        translations = translation_table()
    else:
        module = SpanGraph(parts, graph).eval()
        first, past = _example_inputs(parts, graph)
        leading = (first,)
        past_len = torch.export.Dim("P", min=0, max=MAX_DIM)
        dynamic_shapes = ({1: tokens}, tuple({0: past_len} for _ in past))
    entry = manifest_graph(graph)  # the I/O names the manifest lists and the runtime binds
    quiet = io.StringIO()
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(quiet), without_slow_rewrites():
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        program = torch.onnx.export(
            module,
            (*leading, *past),
            input_names=list(entry.inputs),
            output_names=list(entry.outputs),
            dynamic_shapes=dynamic_shapes,
            opset_version=OPSET,
            dynamo=True,
            external_data=False,
            verbose=False,
            custom_translation_table=translations,
        )
    return program


@contextlib.contextmanager
def without_slow_rewrites() -> Iterator[None]:
    """Within the block, the optimizer's default rule set lacks SKIPPED_REWRITES (the module-level
    tuple that onnxscript.optimizer.optimize_ir reads at each call)."""
    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:  # a later onnxscript: its own rule set, untouched
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) not in SKIPPED_REWRITES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules
