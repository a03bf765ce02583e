"""Read and check a GGUF file's header before any GGUF library parses it.

gguf's reader and transformers trust the header's counts and lengths: a truncated or garbled
file ends in whatever exception the first out-of-range read raises, or in a loop over a
count of 2^60. Here every count, length and offset is checked against the file's own size
and the runtime's bounds first (little-endian GGUF v2/v3, the versions gguf reads), each
tensor's data must lie inside the file, and the model's dimensions come out under the HF
config names that loading/model_checks.py checks. docs/hardening.md, "Hostile model files".
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEYS = 1 << 16
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 24  # a chat template or a token; far above any real one
MAX_ARRAY_ITEMS = 1 << 24  # any other metadata array
# every array outside the tokenizer's, together: gguf's reader and transformers turn each item into
# Python objects (about 200 bytes apiece, measured: one 16 MB uint8 array took a SmolLM2 build from
# 0.75 GB to 4.0 GB), so their total is bounded here and priced into the build's memory estimate
MAX_OTHER_ARRAY_ITEMS = 1 << 20  # real files: per-layer head counts, rope sections, a charsmap (~250k)
MAX_OTHER_ARRAY_BYTES = 1 << 26  # their strings' bytes
# the fields loading/model.py's model_fields adds beside the HF names, for loading/memory_plan.py
ARRAY_ITEMS_FIELD, ARRAY_BYTES_FIELD = "gguf_other_array_items", "gguf_other_array_bytes"
# the tokenizer's arrays, bounded by the vocabulary while the header is read: gguf's reader and
# transformers decode every item into Python objects (2^22 token strings: 77 s, 3.6 GB)
TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
MERGES = "tokenizer.ggml.merges"
EMBEDDING = "token_embd.weight"  # ggml dims (hidden, vocabulary)
MAX_DIMS = 4
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# GGUF metadata key (after "<architecture>.") -> the HF config field loading/model_checks.py checks
HF_FIELDS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "feed_forward_length": "intermediate_size",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
    "vocab_size": "vocab_size",
}
# what transformers reads as head_dim beside them, per architecture (integrations/ggml.py's mapping)
ARCH_HF_FIELDS = {"llama": {"rope.dimension_count": "head_dim"}, "mistral": {"rope.dimension_count": "head_dim"}}


class _Truncated(Exception):
    """A read past the end of the file."""


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's data lies in the file, as the checked header gives it."""

    name: str
    dims: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    kind: int  # GGMLQuantizationType
    start: int  # absolute byte offset in the file
    size: int  # bytes


@dataclass(frozen=True)
class GGUFHeader:
    """What the header says: scalar metadata, the length of each array, and the tensors."""

    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[TensorLocation, ...]  # in file order
    other_array_items: int = 0  # items of every array outside the tokenizer's, nested ones included
    other_array_bytes: int = 0  # ... and their strings' bytes

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    @property
    def tensor_types(self) -> tuple[int, ...]:
        """Each tensor's GGMLQuantizationType, in file order."""
        return tuple(t.kind for t in self.tensors)

    def has_quantized_tensors(self) -> bool:
        """Whether any tensor is stored in a quantized format (a grid a build can keep), not F32/F16/BF16."""
        import gguf

        floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
        return any(kind not in floats for kind in self.tensor_types)

    def hf_fields(self) -> dict[str, Any]:
        """The model's dimensions under HF config names (vocab_size from the token list when absent)."""
        arch = self.metadata.get("general.architecture")
        names = HF_FIELDS | ARCH_HF_FIELDS.get(str(arch), {})
        fields = {hf: self.metadata[f"{arch}.{key}"] for key, hf in names.items() if f"{arch}.{key}" in self.metadata}
        if "vocab_size" not in fields and "tokenizer.ggml.tokens" in self.array_lengths:
            fields["vocab_size"] = self.array_lengths["tokenizer.ggml.tokens"]
        return fields

    def sizing_fields(self) -> dict[str, Any]:
        """hf_fields and what the arrays outside the tokenizer's add to a load (loading/memory_plan.py)."""
        return self.hf_fields() | {ARRAY_ITEMS_FIELD: self.other_array_items, ARRAY_BYTES_FIELD: self.other_array_bytes}


