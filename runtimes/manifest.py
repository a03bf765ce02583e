"""The manifest.json contract, shared by the writer (exporter) and the reader (runtime).

Validation walks every field the runtime reads and turns any malformed value into a
UsageError naming the key, so a corrupt or foreign bundle never reaches a backend (the
fuzz tests in tests/test_fuzz.py hold this to: UsageError or valid, nothing else).
"""

from __future__ import annotations

import math
import posixpath
import unicodedata
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.drafting import SOURCE_NAMES
from adaptive_export.runtimes.errors import UsageError

SCHEMA_VERSION = 1
FORMAT = "adaptive-export-bundle"

_MODEL_INTS = {
    "num_layers": limits.MAX_LAYERS,
    "hidden_size": limits.MAX_HIDDEN,
    "num_heads": limits.MAX_HEADS,
    "num_kv_heads": limits.MAX_HEADS,
    "head_dim": limits.MAX_HEAD_DIM,
    "vocab_size": limits.MAX_VOCAB,
}
_GRAPH_KINDS = ("prefill", "decode", "draft", "verify")
_KIND_SOURCE = {"prefill": "ids", "decode": "ids", "draft": "ids", "verify": "hidden"}
_ROLE_KINDS = {"decode": "decode", "draft": "draft", "verify": "verify", "precision_draft": "decode", "ppd": "decode"}
PRECISIONS = ("int8", "int4", "native4")  # a precision draft's weights (graphs/plan.py PRECISION_DRAFTS)
DTYPE_SIZES = {"<f4": 4, "<f2": 2, "|u1": 1, "|i1": 1, "<i8": 8, "<i4": 4, "<u2": 2}
DTYPES = ("float32", "float16", "int8", "int4")


