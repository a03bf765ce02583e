"""One read of a .gguf's config and tokenizer per `check`.

`check` loads the model it is given twice: the streaming rebuild of the engines
(exporter/check_structure.py), then the fp32 reference (loading/artifacts.py load_parts); on
Gemma 3 the reference load tries the streamed path first, a third. Each load asked transformers
for the config and the tokenizer, and transformers parses the file's whole metadata for each:
20 s for the config and 6.5 s for the tokenizer of Qwen2.5-Coder-0.5B (Zen 3), half of a 128 s
`check`. Inside `model_headers_read_once()` each is read once per unchanged file (path, size,
mtime). A config is handed out as a fresh copy (building a model writes into its config); a
tokenizer is only read, so it is shared. Both are dropped when the block ends.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_results: dict[tuple[str, str, int, int], Any] | None = None  # (what, file, size, mtime_ns) -> what was read


@contextmanager
def model_headers_read_once() -> Iterator[None]:
    """Within the block, `read_once` reads each (what, file) once; nested blocks share the outer one."""
    global _results
    if _results is not None:
        yield
        return
    _results = {}
    try:
        yield
    finally:
        _results = None


def read_once(what: str, path: Path, read: Callable[[], T], shared: bool = False) -> T:
    """`read()`, or inside the block the first read's result for this unchanged file: that very
    object when `shared`, else a deep copy (the cache keeps the one it read untouched)."""
    if _results is None:
        return read()
    info = path.stat()
    key = (what, os.fspath(path), info.st_size, info.st_mtime_ns)
    if key not in _results:
        _results[key] = read()
    return _results[key] if shared else copy.deepcopy(_results[key])