class _Cursor:
    """Bounded little-endian reads over the mapped file."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise _Truncated
        self.at += size
        return self.data[self.at - size : self.at]

    def skip(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise _Truncated
        self.at += size

    def number(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int, what: str) -> str:
        size = self.number("<Q")
        if size > limit:
            raise ValueError(f"{what} is {size} bytes long (at most {limit})")
        return self.take(size).decode("utf-8", errors="replace")


@dataclass
class _Tally:
    """What the arrays outside the tokenizer's add up to so far (items, string bytes)."""

    items: int = 0
    string_bytes: int = 0

    def add(self, key: str, items: int, string_bytes: int = 0) -> None:
        if key in TOKEN_ARRAYS or key == MERGES:
            return
        self.items += items
        self.string_bytes += string_bytes
        if self.items > MAX_OTHER_ARRAY_ITEMS or self.string_bytes > MAX_OTHER_ARRAY_BYTES:
            raise ValueError(
                f"metadata array {key!r} brings the arrays outside the tokenizer's to {self.items} items and "
                f"{self.string_bytes} bytes of strings (at most {MAX_OTHER_ARRAY_ITEMS} items and "
                f"{MAX_OTHER_ARRAY_BYTES} bytes in all)"
            )


def _value(cursor: _Cursor, kind: int, key: str, tally: _Tally, depth: int = 0) -> tuple[Any, int | None]:
    """(scalar value or None for an array, array length or None)."""
    if kind in SCALARS:
        return cursor.number(SCALARS[kind]), None
    if kind == STRING:
        return cursor.string(MAX_STRING_BYTES, f"the value of {key!r}"), None
    if kind != ARRAY or depth > 1:
        raise ValueError(f"metadata {key!r} has an unknown value type {kind}")
    item_kind, count = cursor.number("<I"), cursor.number("<Q")
    cap = _array_cap(key) if depth == 0 else MAX_ARRAY_ITEMS
    if count > cap:
        raise ValueError(f"metadata array {key!r} has {count} items (at most {cap})")
    tally.add(key, count)
    if item_kind in SCALARS:
        cursor.skip(count * struct.calcsize(SCALARS[item_kind]))
    elif item_kind == STRING:  # token lists: skipped, not decoded
        start = cursor.at
        _skip_strings(cursor, count, key)
        tally.add(key, 0, cursor.at - start - 8 * count)
    else:
        for _ in range(count):
            _value(cursor, item_kind, key, tally, depth + 1)
    return None, count


def _array_cap(key: str) -> int:
    """The most items a top-level metadata array may hold, before the vocabulary is known."""
    if key in TOKEN_ARRAYS:
        return limits.MAX_VOCAB
    if key == MERGES:
        return limits.MAX_MERGES_PER_TOKEN * limits.MAX_VOCAB
    return MAX_ARRAY_ITEMS


def _skip_strings(cursor: _Cursor, count: int, key: str) -> None:
    """Step over `count` length-prefixed strings without copying them (2^21 tokens: about a second)."""
    data, at, end, unpack = cursor.data, cursor.at, len(cursor.data), struct.Struct("<Q").unpack_from
    for _ in range(count):
        if at + 8 > end:
            raise _Truncated
        size = unpack(data, at)[0]
        if size > MAX_STRING_BYTES:
            raise ValueError(f"an item of {key!r} is {size} bytes long (at most {MAX_STRING_BYTES})")
        at += 8 + size
    if at > end:
        raise _Truncated
    cursor.at = at


def _check_vocabulary_arrays(
    metadata: dict[str, Any], lengths: dict[str, int], tensors: tuple[TensorLocation, ...]
) -> None:
    """The tokenizer's arrays no longer than the vocabulary the file declares (its `<arch>.vocab_size`
    and its embedding's rows, the smaller; else the token list): a small model with millions of
    token strings is refused here, before any library decodes them."""
    declared = [metadata.get(f"{metadata.get('general.architecture')}.vocab_size")]
    declared += [t.dims[1] for t in tensors if t.name == EMBEDDING and len(t.dims) >= 2]
    sizes = [v for v in declared if isinstance(v, int) and not isinstance(v, bool)]
    vocab = min(sizes) if sizes else lengths.get(TOKEN_ARRAYS[0], 0)
    bounds = {key: vocab for key in TOKEN_ARRAYS} | {MERGES: limits.MAX_MERGES_PER_TOKEN * vocab}
    for key, bound in bounds.items():
        if lengths.get(key, 0) > bound:
            raise ValueError(
                f"metadata array {key!r} has {lengths[key]} items, more than its vocabulary of {vocab} tokens allows"
            )


