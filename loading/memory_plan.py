"""How much memory a build or a `check` will take, known before it starts.

A build the machine cannot hold used to end in the kernel's OOM killer minutes in (`Killed`,
no error line). The peak follows from the model's dimensions and the path the build takes:
- the streaming build (loading/lean_model.py, exporter/lean_export.py) holds torch, the
  tokenizer and one converted tensor: a base plus a multiple of the largest table;
- the full load (calibration, re-quantization, CoreML/TensorRT) holds the fp32 model, its
  packed copy and each graph's ONNX proto: a multiple of the fp32 weights;
- `check` holds transformers' fp32 reference, loaded from the file, and the bundle's engines.
The coefficients are measured peaks (docs/quantization.md, "What a build costs"), with margin.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from adaptive_export.loading.gguf_header import ARRAY_BYTES_FIELD, ARRAY_ITEMS_FIELD
from adaptive_export.loading.model_checks import fp32_weight_bytes
from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError

GiB = 1 << 30
MiB = 1 << 20
SKIP_VARIABLE = limits.SKIP_MEMORY_CHECK_VARIABLE  # "1": start anyway (the estimate is an upper bound)

# measured peak RSS, 2-core Zen 3 (docs/quantization.md): streaming build SmolLM2 0.94 GB,
# Qwen2.5-Coder-0.5B 1.8 GB, 1.5B see docs; full load 2.4 GB (SmolLM2), 9.1 GB (0.5B)
STREAM_BASE = 800 * MiB
STREAM_PER_TABLE_ELEMENT = 9  # bytes per element of the largest table (vocab x hidden)
FULL_BASE = 400 * MiB
FULL_PER_FP32_BYTE = 4.8  # the fp32 model, its packed copy, the traced proto and its quantization
# calibration (routers, skip/exit adapters) on the fp32 model, then the streaming export
CALIBRATE_PER_FP32_BYTE = 2.0
BuildPath = Literal["stream", "calibrate", "full"]
# check: the fp32 reference model, plus one prepacked copy of its weights per ONNX engine file
# (ONNX Runtime prepacks per session; the decoders' sessions hold them while the reference runs).
# Fit to the measured peaks of Gemma 3's four-engine accuracy-1 bundle (6.4 GB, 2.96 GB of engine
# weights) and the 1.5B's default bundle (11.5 GB); SmolLM2's and the 0.5B's are 1.2-1.4 GB below.
CHECK_BASE = 2000 * MiB
CHECK_PER_FP32_BYTE = 1.35
CHECK_PER_ENGINE_BYTE = 1.0
# a GGUF's metadata arrays outside the tokenizer's (loading/gguf_header.py bounds them): gguf's reader
# and transformers hold each item as Python objects (measured: 16M uint8 items, +3.25 GB), strings too
PER_METADATA_ITEM = 256
PER_METADATA_STRING_BYTE = 4


@dataclass(frozen=True)
class MemoryNeed:
    """What a piece of work will hold at its peak, and how to make it smaller."""

    what: str
    peak_bytes: int
    fix: str


def build_need(fields: Mapping[str, Any], path: BuildPath) -> MemoryNeed:
    """A build's peak from the model's dimensions (HF config names) and its path
    (commands/build.py's `build_path`)."""
    table = fields["vocab_size"] * fields["hidden_size"]
    streamed = STREAM_BASE + STREAM_PER_TABLE_ELEMENT * table + metadata_bytes(fields)
    if path == "stream":
        return MemoryNeed("the build", streamed, "close other programs or build on a machine with more memory")
    fp32 = fp32_weight_bytes(fields, _head_dim(fields))
    if path == "calibrate":  # calibration holds the fp32 model; the export after it streams
        peak = max(FULL_BASE + int(CALIBRATE_PER_FP32_BYTE * fp32) + metadata_bytes(fields), streamed)
        return MemoryNeed("the build", peak, "calibrate on a machine with more memory, or build without calibration")
    peak = FULL_BASE + int(FULL_PER_FP32_BYTE * fp32) + metadata_bytes(fields)
    fix = (
        "build from the .gguf to ONNX Runtime engines at --quantize auto|native|none, without precision drafts, "
        "draft vocabularies or draft heads: that build streams the weights; or use a machine with more memory"
    )
    return MemoryNeed("the build", peak, fix)


def check_need(fields: Mapping[str, Any], engine_bytes: int = 0) -> MemoryNeed:
    """`check`'s peak: transformers' fp32 reference of the model plus the bundle's engines
    (`engine_bytes`: each ONNX engine file's weights, summed over the files)."""
    fp32 = fp32_weight_bytes(fields, _head_dim(fields))
    peak = CHECK_BASE + int(CHECK_PER_FP32_BYTE * fp32 + CHECK_PER_ENGINE_BYTE * engine_bytes) + metadata_bytes(fields)
    what = "check (the fp32 reference model and each engine file's prepacked weights)"
    return MemoryNeed(what, peak, "run check on a machine with more memory")


def engine_file_bytes(manifest: Any) -> int:
    """The weights each ONNX engine file reads (its initializers in the tensor table), summed over
    the files: one prepacked copy per session. 0 for a bundle without onnx engines."""
    backend = manifest.backends.get("onnx")
    if backend is None:
        return 0
    per_file: dict[str, int] = {}
    for engine in backend.graphs.values():
        names = engine.initializers or ()
        per_file[engine.file or ""] = sum(backend.tensors[n].bytes for n in names if n in backend.tensors)
    return sum(per_file.values())


def metadata_bytes(fields: Mapping[str, Any]) -> int:
    """What a GGUF's metadata arrays outside the tokenizer's add to a load (0 for config.json models)."""
    items, string_bytes = fields.get(ARRAY_ITEMS_FIELD) or 0, fields.get(ARRAY_BYTES_FIELD) or 0
    return PER_METADATA_ITEM * int(items) + PER_METADATA_STRING_BYTE * int(string_bytes)


def _head_dim(fields: Mapping[str, Any]) -> int:
    return int(fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"])


def ensure_fits(need: MemoryNeed) -> None:
    """Refuse work the machine cannot hold, before it starts (set ADAPTIVE_EXPORT_SKIP_MEMORY_CHECK=1
    to try anyway)."""
    if os.environ.get(SKIP_VARIABLE) == "1":
        return
    available = limits.available_memory()
    if available is not None and need.peak_bytes > available:
        raise UsageError(
            f"{need.what} needs about {need.peak_bytes / GiB:.1f} GiB of memory at its peak, "
            f"and {available / GiB:.1f} GiB are available",
            f"{need.fix} (or set {SKIP_VARIABLE}=1 to start anyway)",
        )
