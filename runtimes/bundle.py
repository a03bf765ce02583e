"""Load and validate a bundle: manifest schema, paths confined to the bundle, checksums.

Nothing from a bundle is executed: the manifest is JSON, weights are raw bytes, engines
are handed to their backend's own loader, and no custom-op library is ever registered.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.runtimes import file_bounds, limits
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import (
    BackendEntry,
    ConfigEntry,
    FileEntry,
    GraphEntry,
    Manifest,
    ModelDims,
    path_problem,
)

_HASH_CHUNK = 1 << 22


@dataclass
class Bundle:
    root: Path
    manifest: Manifest

    @property
    def model(self) -> ModelDims:
        return self.manifest.model

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def max_len(self) -> int:
        return self.manifest.max_len

    def graph(self, name: str) -> GraphEntry:
        return self.manifest.graph(name)

    @cached_property
    def draft_vocab_ids(self) -> np.ndarray | None:
        """VocabTrim's token ids (a reduced draft head's row j scores id ids[j]), read once and
        checked, since a hostile file could otherwise map drafts outside the vocabulary."""
        entry = self.manifest.draft_vocab
        if entry is None:
            return None
        size, vocab = entry.size, self.model.vocab_size
        data = read_listed(self, entry.file, 4 * size)
        fix = "rebuild the bundle with --draft-vocab"
        if len(data) != 4 * size:
            raise UsageError(f"draft vocabulary file {entry.file!r} holds {len(data)} bytes, not {size} int32 ids", fix)
        ids = np.frombuffer(data, dtype="<i4").astype(np.int64)
        if ids[0] < 0 or ids[-1] >= vocab or (size > 1 and not bool(np.all(np.diff(ids) > 0))):
            raise UsageError(
                f"draft vocabulary file {entry.file!r} is not ascending unique token ids within 0..{vocab - 1}", fix
            )
        return ids

    def config(self, config_id: str) -> ConfigEntry:
        return self.manifest.config(config_id)

    def path(self, relative: str) -> Path:
        """Resolve a manifest path, refusing anything that leaves the bundle directory."""
        return confined_path(self.root, relative)

    def backend_entry(self, backend: str) -> BackendEntry:
        entry = self.manifest.backends.get(backend)
        if entry is None:
            present = ", ".join(self.manifest.backends) or "none"
            raise UsageError(
                f"backend {backend!r} is not in this bundle (it has: {present})",
                f"choose one of them, or rebuild with --backend {backend}",
            )
        return entry


def logits_width(graph: GraphEntry, model: ModelDims) -> int:
    """Columns of a graph's logits: the vocabulary, or a reduced draft head's token count."""
    return graph.logits_width(model.vocab_size)


def confined_path(root: Path, relative: str) -> Path:
    problem = path_problem(relative)
    if problem is not None:
        raise UsageError(
            f"manifest path {ascii(relative)[:80]} is not a relative path inside the bundle: it {problem}",
            "rebuild the bundle; never edit manifest paths by hand",
        )
    try:
        resolved = (root / relative).resolve()
        inside = resolved.is_relative_to(root.resolve())
    except (OSError, RuntimeError) as exc:  # symlink loops, names too long
        raise UsageError(f"manifest path {relative!r} cannot be resolved ({exc})", "rebuild the bundle") from None
    if not inside:
        raise UsageError(
            f"manifest path {relative!r} points outside the bundle",
            "rebuild the bundle; a bundle may only refer to its own files",
        )
    return resolved


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_fd(fd: int, limit: int) -> tuple[str, int]:
    digest, total = hashlib.sha256(), 0
    while total <= limit and (chunk := os.read(fd, _HASH_CHUNK)):
        digest.update(chunk)
        total += len(chunk)
    return digest.hexdigest(), total


def parse_manifest(data: bytes, name: str = "manifest.json") -> Any:
    """Strict JSON from a bundle: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting."""
    fix = "rebuild the bundle with `adaptive-export build`"

    def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, object]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            duplicate = next(k for k in keys if keys.count(k) > 1)
            raise UsageError(f"{name} is invalid: key {ascii(duplicate)[:80]} appears twice in one object", fix)
        return dict(pairs)

    def no_constant(constant: str) -> Any:
        raise UsageError(f"{name} is invalid: it holds {constant}, which is not JSON", fix)

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{name} is not UTF-8 text", fix) from None
    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{name} is not valid JSON (line {exc.lineno}: {exc.msg})", fix) from None
    except (RecursionError, ValueError) as exc:  # nesting too deep, integers with too many digits
        raise UsageError(f"{name} cannot be parsed ({type(exc).__name__})", fix) from None


def _check_file(bundle: Bundle, relative: str, entry: FileEntry, verify: str, seen: dict[tuple[int, int], str]) -> None:
    """One listed file: inside the bundle, a regular file (no symlink, FIFO or device), a
    file no other entry names (aliases and hard links refused), with its size and sha256."""
    path = bundle.path(relative)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise UsageError(
            f"bundle file {relative!r} is missing", "rebuild the bundle or copy it again completely"
        ) from None
    except OSError as exc:
        raise UsageError(f"bundle file {relative!r} cannot be read: {exc.strerror}", "rebuild the bundle") from None
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(
            f"bundle file {relative!r} is not a regular file", "rebuild the bundle; it may hold only regular files"
        )
    key = (info.st_dev, info.st_ino)
    if key in seen:
        raise UsageError(
            f"bundle files {seen[key]!r} and {relative!r} are the same file",
            "rebuild the bundle; every file is listed once",
        )
    seen[key] = relative
    fd = limits.open_regular(path, f"bundle file {relative!r}")
    try:
        size = os.fstat(fd).st_size
        if size != entry.bytes:
            raise UsageError(
                f"bundle file {relative!r} has {size} bytes, the manifest says {entry.bytes}",
                "the bundle is corrupt or truncated: copy it again or rebuild it",
            )
        if verify == "full" and _sha256_fd(fd, size)[0] != entry.sha256:
            raise UsageError(
                f"checksum mismatch for bundle file {relative!r}",
                "the bundle is corrupt or was modified: copy it again or rebuild it",
            )
    finally:
        os.close(fd)


def read_listed(bundle: Bundle, relative: str, max_bytes: int) -> bytes:
    """The bytes of a listed bundle file, read once and checked against its size and sha256
    whatever the verify mode, so what is used is exactly what was checked."""
    entry = bundle.manifest.files.get(relative)
    if entry is None:
        raise UsageError(
            f"bundle file {relative!r} is not listed with a checksum",
            "rebuild the bundle; unlisted files are never opened",
        )
    data = limits.read_regular(bundle.path(relative), f"bundle file {relative!r}", max_bytes)
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise UsageError(
            f"checksum mismatch for bundle file {relative!r}",
            "the bundle is corrupt or was modified: copy it again or rebuild it",
        )
    return data


def load_bundle(directory: str | os.PathLike[str], verify: str = "full") -> Bundle:
    """Read manifest.json, validate it, confine and check every listed file.

    verify="full" hashes every file (about 1 s per 500 MB); verify="size" checks only
    sizes, a documented fast path for devices that verified the bundle once on install
    (engines, tokenizer and calibration are small and always hashed when read).
    """
    if verify not in ("full", "size"):
        raise UsageError(f"verify={verify!r} is not a verification mode", "use 'full' or 'size'")
    if not isinstance(directory, (str, os.PathLike)):
        raise UsageError(
            f"bundle {type(directory).__name__} is not a path", "pass the bundle directory as a string or Path"
        )
    root = Path(directory)
    try:
        exists, is_dir = root.exists(), root.is_dir()
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"bundle directory {ascii(str(root))[:120]} cannot be used: {exc}",
            "pass the bundle directory written by `adaptive-export build`",
        ) from None
    if not exists:
        raise UsageError(
            f"bundle directory {str(root)!r} does not exist", "build one with `adaptive-export build -o DIR`"
        )
    if not is_dir:
        raise UsageError(
            f"{str(root)!r} is not a directory", "pass the bundle directory written by `adaptive-export build`"
        )
    manifest_path = root / "manifest.json"
    if not os.path.lexists(manifest_path):
        raise UsageError(
            f"{str(root)!r} has no manifest.json, so it is not a bundle",
            "pass a directory written by `adaptive-export build`",
        )
    manifest = Manifest.from_json(
        parse_manifest(limits.read_regular(manifest_path, "manifest", limits.MAX_MANIFEST_BYTES))
    )
    bundle = Bundle(root=root, manifest=manifest)
    file_bounds.check_file_sizes(manifest, bundle.path)  # every size before any hash
    seen: dict[tuple[int, int], str] = {}
    for relative, entry in manifest.files.items():
        _check_file(bundle, relative, entry, verify, seen)
    onnx = manifest.backends.get("onnx")
    if onnx is not None and onnx.weights is not None:
        size = manifest.files[onnx.weights].bytes
        for name, meta in onnx.tensors.items():
            if meta.offset + meta.bytes > size:
                raise UsageError(f"weight {name!r} lies outside the weights file", "the bundle is corrupt: rebuild it")
    return bundle
