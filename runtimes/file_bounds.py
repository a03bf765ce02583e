"""Every listed file's size checked against what the model's dimensions imply, before any is hashed.

Hashing is the costly part of loading (about 1 s per 500 MB), and a file's size is free to read,
so a bundle is refused on sizes first: a 0.8 MB bundle listing four sparse 16 GiB files used to
make `run` hash 64 GiB (66 s) before it said anything. Rules (docs/hardening.md, "Files"):

- the declared size of each listed file is at most its kind's cap: the weights file a factor
  of the fp32 bytes the model's dimensions imply, an engine or another per-backend file no
  more than the weights may be, tokenizer.json, calibration.json and draft_vocab.bin fixed caps;
- the declared sizes together are at most the bundle's cap (every backend a copy of the weights);
- a file on disk with far fewer allocated blocks than its size (a sparse file) is refused.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import Manifest, ModelDims

_FIX = "rebuild the bundle with `adaptive-export build`; a bundle holds only the files its model needs"


def implied_weight_bytes(model: ModelDims) -> int:
    """fp32 bytes of a decoder with these dimensions: untied embedding and head, attention, a gated MLP."""
    hidden, layers = model.hidden_size, model.num_layers
    intermediate = model.extra.get("intermediate_size")
    if not isinstance(intermediate, int) or not 0 < intermediate <= limits.MAX_INTERMEDIATE:
        intermediate = 4 * hidden
    attention = hidden * model.head_dim * (2 * model.num_heads + 2 * model.num_kv_heads)
    per_layer = attention + 3 * hidden * intermediate + 4 * hidden
    return 4 * (2 * model.vocab_size * hidden + layers * per_layer)


def weights_cap(model: ModelDims) -> int:
    """The largest weights file these dimensions allow (draft heads, adapters and precision copies included)."""
    return limits.WEIGHTS_SIZE_FACTOR * implied_weight_bytes(model) + limits.WEIGHTS_SIZE_SLACK


def file_caps(manifest: Manifest) -> dict[str, int]:
    """Each listed file's cap, by what the manifest says the file is (anything else: the weights cap)."""
    cap = weights_cap(manifest.model)
    caps = dict.fromkeys(manifest.files, cap)
    caps[manifest.tokenizer.file] = limits.MAX_TOKENIZER_JSON_BYTES
    if manifest.calibration is not None:
        caps[manifest.calibration] = limits.MAX_CALIBRATION_BYTES
    if manifest.draft_vocab is not None:
        caps[manifest.draft_vocab.file] = 4 * manifest.model.vocab_size
    for backend in manifest.backends.values():
        for engine in backend.graphs.values():
            if engine.file is not None and engine.file.endswith(".onnx"):
                caps[engine.file] = min(limits.MAX_ENGINE_BYTES, cap)
    return {name: size for name, size in caps.items() if name in manifest.files}


def check_declared_sizes(manifest: Manifest) -> None:
    """Refuse on the manifest alone: no file opened, nothing hashed."""
    caps = file_caps(manifest)
    for name, entry in manifest.files.items():
        if entry.bytes > caps[name]:
            raise UsageError(
                f"bundle file {name!r} is declared with {entry.bytes} bytes, more than the {caps[name]} "
                f"its model's dimensions allow",
                _FIX,
            )
    total = sum(entry.bytes for entry in manifest.files.values())
    bundle_cap = (1 + len(manifest.backends)) * weights_cap(manifest.model) + limits.MAX_TOKENIZER_JSON_BYTES
    if total > bundle_cap:
        raise UsageError(
            f"the bundle's files are declared with {total} bytes in all, more than the {bundle_cap} "
            f"its model's dimensions allow",
            _FIX,
        )


def check_sparse(name: str, path: Path) -> None:
    """A regular file whose allocated blocks cover far less than its size reads as zeros for free:
    refused before it is hashed. (Missing and non-regular files are left to the checksum pass.)"""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISREG(info.st_mode) or info.st_size < limits.SPARSE_MIN_BYTES:
        return
    allocated = info.st_blocks * 512
    if allocated * limits.SPARSE_MAX_RATIO < info.st_size:
        raise UsageError(
            f"bundle file {name!r} is sparse ({info.st_size} bytes, {allocated} allocated on disk)",
            "copy the bundle without holes (e.g. `cp --sparse=never`) or rebuild it",
        )


def check_file_sizes(manifest: Manifest, path_of: Callable[[str], Path]) -> None:
    """Sizes first, for every listed file, before any file is hashed."""
    check_declared_sizes(manifest)
    for name in manifest.files:
        check_sparse(name, path_of(name))
