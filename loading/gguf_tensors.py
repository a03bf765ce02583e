"""A checked .gguf's tensors as read-only views of the file, without gguf's reader.

`--quantize native` needs the quantized blocks and three scalars (architecture, head counts).
gguf's GGUFReader parses every metadata array item by item first: 18.8 s for Gemma 3's
262k-token vocabulary, 3.7 s for SmolLM2's 49k, per build. The header check
(loading/gguf_header.py) already walks every tensor's name, shape, type and extent, so the
blocks are read through it: one mapping, checked before any byte of tensor data is used.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.loading.gguf_header import GGUFHeader, map_gguf
from adaptive_export.runtimes.errors import UsageError

# GGML type -> byte offsets of the fp16 scales in one block (d; and dmin / m where the type has a min)
SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


@dataclass(frozen=True)
class MappedTensor:
    """One tensor as exporter/gguf_native.py reads it (the fields of gguf's ReaderTensor it uses)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    data: np.ndarray  # its bytes, uint8, a read-only view of the file


class MappedGGUF:
    """The tensors and scalar metadata of a checked .gguf file, mapped read-only."""

    def __init__(self, path: Path) -> None:
        import gguf

        header, data = map_gguf(path)
        self.metadata: dict[str, Any] = header.metadata
        self.tensors = [
            MappedTensor(t.name, gguf.GGMLQuantizationType(t.kind), t.dims, data[t.start : t.start + t.size])
            for t in header.tensors
        ]
        self._extents = {t.name: (t.start, t.size) for t in header.tensors}
        view = data.base  # np.frombuffer keeps a memoryview of the mmap
        self._mapping = getattr(view, "obj", None) if isinstance(view, memoryview) else None

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's resident memory once it has been converted: the
        file stays mapped (a later read faults them in again), but a build's peak RSS does not grow by
        the whole file (1.1 GB for Qwen2.5-Coder-1.5B) while it streams the tensors one by one."""
        if not isinstance(self._mapping, mmap.mmap) or name not in self._extents or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, size = self._extents[name]
        first = start - start % mmap.PAGESIZE  # a read-only file mapping: a dropped page is read again on
        self._mapping.madvise(mmap.MADV_DONTNEED, first, start + size - first)  # its next touch


def check_block_scales(header: GGUFHeader, data: np.ndarray, path: Path) -> None:
    """Every block's fp16 scales finite, vectorised per tensor: a NaN or infinite scale makes its
    whole block NaN, which transformers and the native conversion both carry into the bundle, and
    every `run` then refuses the logits. Refused here, naming the tensor, before anything loads."""
    import gguf

    for tensor in header.tensors:
        kind = gguf.GGMLQuantizationType(tensor.kind)
        offsets = SCALE_OFFSETS.get(kind.name, ())
        if not offsets:
            continue
        blocks = data[tensor.start : tensor.start + tensor.size].reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
        for offset in offsets:
            scales = np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16).ravel()
            bad = np.flatnonzero(~np.isfinite(scales))
            if bad.size:
                raise UsageError(
                    f"GGUF tensor {tensor.name!r} of {str(path)!r} has a non-finite block scale"
                    f" ({scales[bad[0]]} in block {bad[0]}, {bad.size} blocks in all)",
                    "pass an intact .gguf file (a NaN or infinite scale turns its block, and the logits, into NaN)",
                )
