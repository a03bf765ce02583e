"""One parse of a .gguf file per model load, and a fast one.

gguf's GGUFReader walks every metadata array item by item: 3.7 s on SmolLM2's 49k-token
vocabulary, 19 s on Gemma 3's 262k (Zen 3); inside the block transformers gets the reader of
loading/gguf_fast_reader.py, the same fields 10-15x sooner. transformers parses the file four
times to load one model (the config twice, the tokenizer, the weights), so a Gemma 3 load spent over a
minute re-reading one vocabulary; and it rebuilds gguf's tensor-name table once per module
(397 times for SmolLM2, 13 ms each). Inside `one_parse_per_file()` each reader of an unchanged
file (path, size, mtime) is the first one, and each name table is built once. Sharing is safe:
a reader is a read-only memory map (mode "r") and a name table a lookup, which transformers
only reads. Both are dropped when the block ends (a parsed 262k vocabulary is about 700 MB of
Python objects).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal


@contextmanager
def one_parse_per_file() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` and `gguf.get_tensor_name_map(arch, n)` (what
    transformers calls, looking both up at each call) compute each answer once."""
    import gguf

    from adaptive_export.loading.gguf_fast_reader import ArrayFastReader

    original_reader, original_names = gguf.GGUFReader, gguf.get_tensor_name_map
    if getattr(original_reader, "shares_parses", False):  # nested: the outer block already shares
        yield
        return
    readers: dict[tuple[str, int, int], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
        if mode != "r":
            return original_reader(path, mode)
        info = os.stat(path)
        key = (os.fspath(path), info.st_size, info.st_mtime_ns)
        if key not in readers:
            readers[key] = ArrayFastReader(path, mode)
        return readers[key]

    shared_reader.shares_parses = True  # type: ignore[attr-defined]
    gguf.GGUFReader = shared_reader  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.cache(original_names)
    try:
        yield
    finally:
        gguf.GGUFReader = original_reader  # type: ignore[misc]
        gguf.get_tensor_name_map = original_names
        readers.clear()
