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

from adaptive_export.loading.gguf_header import map_gguf


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
