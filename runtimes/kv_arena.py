"""The one KV cache every engine shares (DESIGN.md section 4).

One preallocated block [layers, 2, max_len, n_kv_heads, head_dim]: per layer a K and a V
arena, sequence-major. Engines read zero-copy prefix views [0:length] and their new rows
are written once, in place, at [length:length+T]. Rejecting speculative rows is just
`length = accepted`; nothing is copied or freed.
"""
from __future__ import annotations

import numpy as np

from runtimes.errors import UsageError
from runtimes.limits import check_arena_bytes


class KVArena:
    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: type = np.float32) -> None:
        shape = (num_layers, 2, max_len, num_kv_heads, head_dim)
        check_arena_bytes(int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize)  # before any allocation
        self.data = np.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # rows [0:length] hold valid KV for every layer the sequence uses

    def prefix(self, layer: int, kv: int, length: int | None = None) -> np.ndarray:
        """Zero-copy view of rows [0:length] (a contiguous slice of the arena)."""
        return self.data[layer, kv, : self.length if length is None else length]

    def rows(self, layer: int, kv: int, start: int, count: int) -> np.ndarray:
        """Zero-copy view where an engine writes `count` new rows starting at `start`."""
        if start + count > self.max_len:
            raise UsageError(f"the sequence needs {start + count} positions but the bundle's max_len is {self.max_len}",
                             "ask for fewer new tokens, shorten the prompt, or rebuild with a larger --max-len")
        return self.data[layer, kv, start : start + count]

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)
