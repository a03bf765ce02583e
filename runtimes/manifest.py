"""The manifest.json contract, shared by the writer (exporter) and the reader (runtime).

Validation turns every malformed manifest into a UsageError that names the key and the
fix, so a corrupt or foreign bundle never reaches a backend.
"""
from __future__ import annotations

from typing import Any

from runtimes.errors import UsageError

SCHEMA_VERSION = 1
FORMAT = "adaptive-export-bundle"

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "format": str,
    "model": dict,
    "max_len": int,
    "dtype": str,
    "router_threshold": (int, float),
    "tokenizer": dict,
    "configs": list,
    "graphs": dict,
    "backends": dict,
    "files": dict,
}
_MODEL_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
_GRAPH_KEYS: dict[str, type | tuple[type, ...]] = {"kind": str, "layers": list, "inputs": list, "outputs": list}


def _need(cond: bool, problem: str) -> None:
    if not cond:
        raise UsageError(f"manifest.json is invalid: {problem}", "rebuild the bundle with `adaptive-export build`")


def validate(manifest: Any) -> dict[str, Any]:
    """Check structure and types; returns the manifest unchanged."""
    _need(isinstance(manifest, dict), "the top level is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise UsageError("this directory's manifest.json is not an adaptive-export bundle manifest",
                         "point at a directory written by `adaptive-export build`")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UsageError(f"bundle schema_version {version!r} is not supported (this runtime reads {SCHEMA_VERSION})",
                         "rebuild the bundle with this version of adaptive-export, or upgrade adaptive-export")
    for key, kind in _REQUIRED.items():
        _need(key in manifest, f"missing key {key!r}")
        _need(isinstance(manifest[key], kind) and not isinstance(manifest[key], bool), f"key {key!r} has the wrong type")
    for key in _MODEL_KEYS:
        value = manifest["model"].get(key)
        _need(isinstance(value, int) and not isinstance(value, bool) and value > 0, f"model.{key} must be a positive integer")
    _need(manifest["max_len"] > 0, "max_len must be positive")
    num_layers = manifest["model"]["num_layers"]
    for name, graph in manifest["graphs"].items():
        _need(isinstance(graph, dict), f"graph {name!r} is not an object")
        for key, kind in _GRAPH_KEYS.items():
            _need(isinstance(graph.get(key), kind), f"graph {name!r} lacks {key!r} or it has the wrong type")
        _need(all(isinstance(i, int) and 0 <= i < num_layers for i in graph["layers"]), f"graph {name!r} names a layer outside 0..{num_layers - 1}")
    _need("prefill" in manifest["graphs"], "no 'prefill' graph")
    for config in manifest["configs"]:
        _need(isinstance(config, dict) and isinstance(config.get("id"), str) and isinstance(config.get("kept"), list)
              and isinstance(config.get("engines"), dict), "a config lacks id, kept or engines")
        for engine in config["engines"].values():
            _need(engine in manifest["graphs"], f"config {config['id']!r} names unknown graph {engine!r}")
    _need(any(c["id"] == "full" for c in manifest["configs"]), "no 'full' configuration")
    for backend, entry in manifest["backends"].items():
        _need(isinstance(entry, dict) and isinstance(entry.get("graphs"), dict), f"backend {backend!r} lacks a graphs table")
    for path, entry in manifest["files"].items():
        _need(isinstance(path, str) and isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
              and isinstance(entry.get("bytes"), int), f"files entry {path!r} lacks sha256 or bytes")
    return manifest
