"""The one KV cache every engine shares (docs/architecture.md section 4).

One preallocated block per layer for K and one for V; engines read the rows [0:length]
and write their T new rows once, in place, at [length:length+T]. Rejecting speculative
rows is just `length = accepted`; nothing is copied or freed. Two layouts, one contract:
- "seq" [layers, 2, max_len, n_kv, head_dim]: portable engines read a zero-copy prefix
  view and return the new rows, which are written at [length:length+T];
- "head" [layers, 2, 1, n_kv, max_len, head_dim]: ONNX Runtime's GroupQueryAttention
  binds each layer's block as both past and present and writes the new rows itself.
`seq_view` gives either layout as [max_len, n_kv, head_dim] (a strided view for "head"),
so code that inspects or fills the cache (check, tests) does not depend on the layout.
"""

from __future__ import annotations

import mmap

import numpy as np

from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.limits import check_arena_bytes

LAYOUTS = ("seq", "head")


def _zeroed_pages(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled array on its own anonymous mapping of small pages. numpy asks for
    transparent huge pages on large arrays, and then the first row written into each 2 MB
    region makes all of it resident: SmolLM2's 94 MB arena was fully resident after one
    token. With 4 KB pages only the rows in use are (a few MB for a short chat)."""
    size = int(np.prod(shape)) * dtype.itemsize
    if size == 0:
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, size), dtype=dtype).reshape(shape)


class KVArena:
    def __init__(
        self,
        num_layers: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: type = np.float32,
        layout: str = "seq",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}")
        shape = (max_len, num_kv_heads, head_dim) if layout == "seq" else (1, num_kv_heads, max_len, head_dim)
        check_arena_bytes(
            int(np.prod((num_layers, 2, *shape), dtype=object)) * np.dtype(dtype).itemsize
        )  # before any allocation
        self.data = _zeroed_pages((num_layers, 2, *shape), np.dtype(dtype))
        self.layout = layout
        self.max_len = max_len
        self.length = 0  # rows [0:length] hold valid KV for every layer the sequence uses

    def block(self, layer: int, kv: int) -> np.ndarray:
        """The whole preallocated block of one layer's K (kv=0) or V (kv=1), in the arena's layout."""
        return self.data[layer, kv]

    def seq_view(self, layer: int, kv: int) -> np.ndarray:
        """[max_len, n_kv, head_dim] view of one block, whatever the layout (zero-copy)."""
        block = self.data[layer, kv]
        return block if self.layout == "seq" else block[0].transpose(1, 0, 2)

    def prefix(self, layer: int, kv: int, length: int | None = None) -> np.ndarray:
        """Zero-copy view of rows [0:length] (contiguous in the "seq" layout)."""
        return self.seq_view(layer, kv)[: self.length if length is None else length]

    def check_room(self, start: int, count: int) -> None:
        if start + count > self.max_len:
            raise UsageError(
                f"the sequence needs {start + count} positions but the bundle's max_len is {self.max_len}",
                "ask for fewer new tokens, shorten the prompt, or rebuild with a larger --max-len",
            )

    def rows(self, layer: int, kv: int, start: int, count: int) -> np.ndarray:
        """Zero-copy view where an engine writes `count` new rows starting at `start`."""
        self.check_room(start, count)
        return self.seq_view(layer, kv)[start : start + count]

    def valid_rows(self, length: int | None = None) -> np.ndarray:
        """A copy of rows [0:length] of every layer as [layers, 2, length, n_kv, head_dim]."""
        length = self.length if length is None else length
        return np.stack(
            [np.stack([self.seq_view(layer, kv)[:length] for kv in (0, 1)]) for layer in range(self.data.shape[0])]
        )

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)