def _metadata(cursor: _Cursor, count: int, tally: _Tally) -> tuple[dict[str, Any], dict[str, int]]:
    values: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(count):
        key = cursor.string(MAX_KEY_BYTES, "a metadata key")
        if key in values or key in lengths:
            raise ValueError(f"metadata key {key!r} appears twice")
        value, length = _value(cursor, cursor.number("<I"), key, tally)
        if length is None:
            values[key] = value
        else:
            lengths[key] = length
    return values, lengths


def _tensors(cursor: _Cursor, count: int, alignment: int, file_size: int) -> tuple[TensorLocation, ...]:
    """Every tensor's name, shape and type, and its data inside the file."""
    import gguf

    infos, names = [], set()
    for _ in range(count):
        name = cursor.string(MAX_KEY_BYTES, "a tensor name")
        n_dims = cursor.number("<I")
        if name in names or not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} is repeated or has {n_dims} dimensions")
        names.add(name)
        dims = [cursor.number("<Q") for _ in range(n_dims)]
        kind, offset = cursor.number("<I"), cursor.number("<Q")
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has an unknown type {kind}") from None
        elements = 1
        for dim in dims:
            elements *= dim
        if not all(dims) or dims[0] % block or offset % alignment:
            raise ValueError(f"tensor {name!r} has shape {dims} or offset {offset} its type cannot hold")
        infos.append((name, tuple(dims), kind, offset, elements // block * block_bytes))
    start = -(-cursor.at // alignment) * alignment
    for name, _, _, offset, size in infos:
        if start + offset + size > file_size:
            raise ValueError(f"the data of tensor {name!r} lies past the end of the file (truncated?)")
    return tuple(TensorLocation(name, dims, kind, start + offset, size) for name, dims, kind, offset, size in infos)


def _parse(data: mmap.mmap) -> GGUFHeader:
    cursor = _Cursor(data)
    if cursor.take(4) != MAGIC:
        raise ValueError("it does not start with the GGUF magic bytes")
    version = cursor.number("<I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not one of {VERSIONS} (little-endian)")
    tensor_count, key_count = cursor.number("<Q"), cursor.number("<Q")
    if tensor_count > limits.MAX_TENSORS or key_count > MAX_KEYS:
        raise ValueError(f"it claims {tensor_count} tensors and {key_count} metadata keys")
    tally = _Tally()
    metadata, lengths = _metadata(cursor, key_count, tally)
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or not 1 <= alignment <= 1 << 16:
        raise ValueError(f"general.alignment {alignment!r} is not in 1..65536")
    tensors = _tensors(cursor, tensor_count, alignment, len(data))
    _check_vocabulary_arrays(metadata, lengths, tensors)
    return GGUFHeader(version, metadata, lengths, tensors, tally.items, tally.string_bytes)


def read_gguf_header(path: Path) -> GGUFHeader:
    """The checked header of a .gguf file; a UsageError naming the problem otherwise."""
    header, data = _checked_mapping(path)
    data.close()
    return header


def map_gguf(path: Path) -> tuple[GGUFHeader, np.ndarray]:
    """The checked header and the whole file as a read-only byte array, from one mapping: the
    tensors read through it are the bytes the check saw, even if the path is replaced later."""
    header, data = _checked_mapping(path)
    return header, np.frombuffer(data, np.uint8)  # the array keeps the mapping open


def _checked_mapping(path: Path) -> tuple[GGUFHeader, mmap.mmap]:
    fd = limits.open_regular(path, "GGUF file")
    try:
        with open(fd, "rb", closefd=False) as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _parse(data), data
        except BaseException:
            data.close()
            raise
    except _Truncated:
        problem = "it ends in the middle of its header (truncated?)"
    except ValueError as exc:  # an empty file cannot be mapped either
        problem = str(exc) or "it is empty"
    finally:
        os.close(fd)
    raise UsageError(f"cannot read GGUF file {str(path)!r}: {problem}", "pass a complete, unmodified .gguf file")
