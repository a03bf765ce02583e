"""TensorRT: static compatibility check at build time, engines built where TensorRT runs.

TensorRT engines are specific to a GPU model and TensorRT version, so a portable bundle
ships the checked ONNX graphs and the build profile; `runtimes/backends/tensorrt_backend.py`
builds each engine on the target on first use and caches it under a key of GPU name,
compute capability and TensorRT version. Engines are built weight-stripped
(BuilderFlag.STRIP_PLAN, TensorRT 10) and refitted from the bundle's own ONNX weights when
loaded, so weights stay stored once: in onnx/weights.bin. When `tensorrt` is importable at
build time the engines are also built now, into the cache, so the first run is fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptive_export.exporter.trt_compat import check_bundle
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import Manifest

PRECISIONS = ("fp32", "fp16", "int8")


def compile_tensorrt(root: Path, manifest: Manifest, precision: str = "fp16") -> dict[str, Any]:
    if precision not in PRECISIONS:
        raise UsageError(f"TensorRT precision {precision!r} is unknown", f"choose one of: {', '.join(PRECISIONS)}")
    onnx_entry = manifest.backends["onnx"]
    if onnx_entry.quantize != "none":
        raise UsageError(
            "TensorRT engines are built from fp32 ONNX graphs, but this build quantizes them (MatMulNBits)",
            "build the tensorrt backend without --quantize and pick --trt-precision fp16 or int8",
        )
    reports = check_bundle(root, onnx_entry.to_json())
    bad = [r for r in reports if not r.ok]
    if bad:
        raise UsageError(
            f"graph {bad[0].graph!r} cannot be parsed by TensorRT: {bad[0].problems[0]}",
            "build without --backend tensorrt",
        )
    entry: dict[str, Any] = {
        "precision": precision,
        "weights": "stripped engines, refit from onnx/weights.bin at load",
        "compat": {r.graph: {"opset": r.opset, "ops": r.ops} for r in reports},
        "graphs": {name: {"onnx": engine.file} for name, engine in onnx_entry.graphs.items()},
        "built_at_export": False,
    }
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return entry
    from adaptive_export.runtimes.backends.tensorrt_backend import build_engine, engine_cache_dir, plan_name

    cache = engine_cache_dir()
    for name, engine in onnx_entry.graphs.items():
        path = root / (engine.file or "")
        build_engine(path, cache / plan_name(path, name), manifest, precision)
    entry["built_at_export"] = True
    return entry
