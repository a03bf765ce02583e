"""CoreML: every graph of the plan as one function of a single multifunction .mlpackage.

KV as explicit inputs and outputs (not ct.StateType): each function reads past K/V prefixes
[P, n_kv, head_dim] (P flexible via RangeDim) and returns the T new rows, which is the
arena contract itself, so one arena owned by the runtime serves every function, exactly as
on ONNX Runtime. State buffers would live inside each function (one cache per engine,
fixed size) and break "one KV cache whatever the number of engines". The cost is a copy of
the prefix per call on device; measure on macOS before switching.

Weights: functions are converted separately from the same torch parameters and merged with
`ct.utils.save_multifunction`, which stores identical weights once (measured in tests).
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from tqdm import tqdm

from adaptive_export.exporter.graph_entry import manifest_graph
from adaptive_export.graphs.plan import BuildPlan
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts, SpanGraph
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import Manifest

PACKAGE = "coreml/model.mlpackage"
PRECISIONS = ("float16", "float32")


def _import_coremltools() -> Any:
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import coremltools
    except ImportError as exc:
        raise UsageError(
            "the coreml backend needs coremltools, which is not installed", "run `pip install adaptive-export[coreml]`"
        ) from exc
    return coremltools


def convert_graph(ct: Any, parts: ModelParts, graph: GraphSpec, max_len: int, precision: str) -> Any:
    import numpy as np
    import torch

    spec = parts.spec
    module = SpanGraph(parts, graph).eval()
    first = torch.zeros(1, 3, dtype=torch.int64) if graph.source == "ids" else torch.zeros(1, 3, spec.hidden_size)
    past = tuple(torch.zeros(5, spec.num_kv_heads, spec.head_dim) for _ in range(2 * len(graph.layers)))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(module, (first, *past), check_trace=False)
    tokens = ct.RangeDim(1, max_len, default=1)
    past_len = ct.RangeDim(0, max_len, default=0)
    float_type = np.float16 if precision == "float16" else np.float32
    entry = manifest_graph(graph)  # the I/O names the manifest lists
    first_input = (
        ct.TensorType(name="input_ids", shape=(1, tokens), dtype=np.int32)
        if graph.source == "ids"
        else ct.TensorType(name="exit_hidden", shape=(1, tokens, spec.hidden_size), dtype=float_type)
    )
    inputs = [first_input] + [
        ct.TensorType(name=n, shape=(past_len, spec.num_kv_heads, spec.head_dim), dtype=float_type)
        for n in entry.inputs[1:]
    ]
    outputs = [ct.TensorType(name=n) for n in entry.outputs]
    return ct.convert(
        traced,
        inputs=inputs,
        outputs=outputs,
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT16 if precision == "float16" else ct.precision.FLOAT32,
        minimum_deployment_target=ct.target.macOS15,
    )


def compile_coreml(
    root: Path,
    manifest: Manifest,
    parts: ModelParts,
    plan: BuildPlan,
    precision: str = "float16",
    progress: bool = True,
) -> dict[str, Any]:
    if precision not in PRECISIONS:
        raise UsageError(f"CoreML precision {precision!r} is unknown", f"choose one of: {', '.join(PRECISIONS)}")
    ct = _import_coremltools()
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    graphs = plan.graphs()
    scratch = Path(tempfile.mkdtemp(prefix="coreml-", dir=root))
    try:
        descriptor = ct.utils.MultiFunctionDescriptor()
        for graph in tqdm(graphs, desc="convert CoreML", unit="function", disable=not progress):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                model = convert_graph(ct, parts, graph, manifest.max_len, precision)
            path = scratch / f"{graph.name}.mlpackage"
            model.save(str(path))
            descriptor.add_function(str(path), src_function_name="main", target_function_name=graph.name)
        descriptor.default_function_name = "prefill"
        (root / "coreml").mkdir()
        ct.utils.save_multifunction(descriptor, str(root / PACKAGE))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "package": PACKAGE,
        "precision": precision,
        "kv": "explicit inputs/outputs (arena contract), not state",
        # portable I/O (KV prefix in, new rows out), whatever flavour the onnx engines have
        "graphs": {
            e.name: {"function": e.name, "inputs": list(e.inputs), "outputs": list(e.outputs)}
            for e in map(manifest_graph, graphs)
        },
    }