def path_problem(path: Any) -> str | None:
    """Why a manifest path is unacceptable, or None. Paths are canonical relative POSIX paths
    of printable characters, so one file has exactly one spelling (no aliases such as
    'onnx/./weights.bin') and no name can hide control characters or lone surrogates."""
    if not isinstance(path, str) or not path:
        return "is not a non-empty string"
    if len(path) > limits.MAX_PATH_CHARS:
        return f"is longer than {limits.MAX_PATH_CHARS} characters"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate"
    if any(unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") for ch in path):
        return "holds a control or unassigned character"
    if "\\" in path or path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        return "is not a relative path (absolute paths and backslashes are refused)"
    parts = path.split("/")
    if ".." in parts:
        return "points outside the bundle ('..')"
    if posixpath.normpath(path) != path or any(part in ("", ".", "..") for part in parts):
        return "is not in canonical form (no '.', '..', '//' or trailing '/')"
    return None


def _path_ok(path: Any, where: str) -> None:
    problem = path_problem(path)
    _need(problem is None, f"path {where} {problem}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
        raise UsageError(
            "this directory's manifest.json is not an adaptive-export bundle manifest",
            "point at a directory written by `adaptive-export build`",
        )
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UsageError(
            f"bundle schema_version {version!r} is not supported (this runtime reads {SCHEMA_VERSION})",
            "rebuild the bundle with this version of adaptive-export, or upgrade adaptive-export",
        )
    for key in ("model", "tokenizer", "graphs", "backends", "files"):
        _dict(manifest, key, "")
    _need("configs" in manifest, "missing key 'configs'")
    _need(isinstance(manifest["configs"], list), "key 'configs' has the wrong type")
    for key in ("max_len", "dtype", "router_threshold"):
        _need(key in manifest, f"missing key {key!r}")
    _need(
        _is_int(manifest["max_len"]) and manifest["max_len"] > 0, "key 'max_len' has the wrong type or is not positive"
    )
    _need(manifest["dtype"] in DTYPES, f"key 'dtype' must be one of {', '.join(DTYPES)}")
    threshold = manifest["router_threshold"]
    _need(
        isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0.0 <= threshold <= 1.0,
        "key 'router_threshold' must be a number in [0, 1]",
    )
    model = manifest["model"]
    _need(
        manifest["max_len"] <= limits.MAX_LEN,
        f"max_len {manifest['max_len']} exceeds the runtime's limit {limits.MAX_LEN}",
    )
    for key, cap in _MODEL_INTS.items():
        _need(_is_int(model.get(key)) and 0 < model[key] <= cap, f"model.{key} must be an integer in 1..{cap}")
    _need(model["num_heads"] % model["num_kv_heads"] == 0, "model.num_heads must be a multiple of model.num_kv_heads")
    _need(
        isinstance(model.get("model_type", ""), str) and isinstance(model.get("source", ""), (str, type(None))),
        "model.model_type and model.source must be strings",
    )
    num_layers = model["num_layers"]
    _validate_tokenizer(manifest["tokenizer"], model["vocab_size"])
    graphs = manifest["graphs"]
    _need(
        len(graphs) <= limits.MAX_GRAPHS
        and len(manifest["configs"]) <= limits.MAX_CONFIGS
        and len(manifest["files"]) <= limits.MAX_FILES,
        "too many graphs, configurations or files",
    )
    _need("prefill" in graphs, "no 'prefill' graph")
    for name, graph in graphs.items():
        _validate_graph(name, graph, num_layers)
    prefill = graphs["prefill"]
    _need(
        prefill["kind"] == "prefill"
        and prefill.get("source", "ids") == "ids"
        and sorted(prefill["layers"]) == list(range(num_layers)),
        "graph 'prefill' must be a prefill over token ids and every layer",
    )
    ids = set()
    for config in manifest["configs"]:
        _need(
            isinstance(config, dict) and _is_name(config.get("id")),
            "a config lacks an id of letters, digits, '_', '-' or '.'",
        )
        _need(config["id"] not in ids, f"config id {config['id']!r} appears twice")
        ids.add(config["id"])
        kept = config.get("kept")
        _need(
            isinstance(kept, list)
            and all(_is_int(i) and 0 <= i < num_layers for i in kept)
            and len(set(kept)) == len(kept),
            f"config {config['id']!r} has no valid kept layer list",
        )
        engines = config.get("engines")
        _need(
            isinstance(engines, dict) and isinstance(engines.get("decode"), str),
            f"config {config['id']!r} lacks a decode engine",
        )
        for role, engine in engines.items():
            _need(
                isinstance(engine, str) and engine in graphs,
                f"config {config['id']!r} names unknown {role} graph {engine!r}",
            )
            _need(
                _ROLE_KINDS.get(role, graphs[engine]["kind"]) == graphs[engine]["kind"],
                f"config {config['id']!r} uses graph {engine!r} of kind {graphs[engine]['kind']!r} as its {role} engine",
            )
        _need(
            sorted(graphs[engines["decode"]]["layers"]) == sorted(set(kept)),
            f"config {config['id']!r} keeps other layers than its decode graph runs",
        )
        _need(
            ("draft" in engines) == ("verify" in engines),
            f"config {config['id']!r} needs both or neither of draft and verify engines",
        )
        if "precision_draft" in engines:
            draft = graphs[engines["precision_draft"]]
            _need(
                draft.get("precision") in PRECISIONS and sorted(draft["layers"]) == sorted(set(kept)),
                f"config {config['id']!r} has a precision draft that is no draft precision of its decode graph",
            )
        if "ppd" in engines:
            _need(
                engines["ppd"] == engines["decode"] and graphs[engines["ppd"]].get("prompt_tokens", 0) > 0,
                f"config {config['id']!r} has a PPD engine that is not its decode graph with prompt tokens",
            )
    _need("full" in ids, "no 'full' configuration")
    full = next(c for c in manifest["configs"] if c["id"] == "full")
    _need(sorted(set(full["kept"])) == list(range(num_layers)), "configuration 'full' must keep every layer")
    for backend, entry in manifest["backends"].items():
        _need(
            isinstance(entry, dict) and isinstance(entry.get("graphs"), dict),
            f"backend {backend!r} lacks a graphs table",
        )
        for graph_name, engine in entry["graphs"].items():
            _need(graph_name in graphs, f"backend {backend!r} has an engine for unknown graph {graph_name!r}")
            _need(isinstance(engine, dict), f"backend {backend!r} engine {graph_name!r} is not an object")
            _need(
                isinstance(engine.get("file", ""), str),
                f"backend {backend!r} engine {graph_name!r} has a non-string file",
            )
            _need(
                _is_str_list(engine.get("initializers", [])),
                f"backend {backend!r} engine {graph_name!r} has a bad initializer list",
            )
    if "onnx" in manifest["backends"]:
        _validate_onnx(manifest["backends"]["onnx"])
    for path, entry in manifest["files"].items():
        _path_ok(path, f"in 'files' ({ascii(path)})")
        _need(path != "manifest.json", "'files' lists manifest.json itself")
        _need(
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and len(entry["sha256"]) == 64
            and all(c in "0123456789abcdef" for c in entry["sha256"])
            and _is_int(entry.get("bytes"))
            and entry["bytes"] >= 0,
            f"files entry {ascii(path)} lacks a sha256 hex digest or a byte count",
        )
    _validate_draft_vocab(manifest.get("draft_vocab"), graphs, model["vocab_size"])
    _validate_speculation(manifest.get("speculation"), graphs)
    _need(
        manifest.get("calibration") is None or isinstance(manifest["calibration"], str),
        "key 'calibration' has the wrong type",
    )
    for path in referenced_files(manifest):
        _path_ok(path, ascii(path))
        _need(path in manifest["files"], f"file {ascii(path)} is used but not listed in 'files' with a checksum")
    return manifest


def referenced_files(manifest: dict[str, Any]) -> list[str]:
    """Every file of the bundle the runtime opens (after validate's type checks)."""
    paths = [manifest["tokenizer"]["file"]]
    if manifest.get("calibration"):
        paths.append(manifest["calibration"])
    if manifest.get("draft_vocab"):
        paths.append(manifest["draft_vocab"]["file"])
    for entry in manifest["backends"].values():
        if isinstance(entry.get("weights"), str):
            paths.append(entry["weights"])
        for engine in entry["graphs"].values():
            for key in ("file", "onnx"):
                if key in engine:
                    paths.append(engine[key])
    return paths


def _validate_draft_vocab(entry: Any, graphs: dict[str, Any], vocab_size: int) -> None:
    """VocabTrim: one reduced draft vocabulary per bundle, {file, size}, sized as every graph
    that scores it (the ids themselves are checked when read: runtimes/bundle.py)."""
    sizes = {graph.get("draft_vocab", 0) for graph in graphs.values()} - {0}
    if entry is None:
        _need(not sizes, "a graph drafts over a reduced vocabulary, but the manifest has no 'draft_vocab' file")
        return
    _need(
        isinstance(entry, dict)
        and isinstance(entry.get("file"), str)
        and _is_int(entry.get("size"))
        and 0 < entry["size"] < vocab_size,
        f"key 'draft_vocab' must be {{file, size}} with size in 1..{vocab_size - 1}",
    )
    _need(sizes <= {entry["size"]}, f"a graph's draft_vocab differs from the bundle's draft_vocab size {entry['size']}")


def _validate_speculation(speculation: Any, graphs: dict[str, Any]) -> None:
    """The fields the runtime reads from 'speculation' (extra keys are kept for tools)."""
    if speculation is None:
        return
    _need(isinstance(speculation, dict), "key 'speculation' has the wrong type")
    _need(
        speculation.get("source") is None or speculation["source"] in SOURCE_NAMES,
        "speculation.source is not a known draft source",
    )
    _need(isinstance(speculation.get("auto_enabled", False), bool), "speculation.auto_enabled must be true or false")
    for source in SOURCE_NAMES:
        section = speculation.get(source)
        if section is None:
            continue
        _need(isinstance(section, dict), f"speculation.{source} must be an object")
        draft_len = section.get("draft_len")
        _need(
            draft_len is None or (_is_int(draft_len) and 1 <= draft_len <= limits.MAX_DRAFT_LEN),
            f"speculation.{source}.draft_len must be an integer in 1..{limits.MAX_DRAFT_LEN}",
        )
        draft_cost = section.get("draft_cost")
        _need(
            draft_cost is None or (_is_number(draft_cost) and 0 < draft_cost < 1e6),
            f"speculation.{source}.draft_cost must be a positive number",
        )
        for key in ("verify_cost", "verify_cost_prepacked"):
            costs = section.get(key)
            _need(
                costs is None
                or (
                    isinstance(costs, dict)
                    and all(isinstance(k, str) and _is_number(v) and 0 < v < 1e6 for k, v in costs.items())
                ),
                f"speculation.{source}.{key} must map draft lengths to positive numbers",
            )


def _validate_tokenizer(tokenizer: dict[str, Any], vocab_size: int) -> None:
    _need(isinstance(tokenizer.get("file"), str), "tokenizer.file must be a path")
    chat = tokenizer.get("chat")
    _need(
        chat is None
        or (isinstance(chat, dict) and isinstance(chat.get("prefix"), str) and isinstance(chat.get("suffix"), str)),
        "tokenizer.chat must be null or {prefix, suffix}",
    )
    if chat is not None:
        _need(
            len(chat["prefix"]) + len(chat["suffix"]) <= limits.MAX_CHAT_AFFIX_CHARS,
            f"tokenizer.chat prefix and suffix exceed {limits.MAX_CHAT_AFFIX_CHARS} characters",
        )
        for key in ("prefix", "suffix"):
            try:
                chat[key].encode("utf-8")
            except UnicodeEncodeError:
                raise _fail(f"tokenizer.chat.{key} holds a lone surrogate") from None
    for key in ("eos_token_ids", "prefix_token_ids"):
        value = tokenizer.get(key, [])
        _need(
            isinstance(value, list) and len(value) <= 1024 and all(_is_int(t) and 0 <= t < vocab_size for t in value),
            f"tokenizer.{key} must be a list of token ids below the vocabulary size",
        )


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _is_name(value: Any) -> bool:
    """Graph names and configuration ids: short, printable ASCII, never a path."""
    return isinstance(value, str) and 0 < len(value) <= 128 and set(value) <= _NAME_CHARS and not value.startswith(".")


def _validate_graph(name: Any, graph: Any, num_layers: int) -> None:
    _need(_is_name(name), f"graph name {ascii(name)[:80]} is not a short name of letters, digits, '_', '-' or '.'")
    _need(isinstance(graph, dict), f"graph {name!r} is not an object")
    _need(graph.get("kind") in _GRAPH_KINDS, f"graph {name!r} has an unknown kind")
    layers = graph.get("layers")
    _need(
        isinstance(layers, list) and layers and all(_is_int(i) and 0 <= i < num_layers for i in layers),
        f"graph {name!r} needs a non-empty list of layers within 0..{num_layers - 1}",
    )
    _need(graph.get("source", "ids") in ("ids", "hidden"), f"graph {name!r} has an unknown source")
    _need(graph.get("logits", "all") in ("all", "last"), f"graph {name!r} has an unknown logits mode")
    for flag in ("router_scores", "exit_hidden", "exit_adapter"):
        _need(isinstance(graph.get(flag, False), bool), f"graph {name!r} field {flag!r} must be true or false")
    _need(len(set(layers)) == len(layers), f"graph {name!r} lists a layer twice")
    kind = graph["kind"]
    _need(
        graph.get("source", "ids") == _KIND_SOURCE[kind],
        f"graph {name!r} of kind {kind!r} must take {_KIND_SOURCE[kind]!r} as its source",
    )
    _need(
        kind == "prefill" or graph.get("logits", "all") == "all",
        f"graph {name!r} of kind {kind!r} must return logits for every row",
    )
    _need(kind != "draft" or graph.get("exit_hidden", False), f"draft graph {name!r} must return exit_hidden")
    _need(_is_str_list(graph.get("inputs")) and graph["inputs"], f"graph {name!r} lacks its input names")
    _need(_is_str_list(graph.get("outputs")) and graph["outputs"], f"graph {name!r} lacks its output names")
    _need(graph.get("exit_layer") is None or _is_int(graph["exit_layer"]), f"graph {name!r} has a bad exit_layer")
    _need(graph.get("config") is None or isinstance(graph["config"], str), f"graph {name!r} has a bad config")
    _need(
        graph.get("precision") is None or (kind == "decode" and graph["precision"] in PRECISIONS),
        f"graph {name!r} has a bad precision (a decode graph may have one of {', '.join(PRECISIONS)})",
    )
    prompt_tokens = graph.get("prompt_tokens", 0)
    _need(
        _is_int(prompt_tokens)
        and 0 <= prompt_tokens <= limits.MAX_PROMPT_TOKENS
        and (kind == "decode" or not prompt_tokens),
        f"graph {name!r} has a bad prompt_tokens (a decode graph may embed 0..{limits.MAX_PROMPT_TOKENS} PPD prompt tokens)",
    )
    draft_vocab = graph.get("draft_vocab", 0)
    _need(
        _is_int(draft_vocab)
        and 0 <= draft_vocab <= limits.MAX_VOCAB
        and (graph.get("precision") is not None or not draft_vocab),
        f"graph {name!r} has a bad draft_vocab (a precision draft may score 1..vocab_size-1 token ids, other graphs 0)",
    )
    inputs, outputs = graph["inputs"], graph["outputs"]
    _need(
        len(set(inputs)) == len(inputs) and len(set(outputs)) == len(outputs),
        f"graph {name!r} names an input or output twice",
    )
    first = "input_ids" if graph.get("source", "ids") == "ids" else "exit_hidden"
    _need(inputs[0] == first, f"graph {name!r} must take {first!r} as its first input")
    fused = graph.get("flavour", "portable") == "ort"
    _need(graph.get("flavour", "portable") in ("portable", "ort"), f"graph {name!r} has an unknown flavour")
    bound = {f"past_{kv}_{i}" for kv in ("key", "value") for i in layers}
    if fused:  # the arena length and the rows to score go in; each layer's block comes back
        bound |= {"logit_rows", "seqlens_k", "total_sequence_length"}
    produced = {"logits"} | {f"{'present' if fused else 'new'}_{kv}_{i}" for kv in ("key", "value") for i in layers}
    produced |= {flag for flag in ("router_scores", "exit_hidden") if graph.get(flag, False)}
    _need(bound <= set(inputs), f"graph {name!r} lacks a past_key/past_value input of one of its layers")
    _need(
        produced <= set(outputs),
        f"graph {name!r} lacks an output the runtime reads (logits, new/present key and value of its layers, flagged outputs)",
    )
    for flag in ("router_scores", "exit_hidden"):
        _need(graph.get(flag, False) or flag not in outputs, f"graph {name!r} has output {flag!r} without its flag")


def _validate_onnx(entry: dict[str, Any]) -> None:
    _need(isinstance(entry.get("weights"), str), "backends.onnx.weights must be a path")
    _need(
        _is_int(entry.get("weight_bytes", 0)) and entry.get("weight_bytes", 0) >= 0,
        "backends.onnx.weight_bytes must be a byte count",
    )
    tensors = entry.get("tensors")
    _need(isinstance(tensors, dict) and len(tensors) <= limits.MAX_TENSORS, "backends.onnx.tensors must be an object")
    for name, meta in tensors.items():
        _need(
            isinstance(meta, dict)
            and isinstance(meta.get("dtype"), str)
            and meta["dtype"] in DTYPE_SIZES
            and _is_int(meta.get("offset"))
            and meta["offset"] >= 0
            and _is_int(meta.get("bytes"))
            and meta["bytes"] >= 0
            and isinstance(meta.get("shape"), list)
            and len(meta["shape"]) <= 8
            and all(_is_int(d) and d >= 0 for d in meta["shape"]),
            f"weight table entry {name!r} is malformed",
        )
        _need(
            math.prod(meta["shape"]) * DTYPE_SIZES[meta["dtype"]] == meta["bytes"],
            f"weight table entry {name!r}: shape {meta['shape']} of {meta['dtype']} is not {meta['bytes']} bytes",
        )
    for graph_name, engine in entry["graphs"].items():
        _need(isinstance(engine.get("file"), str), f"onnx engine {graph_name!r} lacks its file")
        _need(_is_str_list(engine.get("initializers")), f"onnx engine {graph_name!r} lacks its initializer list")
        _need(
            all(n in tensors for n in engine.get("initializers", [])),
            f"onnx engine {graph_name!r} uses a weight missing from the table",
        )
