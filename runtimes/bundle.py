"""Load and validate a bundle: manifest schema, paths confined to the bundle, checksums.

Nothing from a bundle is executed: the manifest is JSON, weights are raw bytes, engines
are handed to their backend's own loader, and no custom-op library is ever registered.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtimes.errors import UsageError
from runtimes.manifest import validate

_HASH_CHUNK = 1 << 22


@dataclass
class Bundle:
    root: Path
    manifest: dict[str, Any]

    @property
    def model(self) -> dict[str, Any]:
        return self.manifest["model"]

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def max_len(self) -> int:
        return int(self.manifest["max_len"])

    def graph(self, name: str) -> dict[str, Any]:
        return self.manifest["graphs"][name]

    def config(self, config_id: str) -> dict[str, Any]:
        for config in self.manifest["configs"]:
            if config["id"] == config_id:
                return config
        known = ", ".join(c["id"] for c in self.manifest["configs"])
        raise UsageError(f"unknown configuration {config_id!r}", f"use auto, or one of: {known}")

    def path(self, relative: str) -> Path:
        """Resolve a manifest path, refusing anything that leaves the bundle directory."""
        return confined_path(self.root, relative)

    def backend_entry(self, backend: str) -> dict[str, Any]:
        entry = self.manifest["backends"].get(backend)
        if entry is None:
            present = ", ".join(self.manifest["backends"]) or "none"
            raise UsageError(f"backend {backend!r} is not in this bundle (it has: {present})",
                             f"choose one of them, or rebuild with --backend {backend}")
        return entry


def confined_path(root: Path, relative: str) -> Path:
    if not isinstance(relative, str) or not relative or os.path.isabs(relative) or "\\" in relative:
        raise UsageError(f"manifest path {relative!r} is not a relative path inside the bundle", "rebuild the bundle; never edit manifest paths by hand")
    resolved = (root / relative).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise UsageError(f"manifest path {relative!r} points outside the bundle", "rebuild the bundle; a bundle may only refer to its own files")
    return resolved


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def load_bundle(directory: str | os.PathLike[str], verify: str = "full") -> Bundle:
    """Read manifest.json, validate it, confine and check every listed file.

    verify="full" hashes every file (about 1 s per 500 MB); verify="size" checks only
    sizes, a documented fast path for devices that verified the bundle once on install.
    """
    if verify not in ("full", "size"):
        raise UsageError(f"verify={verify!r} is not a verification mode", "use 'full' or 'size'")
    root = Path(directory)
    if not root.exists():
        raise UsageError(f"bundle directory {str(root)!r} does not exist", "build one with `adaptive-export build -o DIR`")
    if not root.is_dir():
        raise UsageError(f"{str(root)!r} is not a directory", "pass the bundle directory written by `adaptive-export build`")
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise UsageError(f"{str(root)!r} has no manifest.json, so it is not a bundle", "pass a directory written by `adaptive-export build`")
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {str(manifest_path)!r}: {exc}", "check the file's permissions or rebuild the bundle") from exc
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"manifest.json is not valid JSON (line {exc.lineno}: {exc.msg})", "rebuild the bundle with `adaptive-export build`") from exc
    validate(manifest)
    bundle = Bundle(root=root, manifest=manifest)
    for relative, entry in manifest["files"].items():
        path = bundle.path(relative)
        if not path.is_file():
            raise UsageError(f"bundle file {relative!r} is missing", "rebuild the bundle or copy it again completely")
        if path.stat().st_size != entry["bytes"]:
            raise UsageError(f"bundle file {relative!r} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}", "the bundle is corrupt or truncated: copy it again or rebuild it")
        if verify == "full" and sha256_of(path) != entry["sha256"]:
            raise UsageError(f"checksum mismatch for bundle file {relative!r}", "the bundle is corrupt or was modified: copy it again or rebuild it")
    for entry in manifest["backends"].values():
        for graph_name, graph in entry["graphs"].items():
            if graph_name not in manifest["graphs"]:
                raise UsageError(f"manifest.json is invalid: backend engine for unknown graph {graph_name!r}", "rebuild the bundle with `adaptive-export build`")
            for key in ("file",):
                if key in graph and graph[key] not in manifest["files"]:
                    raise UsageError(f"engine file {graph[key]!r} is not listed with a checksum", "rebuild the bundle with `adaptive-export build`")
    return bundle
