"""The manifest.json contract, shared by the writer (exporter) and the reader (runtime).

Validation walks every field the runtime reads and turns any malformed value into a
UsageError naming the key, so a corrupt or foreign bundle never reaches a backend (the
fuzz tests in tests/test_fuzz.py hold this to: UsageError or valid, nothing else).
"""
from __future__ import annotations

from typing import Any

from runtimes.errors import UsageError

SCHEMA_VERSION = 1
FORMAT = "adaptive-export-bundle"

_MODEL_INTS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
_GRAPH_KINDS = ("prefill", "decode", "draft", "verify")


def _fail(problem: str) -> UsageError:
    return UsageError(f"manifest.json is invalid: {problem}", "rebuild the bundle with `adaptive-export build`")


def _need(cond: bool, problem: str) -> None:
    if not cond:
        raise _fail(problem)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _dict(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = parent.get(key)
    _need(key in parent, f"missing key {where}{key!r}")
    _need(isinstance(value, dict), f"key {where}{key!r} has the wrong type")
    return value


def validate(manifest: Any) -> dict[str, Any]:
    """Check structure and types of everything the runtime reads; returns the manifest."""
    _need(isinstance(manifest, dict), "the top level is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise UsageError("this directory's manifest.json is not an adaptive-export bundle manifest",
                         "point at a directory written by `adaptive-export build`")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UsageError(f"bundle schema_version {version!r} is not supported (this runtime reads {SCHEMA_VERSION})",
                         "rebuild the bundle with this version of adaptive-export, or upgrade adaptive-export")
    for key in ("model", "tokenizer", "graphs", "backends", "files"):
        _dict(manifest, key, "")
    _need("configs" in manifest, "missing key 'configs'")
    _need(isinstance(manifest["configs"], list), "key 'configs' has the wrong type")
    for key in ("max_len", "dtype", "router_threshold"):
        _need(key in manifest, f"missing key {key!r}")
    _need(_is_int(manifest["max_len"]) and manifest["max_len"] > 0, "key 'max_len' has the wrong type or is not positive")
    _need(isinstance(manifest["dtype"], str), "key 'dtype' has the wrong type")
    threshold = manifest["router_threshold"]
    _need(isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0.0 <= threshold <= 1.0,
          "key 'router_threshold' must be a number in [0, 1]")
    model = manifest["model"]
    for key in _MODEL_INTS:
        _need(_is_int(model.get(key)) and model[key] > 0, f"model.{key} must be a positive integer")
    num_layers = model["num_layers"]
    _validate_tokenizer(manifest["tokenizer"])
    graphs = manifest["graphs"]
    _need("prefill" in graphs, "no 'prefill' graph")
    for name, graph in graphs.items():
        _validate_graph(name, graph, num_layers)
    ids = set()
    for config in manifest["configs"]:
        _need(isinstance(config, dict) and isinstance(config.get("id"), str), "a config lacks a string id")
        _need(config["id"] not in ids, f"config id {config['id']!r} appears twice")
        ids.add(config["id"])
        kept = config.get("kept")
        _need(isinstance(kept, list) and all(_is_int(i) and 0 <= i < num_layers for i in kept),
              f"config {config['id']!r} has no valid kept layer list")
        engines = config.get("engines")
        _need(isinstance(engines, dict) and isinstance(engines.get("decode"), str), f"config {config['id']!r} lacks a decode engine")
        for role, engine in engines.items():
            _need(isinstance(engine, str) and engine in graphs, f"config {config['id']!r} names unknown {role} graph {engine!r}")
    _need("full" in ids, "no 'full' configuration")
    for backend, entry in manifest["backends"].items():
        _need(isinstance(entry, dict) and isinstance(entry.get("graphs"), dict), f"backend {backend!r} lacks a graphs table")
        for graph_name, engine in entry["graphs"].items():
            _need(graph_name in graphs, f"backend {backend!r} has an engine for unknown graph {graph_name!r}")
            _need(isinstance(engine, dict), f"backend {backend!r} engine {graph_name!r} is not an object")
            _need(isinstance(engine.get("file", ""), str), f"backend {backend!r} engine {graph_name!r} has a non-string file")
            _need(_is_str_list(engine.get("initializers", [])), f"backend {backend!r} engine {graph_name!r} has a bad initializer list")
    if "onnx" in manifest["backends"]:
        _validate_onnx(manifest["backends"]["onnx"])
    for path, entry in manifest["files"].items():
        _need(isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _is_int(entry.get("bytes")) and entry["bytes"] >= 0,
              f"files entry {path!r} lacks sha256 or bytes")
    speculation = manifest.get("speculation")
    _need(speculation is None or isinstance(speculation, dict), "key 'speculation' has the wrong type")
    _need(manifest.get("calibration") is None or isinstance(manifest["calibration"], str), "key 'calibration' has the wrong type")
    return manifest


def _validate_tokenizer(tokenizer: dict[str, Any]) -> None:
    _need(isinstance(tokenizer.get("file"), str), "tokenizer.file must be a path")
    chat = tokenizer.get("chat")
    _need(chat is None or (isinstance(chat, dict) and isinstance(chat.get("prefix"), str) and isinstance(chat.get("suffix"), str)),
          "tokenizer.chat must be null or {prefix, suffix}")
    for key in ("eos_token_ids", "prefix_token_ids"):
        value = tokenizer.get(key, [])
        _need(isinstance(value, list) and all(_is_int(t) and t >= 0 for t in value), f"tokenizer.{key} must be a list of token ids")


def _validate_graph(name: Any, graph: Any, num_layers: int) -> None:
    _need(isinstance(graph, dict), f"graph {name!r} is not an object")
    _need(graph.get("kind") in _GRAPH_KINDS, f"graph {name!r} has an unknown kind")
    layers = graph.get("layers")
    _need(isinstance(layers, list) and layers and all(_is_int(i) and 0 <= i < num_layers for i in layers),
          f"graph {name!r} needs a non-empty list of layers within 0..{num_layers - 1}")
    _need(graph.get("source", "ids") in ("ids", "hidden"), f"graph {name!r} has an unknown source")
    _need(graph.get("logits", "all") in ("all", "last"), f"graph {name!r} has an unknown logits mode")
    for flag in ("router_scores", "exit_hidden", "exit_adapter"):
        _need(isinstance(graph.get(flag, False), bool), f"graph {name!r} field {flag!r} must be true or false")
    _need(_is_str_list(graph.get("inputs")) and graph["inputs"], f"graph {name!r} lacks its input names")
    _need(_is_str_list(graph.get("outputs")) and graph["outputs"], f"graph {name!r} lacks its output names")
    _need(graph.get("exit_layer") is None or _is_int(graph["exit_layer"]), f"graph {name!r} has a bad exit_layer")


def _validate_onnx(entry: dict[str, Any]) -> None:
    _need(isinstance(entry.get("weights"), str), "backends.onnx.weights must be a path")
    tensors = entry.get("tensors")
    _need(isinstance(tensors, dict), "backends.onnx.tensors must be an object")
    for name, meta in tensors.items():
        _need(isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and meta["dtype"] in ("<f4", "<f2", "|u1", "|i1", "<i8", "<i4", "<u2")
              and _is_int(meta.get("offset")) and meta["offset"] >= 0 and _is_int(meta.get("bytes")) and meta["bytes"] >= 0
              and isinstance(meta.get("shape"), list) and all(_is_int(d) and d >= 0 for d in meta["shape"]),
              f"weight table entry {name!r} is malformed")
    for graph_name, engine in entry["graphs"].items():
        _need(isinstance(engine.get("file"), str), f"onnx engine {graph_name!r} lacks its file")
        _need(all(n in tensors for n in engine.get("initializers", [])), f"onnx engine {graph_name!r} uses a weight missing from the table")
