"""The manifest.json contract as frozen dataclasses, shared by the writer (exporter) and the
reader (runtime) (docs/architecture.md section 3).

Each type is parsed and checked once, by its strict `from_json`, and written by `to_json`;
a field is declared, serialised and validated in one place. Keys a type does not read are
kept verbatim in `extra` (tools read them, e.g. calibration's notes in `speculation`) and
written back in their original order, so a bundle's manifest round-trips unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.drafting import SOURCE_NAMES
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest_fields import (
    JsonObject,
    extras,
    fail,
    is_int,
    is_name,
    is_number,
    is_str_list,
    need,
    need_object,
    need_path,
    optional_str,
    path_problem,
)

SCHEMA_VERSION = 1
FORMAT = "adaptive-export-bundle"
PRECISIONS = ("int8", "int4", "native4")  # a precision draft's weights (graphs/plan.py PRECISION_DRAFTS)
DTYPE_SIZES = {"<f4": 4, "<f2": 2, "|u1": 1, "|i1": 1, "<i8": 8, "<i4": 4, "<u2": 2}
DTYPES = ("float32", "float16", "int8", "int4")
GRAPH_KINDS = ("prefill", "decode", "draft", "verify")
_KIND_SOURCE = {"prefill": "ids", "decode": "ids", "draft": "ids", "verify": "hidden"}
_ROLE_KINDS = {"decode": "decode", "draft": "draft", "verify": "verify", "precision_draft": "decode", "ppd": "decode"}

__all__ = [
    "SCHEMA_VERSION",
    "FORMAT",
    "PRECISIONS",
    "DTYPES",
    "ModelDims",
    "ChatFormat",
    "TokenizerEntry",
    "GraphEntry",
    "ConfigEntry",
    "SourceSpeculation",
    "Speculation",
    "TensorEntry",
    "EngineEntry",
    "BackendEntry",
    "DraftVocab",
    "FileEntry",
    "Manifest",
    "path_problem",
    "validate",
]


def _ordered(values: JsonObject, order: tuple[str, ...]) -> JsonObject:
    """values with the keys of `order` first, in that order (the order they were read in)."""
    first = {key: values[key] for key in order if key in values}
    return {**first, **{key: value for key, value in values.items() if key not in first}}


# ---- model and tokenizer -----------------------------------------------------------------

_MODEL_INTS = {
    "num_layers": limits.MAX_LAYERS,
    "hidden_size": limits.MAX_HIDDEN,
    "num_heads": limits.MAX_HEADS,
    "num_kv_heads": limits.MAX_HEADS,
    "head_dim": limits.MAX_HEAD_DIM,
    "vocab_size": limits.MAX_VOCAB,
}
_MODEL_KEYS = (*_MODEL_INTS, "model_type", "source")


@dataclass(frozen=True)
class ModelDims:
    """The model's dimensions (graphs.spec.ModelSpec written out) and where it came from."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    model_type: str = ""
    source: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # intermediate_size, rms_norm_eps, ...
    key_order: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ModelDims:
        for key, cap in _MODEL_INTS.items():
            need(is_int(obj.get(key)) and 0 < obj[key] <= cap, f"model.{key} must be an integer in 1..{cap}")
        need(obj["num_heads"] % obj["num_kv_heads"] == 0, "model.num_heads must be a multiple of model.num_kv_heads")
        need(
            isinstance(obj.get("model_type", ""), str) and isinstance(obj.get("source", ""), (str, type(None))),
            "model.model_type and model.source must be strings",
        )
        return cls(
            **{key: obj[key] for key in _MODEL_INTS},
            model_type=obj.get("model_type", ""),
            source=obj.get("source"),
            extra=extras(obj, _MODEL_KEYS),
            key_order=tuple(obj),
        )

    def to_json(self) -> JsonObject:
        values = {key: getattr(self, key) for key in _MODEL_INTS}
        values.update(model_type=self.model_type, **self.extra, source=self.source)
        return _ordered(values, self.key_order or ("model_type",))


@dataclass(frozen=True)
class ChatFormat:
    """The chat template rendered at build time: the text before and after the user's prompt."""

    prefix: str
    suffix: str

    @classmethod
    def from_json(cls, obj: Any) -> ChatFormat | None:
        need(
            obj is None
            or (isinstance(obj, dict) and isinstance(obj.get("prefix"), str) and isinstance(obj.get("suffix"), str)),
            "tokenizer.chat must be null or {prefix, suffix}",
        )
        if obj is None:
            return None
        need(
            len(obj["prefix"]) + len(obj["suffix"]) <= limits.MAX_CHAT_AFFIX_CHARS,
            f"tokenizer.chat prefix and suffix exceed {limits.MAX_CHAT_AFFIX_CHARS} characters",
        )
        for key in ("prefix", "suffix"):
            try:
                obj[key].encode("utf-8")
            except UnicodeEncodeError:
                raise fail(f"tokenizer.chat.{key} holds a lone surrogate") from None
        return cls(obj["prefix"], obj["suffix"])

    def to_json(self) -> dict[str, str]:
        return {"prefix": self.prefix, "suffix": self.suffix}


@dataclass(frozen=True)
class TokenizerEntry:
    file: str
    chat: ChatFormat | None = None
    eos_token_ids: tuple[int, ...] = ()
    prefix_token_ids: tuple[int, ...] = ()  # prepended to every prompt (BOS)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], vocab_size: int) -> TokenizerEntry:
        need(isinstance(obj.get("file"), str), "tokenizer.file must be a path")
        chat = ChatFormat.from_json(obj.get("chat"))
        ids = {}
        for key in ("eos_token_ids", "prefix_token_ids"):
            value = obj.get(key, [])
            need(
                isinstance(value, list)
                and len(value) <= 1024
                and all(is_int(t) and 0 <= t < vocab_size for t in value),
                f"tokenizer.{key} must be a list of token ids below the vocabulary size",
            )
            ids[key] = tuple(value)
        return cls(obj["file"], chat, ids["eos_token_ids"], ids["prefix_token_ids"])

    def to_json(self) -> JsonObject:
        return {
            "file": self.file,
            "chat": self.chat.to_json() if self.chat else None,
            "eos_token_ids": list(self.eos_token_ids),
            "prefix_token_ids": list(self.prefix_token_ids),
        }


# ---- graphs and configurations -------------------------------------------------------------


@dataclass(frozen=True)
class GraphEntry:
    """What one engine graph computes, so the runtime knows its I/O without opening it.

    The exporter builds one per `graphs.span_graph.GraphSpec` (same field names); the I/O
    names follow from the fields (`input_names`, `output_names`), the arena contract of
    docs/architecture.md section 4."""

    name: str
    kind: str  # one of GRAPH_KINDS
    layers: tuple[int, ...]
    source: str = "ids"  # "ids" | "hidden"
    logits: str = "all"  # "all" | "last"
    router_scores: bool = False
    exit_hidden: bool = False
    exit_adapter: bool = False
    config: str | None = "full"
    exit_layer: int | None = None
    flavour: str = "portable"  # "portable" | "ort"
    precision: str | None = None  # a precision draft's weights, one of PRECISIONS
    prompt_tokens: int = 0  # PPD prompt tokens a decode graph embeds
    draft_vocab: int = 0  # VocabTrim: the token ids a precision draft's head scores (0: all)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    def input_names(self) -> list[str]:
        first = "input_ids" if self.source == "ids" else "exit_hidden"
        control = ["logit_rows", "seqlens_k", "total_sequence_length"] if self.flavour == "ort" else []
        return [first, *control] + [f"past_key_{i}" for i in self.layers] + [f"past_value_{i}" for i in self.layers]

    def output_names(self) -> list[str]:
        names = ["logits"]
        if self.router_scores:
            names.append("router_scores")
        if self.exit_hidden:
            names.append("exit_hidden")
        kv = "present" if self.flavour == "ort" else "new"
        return names + [f"{kv}_key_{i}" for i in self.layers] + [f"{kv}_value_{i}" for i in self.layers]

    def engine_key(self) -> tuple[Any, ...]:
        """Graphs with equal keys are the same ONNX model (the exporter writes the file once)."""
        return (
            self.flavour,
            self.layers,
            self.source,
            self.router_scores,
            self.exit_hidden,
            self.exit_layer if self.exit_adapter else None,
            self.logits if self.flavour == "portable" else None,
            self.precision,
            self.prompt_tokens,
            self.draft_vocab,
        )

    def logits_width(self, vocab_size: int) -> int:
        """Columns of the logits: the vocabulary, or a reduced draft head's token count."""
        return self.draft_vocab or vocab_size

    @classmethod
    def from_json(cls, name: Any, obj: Any, num_layers: int) -> GraphEntry:
        entry = _graph_fields(name, obj, num_layers)
        _check_graph_io(entry)
        return entry

    def to_json(self) -> JsonObject:
        return {
            "kind": self.kind,
            "layers": list(self.layers),
            "source": self.source,
            "logits": self.logits,
            "router_scores": self.router_scores,
            "exit_hidden": self.exit_hidden,
            "exit_adapter": self.exit_adapter,
            "config": self.config,
            "exit_layer": self.exit_layer,
            "flavour": self.flavour,
            "precision": self.precision,
            "prompt_tokens": self.prompt_tokens,
            "draft_vocab": self.draft_vocab,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }


def _graph_fields(name: Any, graph: Any, num_layers: int) -> GraphEntry:
    """One graph's fields, each checked alone and against its kind."""
    need(is_name(name), f"graph name {ascii(name)[:80]} is not a short name of letters, digits, '_', '-' or '.'")
    need(isinstance(graph, dict), f"graph {name!r} is not an object")
    need(graph.get("kind") in GRAPH_KINDS, f"graph {name!r} has an unknown kind")
    layers = graph.get("layers")
    need(
        isinstance(layers, list) and bool(layers) and all(is_int(i) and 0 <= i < num_layers for i in layers),
        f"graph {name!r} needs a non-empty list of layers within 0..{num_layers - 1}",
    )
    source, logits = graph.get("source", "ids"), graph.get("logits", "all")
    need(source in ("ids", "hidden"), f"graph {name!r} has an unknown source")
    need(logits in ("all", "last"), f"graph {name!r} has an unknown logits mode")
    for flag in ("router_scores", "exit_hidden", "exit_adapter"):
        need(isinstance(graph.get(flag, False), bool), f"graph {name!r} field {flag!r} must be true or false")
    need(len(set(layers)) == len(layers), f"graph {name!r} lists a layer twice")
    kind = graph["kind"]
    need(
        source == _KIND_SOURCE[kind], f"graph {name!r} of kind {kind!r} must take {_KIND_SOURCE[kind]!r} as its source"
    )
    need(kind == "prefill" or logits == "all", f"graph {name!r} of kind {kind!r} must return logits for every row")
    need(kind != "draft" or graph.get("exit_hidden", False), f"draft graph {name!r} must return exit_hidden")
    need(is_str_list(graph.get("inputs")) and bool(graph["inputs"]), f"graph {name!r} lacks its input names")
    need(is_str_list(graph.get("outputs")) and bool(graph["outputs"]), f"graph {name!r} lacks its output names")
    need(graph.get("exit_layer") is None or is_int(graph["exit_layer"]), f"graph {name!r} has a bad exit_layer")
    need(graph.get("config") is None or isinstance(graph["config"], str), f"graph {name!r} has a bad config")
    precision = graph.get("precision")
    need(
        precision is None or (kind == "decode" and precision in PRECISIONS),
        f"graph {name!r} has a bad precision (a decode graph may have one of {', '.join(PRECISIONS)})",
    )
    prompt_tokens, draft_vocab = graph.get("prompt_tokens", 0), graph.get("draft_vocab", 0)
    need(
        is_int(prompt_tokens)
        and 0 <= prompt_tokens <= limits.MAX_PROMPT_TOKENS
        and (kind == "decode" or not prompt_tokens),
        f"graph {name!r} has a bad prompt_tokens "
        f"(a decode graph may embed 0..{limits.MAX_PROMPT_TOKENS} PPD prompt tokens)",
    )
    need(
        is_int(draft_vocab) and 0 <= draft_vocab <= limits.MAX_VOCAB and (precision is not None or not draft_vocab),
        f"graph {name!r} has a bad draft_vocab (a precision draft may score 1..vocab_size-1 token ids, other graphs 0)",
    )
    need(graph.get("flavour", "portable") in ("portable", "ort"), f"graph {name!r} has an unknown flavour")
    routers, exit_hidden, adapter = (
        graph.get(flag, False) for flag in ("router_scores", "exit_hidden", "exit_adapter")
    )
    return GraphEntry(
        name, kind, tuple(layers), source, logits, routers, exit_hidden, adapter, graph.get("config"),
        graph.get("exit_layer"), graph.get("flavour", "portable"), precision, prompt_tokens, draft_vocab,
        tuple(graph["inputs"]), tuple(graph["outputs"]),
    )  # fmt: skip


def _check_graph_io(graph: GraphEntry) -> None:
    """The manifest's I/O names hold every name the graph's fields imply (input_names,
    output_names), the implied first input first, and no flagged output without its flag."""
    name, inputs, outputs = graph.name, graph.inputs, graph.outputs
    need(
        len(set(inputs)) == len(inputs) and len(set(outputs)) == len(outputs),
        f"graph {name!r} names an input or output twice",
    )
    implied_inputs = graph.input_names()
    need(inputs[0] == implied_inputs[0], f"graph {name!r} must take {implied_inputs[0]!r} as its first input")
    need(set(implied_inputs) <= set(inputs), f"graph {name!r} lacks a past_key/past_value input of one of its layers")
    need(
        set(graph.output_names()) <= set(outputs),
        f"graph {name!r} lacks an output the runtime reads (logits, new/present key and value of its layers, "
        "flagged outputs)",
    )
    for flag in ("router_scores", "exit_hidden"):
        need(getattr(graph, flag) or flag not in outputs, f"graph {name!r} has output {flag!r} without its flag")


@dataclass(frozen=True)
class ConfigEntry:
    """A skip configuration: the layers it keeps and its engines by role (decode, draft and
    verify, precision_draft, ppd), each the name of a graph."""

    id: str
    kept: tuple[int, ...]
    engines: Mapping[str, str]

    @property
    def decode(self) -> str:
        return self.engines["decode"]

    @classmethod
    def from_json(cls, obj: Any, graphs: Mapping[str, GraphEntry], num_layers: int) -> ConfigEntry:
        need(
            isinstance(obj, dict) and is_name(obj.get("id")), "a config lacks an id of letters, digits, '_', '-' or '.'"
        )
        config_id, kept, engines = obj["id"], obj.get("kept"), obj.get("engines")
        need(
            isinstance(kept, list)
            and all(is_int(i) and 0 <= i < num_layers for i in kept)
            and len(set(kept)) == len(kept),
            f"config {config_id!r} has no valid kept layer list",
        )
        need(
            isinstance(engines, dict) and isinstance(engines.get("decode"), str),
            f"config {config_id!r} lacks a decode engine",
        )
        for role, engine in engines.items():
            need(
                isinstance(engine, str) and engine in graphs,
                f"config {config_id!r} names unknown {role} graph {engine!r}",
            )
            kind = graphs[engine].kind
            need(
                _ROLE_KINDS.get(role, kind) == kind,
                f"config {config_id!r} uses graph {engine!r} of kind {kind!r} as its {role} engine",
            )
        config = cls(config_id, tuple(kept), dict(engines))
        config._check_engines(graphs)
        return config

    def _check_engines(self, graphs: Mapping[str, GraphEntry]) -> None:
        kept, engines = sorted(set(self.kept)), self.engines
        need(
            sorted(graphs[self.decode].layers) == kept,
            f"config {self.id!r} keeps other layers than its decode graph runs",
        )
        need(
            ("draft" in engines) == ("verify" in engines),
            f"config {self.id!r} needs both or neither of draft and verify engines",
        )
        if "precision_draft" in engines:
            draft = graphs[engines["precision_draft"]]
            need(
                draft.precision in PRECISIONS and sorted(draft.layers) == kept,
                f"config {self.id!r} has a precision draft that is no draft precision of its decode graph",
            )
        if "ppd" in engines:
            need(
                engines["ppd"] == self.decode and graphs[engines["ppd"]].prompt_tokens > 0,
                f"config {self.id!r} has a PPD engine that is not its decode graph with prompt tokens",
            )

    def to_json(self) -> JsonObject:
        return {"id": self.id, "kept": list(self.kept), "engines": dict(self.engines)}


# ---- speculation ----------------------------------------------------------------------------

_SOURCE_KEYS = ("draft_len", "draft_cost", "verify_cost", "verify_cost_prepacked")


def _is_cost(value: Any) -> bool:
    return is_number(value) and 0 < value < 1e6


@dataclass(frozen=True)
class SourceSpeculation:
    """What calibration measured for one draft source: its draft length and its costs in T=1
    decode passes (a drafting step; a verify pass by draft length, as measured without and
    with ONNX Runtime's prepacked weights)."""

    draft_len: int | None = None
    draft_cost: float | None = None
    verify_cost: Mapping[str, float] | None = None
    verify_cost_prepacked: Mapping[str, float] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    def verify_costs(self, prepacked: bool) -> Mapping[str, float]:
        return (self.verify_cost_prepacked if prepacked else self.verify_cost) or {}

    @classmethod
    def from_json(cls, source: str, obj: Any) -> SourceSpeculation:
        need(isinstance(obj, dict), f"speculation.{source} must be an object")
        draft_len, draft_cost = obj.get("draft_len"), obj.get("draft_cost")
        need(
            draft_len is None or (is_int(draft_len) and 1 <= draft_len <= limits.MAX_DRAFT_LEN),
            f"speculation.{source}.draft_len must be an integer in 1..{limits.MAX_DRAFT_LEN}",
        )
        need(
            draft_cost is None or (is_number(draft_cost) and 0 < draft_cost < 1e6),
            f"speculation.{source}.draft_cost must be a positive number",
        )
        for key in ("verify_cost", "verify_cost_prepacked"):
            costs = obj.get(key)
            need(
                costs is None
                or (isinstance(costs, dict) and all(isinstance(k, str) and _is_cost(v) for k, v in costs.items())),
                f"speculation.{source}.{key} must map draft lengths to positive numbers",
            )  # fmt: skip
        return cls(
            draft_len, draft_cost, obj.get("verify_cost"), obj.get("verify_cost_prepacked"),
            extras(obj, _SOURCE_KEYS), tuple(obj),
        )  # fmt: skip

    def to_json(self) -> JsonObject:
        values = {key: getattr(self, key) for key in _SOURCE_KEYS if getattr(self, key) is not None}
        return _ordered({**values, **self.extra}, self.key_order)


@dataclass(frozen=True)
class Speculation:
    """The calibrated draft source, whether `run --mode auto` uses it, and each source's
    measurements; other keys (exit layer, expected speedups, adapter) are kept for tools."""

    source: str | None = None
    auto_enabled: bool = False
    sources: Mapping[str, SourceSpeculation] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    def of(self, source: str) -> SourceSpeculation:
        """A source's measurements (empty where calibration recorded none)."""
        return self.sources.get(source) or SourceSpeculation()

    @classmethod
    def from_json(cls, obj: Any) -> Speculation | None:
        if obj is None:
            return None
        need(isinstance(obj, dict), "key 'speculation' has the wrong type")
        need(
            obj.get("source") is None or obj["source"] in SOURCE_NAMES, "speculation.source is not a known draft source"
        )
        need(isinstance(obj.get("auto_enabled", False), bool), "speculation.auto_enabled must be true or false")
        sources = {
            name: SourceSpeculation.from_json(name, obj[name]) for name in SOURCE_NAMES if obj.get(name) is not None
        }
        known = ("source", "auto_enabled", *sources)
        return cls(obj.get("source"), obj.get("auto_enabled", False), sources, extras(obj, known), tuple(obj))

    def to_json(self) -> JsonObject:
        values: JsonObject = {"source": self.source, "auto_enabled": self.auto_enabled}
        values.update({name: section.to_json() for name, section in self.sources.items()})
        return _ordered({**values, **self.extra}, self.key_order)


# ---- backends, files ---------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """One weight in the onnx backend's weights file: numpy dtype string, shape, byte range."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    bytes: int

    @classmethod
    def from_json(cls, name: str, meta: Any) -> TensorEntry:
        need(
            isinstance(meta, dict)
            and isinstance(meta.get("dtype"), str)
            and meta["dtype"] in DTYPE_SIZES
            and is_int(meta.get("offset"))
            and meta["offset"] >= 0
            and is_int(meta.get("bytes"))
            and meta["bytes"] >= 0
            and isinstance(meta.get("shape"), list)
            and len(meta["shape"]) <= 8
            and all(is_int(d) and d >= 0 for d in meta["shape"]),
            f"weight table entry {name!r} is malformed",
        )
        need(
            math.prod(meta["shape"]) * DTYPE_SIZES[meta["dtype"]] == meta["bytes"],
            f"weight table entry {name!r}: shape {meta['shape']} of {meta['dtype']} is not {meta['bytes']} bytes",
        )
        return cls(meta["dtype"], tuple(meta["shape"]), meta["offset"], meta["bytes"])

    def to_json(self) -> JsonObject:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "bytes": self.bytes}


@dataclass(frozen=True)
class EngineEntry:
    """A backend's engine for one graph: its file (onnx), the ONNX file it is built from
    (tensorrt), the weights the runtime supplies from the weights file (onnx); other keys
    (coreml's function and I/O) in `extra`."""

    file: str | None = None
    onnx: str | None = None
    initializers: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, backend: str, graph: str, obj: Any) -> EngineEntry:
        need(isinstance(obj, dict), f"backend {backend!r} engine {graph!r} is not an object")
        need(isinstance(obj.get("file", ""), str), f"backend {backend!r} engine {graph!r} has a non-string file")
        need(
            is_str_list(obj.get("initializers", [])),
            f"backend {backend!r} engine {graph!r} has a bad initializer list",
        )
        need(isinstance(obj.get("onnx", ""), str), f"backend {backend!r} engine {graph!r} has a non-string onnx file")
        initializers = obj.get("initializers")
        return cls(
            obj.get("file"),
            obj.get("onnx"),
            None if initializers is None else tuple(initializers),
            extras(obj, ("file", "onnx", "initializers")),
            tuple(obj),
        )

    def files(self) -> list[str]:
        return [path for path in (self.file, self.onnx) if path is not None]

    def to_json(self) -> JsonObject:
        values: JsonObject = {"file": self.file, "onnx": self.onnx, "initializers": self.initializers}
        values = {key: list(v) if isinstance(v, tuple) else v for key, v in values.items() if v is not None}
        return _ordered({**values, **self.extra}, self.key_order or ("file", "initializers"))


_BACKEND_KEYS = ("graphs", "weights", "weight_bytes", "tensors", "flavour", "quantize", "precision", "package")


@dataclass(frozen=True)
class BackendEntry:
    """One backend's part of the bundle: its engine per graph, and for onnx the shared weights
    file with its tensor table. `flavour` and `quantize` describe the onnx engines,
    `precision` a compiled backend's, `package` CoreML's multifunction model."""

    name: str
    graphs: Mapping[str, EngineEntry]
    weights: str | None = None
    weight_bytes: int = 0  # onnx: the weights file's size
    tensors: Mapping[str, TensorEntry] = field(default_factory=dict)  # onnx: the weights file's table
    flavour: str = "portable"
    quantize: str = "none"
    precision: str | None = None
    package: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, name: str, obj: Any, graphs: Mapping[str, GraphEntry]) -> BackendEntry:
        need(isinstance(obj, dict) and isinstance(obj.get("graphs"), dict), f"backend {name!r} lacks a graphs table")
        engines = {}
        for graph_name, engine in obj["graphs"].items():
            need(graph_name in graphs, f"backend {name!r} has an engine for unknown graph {graph_name!r}")
            engines[graph_name] = EngineEntry.from_json(name, graph_name, engine)
        for key in ("flavour", "quantize", "precision", "package"):
            optional_str(obj, key, f"backends.{name}.{key} must be a string")
        weights = obj.get("weights")
        entry = cls(
            name, engines, weights if isinstance(weights, str) else None, 0, {},
            obj.get("flavour", "portable"), obj.get("quantize", "none"), obj.get("precision"), obj.get("package"),
            extras(obj, _BACKEND_KEYS if name == "onnx" else _BACKEND_KEYS[:2] + _BACKEND_KEYS[4:]), tuple(obj),
        )  # fmt: skip
        if name == "onnx":
            return entry._checked_onnx(obj)
        if weights is not None and not isinstance(weights, str):  # kept as it was written (not a path)
            return cls(**{**entry.__dict__, "extra": {**entry.extra, "weights": weights}})
        return entry

    def _checked_onnx(self, obj: Mapping[str, Any]) -> BackendEntry:
        """The onnx backend: a weights file, its tensor table, every engine's file and initializers."""
        need(isinstance(obj.get("weights"), str), "backends.onnx.weights must be a path")
        need(
            is_int(obj.get("weight_bytes", 0)) and obj.get("weight_bytes", 0) >= 0,
            "backends.onnx.weight_bytes must be a byte count",
        )
        table = obj.get("tensors")
        need(isinstance(table, dict) and len(table) <= limits.MAX_TENSORS, "backends.onnx.tensors must be an object")
        tensors = {name: TensorEntry.from_json(name, meta) for name, meta in dict(table or {}).items()}
        for graph_name, engine in self.graphs.items():
            need(engine.file is not None, f"onnx engine {graph_name!r} lacks its file")
            need(engine.initializers is not None, f"onnx engine {graph_name!r} lacks its initializer list")
            need(
                all(n in tensors for n in engine.initializers or ()),
                f"onnx engine {graph_name!r} uses a weight missing from the table",
            )
        return BackendEntry(**{**self.__dict__, "tensors": tensors, "weight_bytes": obj.get("weight_bytes", 0)})

    def engine(self, graph: str) -> EngineEntry:
        engine = self.graphs.get(graph)
        if engine is None:
            raise UsageError(f"the {self.name} backend has no engine for graph {graph!r}", "rebuild the bundle")
        return engine

    def to_json(self) -> JsonObject:
        values: JsonObject = {"weights": self.weights, "precision": self.precision, "package": self.package}
        values = {key: value for key, value in values.items() if value is not None}
        if self.name == "onnx":
            values["weight_bytes"] = self.weight_bytes
            values["tensors"] = {name: tensor.to_json() for name, tensor in self.tensors.items()}
        if "flavour" in self.key_order or self.flavour != "portable":
            values["flavour"] = self.flavour
        if "quantize" in self.key_order or self.quantize != "none":
            values["quantize"] = self.quantize
        values["graphs"] = {name: engine.to_json() for name, engine in self.graphs.items()}
        return _ordered({**values, **self.extra}, self.key_order)


@dataclass(frozen=True)
class DraftVocab:
    """VocabTrim's reduced draft vocabulary: `size` int32 token ids in `file` (checked when read)."""

    file: str
    size: int

    @classmethod
    def from_json(cls, obj: Any, graphs: Mapping[str, GraphEntry], vocab_size: int) -> DraftVocab | None:
        """One reduced draft vocabulary per bundle, sized as every graph that scores it."""
        sizes = {graph.draft_vocab for graph in graphs.values()} - {0}
        if obj is None:
            need(not sizes, "a graph drafts over a reduced vocabulary, but the manifest has no 'draft_vocab' file")
            return None
        need(
            isinstance(obj, dict)
            and isinstance(obj.get("file"), str)
            and is_int(obj.get("size"))
            and 0 < obj["size"] < vocab_size,
            f"key 'draft_vocab' must be {{file, size}} with size in 1..{vocab_size - 1}",
        )  # fmt: skip
        need(sizes <= {obj["size"]}, f"a graph's draft_vocab differs from the bundle's draft_vocab size {obj['size']}")
        return cls(obj["file"], obj["size"])

    def to_json(self) -> JsonObject:
        return {"file": self.file, "size": self.size}


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int

    @classmethod
    def from_json(cls, path: Any, obj: Any) -> FileEntry:
        need_path(path, f"in 'files' ({ascii(path)})")
        need(path != "manifest.json", "'files' lists manifest.json itself")
        need(
            isinstance(obj, dict)
            and isinstance(obj.get("sha256"), str)
            and len(obj["sha256"]) == 64
            and all(c in "0123456789abcdef" for c in obj["sha256"])
            and is_int(obj.get("bytes"))
            and obj["bytes"] >= 0,
            f"files entry {ascii(path)} lacks a sha256 hex digest or a byte count",
        )
        return cls(obj["sha256"], obj["bytes"])

    def to_json(self) -> JsonObject:
        return {"sha256": self.sha256, "bytes": self.bytes}


# ---- the manifest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """manifest.json: everything the runtime reads from a bundle, checked before any backend sees it."""

    model: ModelDims
    max_len: int  # the KV arena length
    dtype: str  # the engines' weight precision, one of DTYPES
    router_threshold: float  # the runtime keeps layer i iff p_i >= this
    tokenizer: TokenizerEntry
    configs: tuple[ConfigEntry, ...]
    speculation: Speculation | None
    graphs: Mapping[str, GraphEntry]
    backends: Mapping[str, BackendEntry]
    calibration: str | None = None  # calibration.json, when calibration ran
    draft_vocab: DraftVocab | None = None
    files: Mapping[str, FileEntry] = field(default_factory=dict)

    def graph(self, name: str) -> GraphEntry:
        return self.graphs[name]

    def config(self, config_id: str) -> ConfigEntry:
        for config in self.configs:
            if config.id == config_id:
                return config
        known = ", ".join(c.id for c in self.configs)
        raise UsageError(f"unknown configuration {config_id!r}", f"use auto, or one of: {known}")

    def calibrated(self, source: str) -> SourceSpeculation:
        """What calibration measured for a draft source (empty without speculation)."""
        return self.speculation.of(source) if self.speculation else SourceSpeculation()

    def referenced_files(self) -> list[str]:
        """Every file of the bundle the runtime opens."""
        paths = [self.tokenizer.file]
        if self.calibration:
            paths.append(self.calibration)
        if self.draft_vocab:
            paths.append(self.draft_vocab.file)
        for entry in self.backends.values():
            if entry.weights is not None:
                paths.append(entry.weights)
            for engine in entry.graphs.values():
                paths.extend(engine.files())
        return paths

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """Parse and check every field the runtime reads (any malformed value: UsageError)."""
        _check_header(obj)
        model = ModelDims.from_json(obj["model"])
        tokenizer = TokenizerEntry.from_json(obj["tokenizer"], model.vocab_size)
        graphs, configs = _graphs_and_configs(obj, model.num_layers)
        backends = {name: BackendEntry.from_json(name, entry, graphs) for name, entry in obj["backends"].items()}
        files = {path: FileEntry.from_json(path, entry) for path, entry in obj["files"].items()}
        draft_vocab = DraftVocab.from_json(obj.get("draft_vocab"), graphs, model.vocab_size)
        speculation = Speculation.from_json(obj.get("speculation"))
        need(
            obj.get("calibration") is None or isinstance(obj["calibration"], str),
            "key 'calibration' has the wrong type",
        )
        manifest = cls(
            model, obj["max_len"], obj["dtype"], obj["router_threshold"], tokenizer, configs, speculation, graphs,
            backends, obj.get("calibration"), draft_vocab, files,
        )  # fmt: skip
        for path in manifest.referenced_files():
            need_path(path, ascii(path))
            need(path in files, f"file {ascii(path)} is used but not listed in 'files' with a checksum")
        return manifest

    def to_json(self) -> JsonObject:
        return {
            "schema_version": SCHEMA_VERSION,
            "format": FORMAT,
            "model": self.model.to_json(),
            "max_len": self.max_len,
            "dtype": self.dtype,
            "router_threshold": self.router_threshold,
            "tokenizer": self.tokenizer.to_json(),
            "configs": [config.to_json() for config in self.configs],
            "speculation": self.speculation.to_json() if self.speculation else None,
            "graphs": {name: graph.to_json() for name, graph in self.graphs.items()},
            "backends": {name: entry.to_json() for name, entry in self.backends.items()},
            "calibration": self.calibration,
            "draft_vocab": self.draft_vocab.to_json() if self.draft_vocab else None,
            "files": {path: entry.to_json() for path, entry in self.files.items()},
        }


def _check_header(obj: Any) -> None:
    """The top level: an adaptive-export manifest of this schema, with its keys and scalars."""
    need(isinstance(obj, dict), "the top level is not a JSON object")
    if obj.get("format") != FORMAT:
        raise UsageError(
            "this directory's manifest.json is not an adaptive-export bundle manifest",
            "point at a directory written by `adaptive-export build`",
        )
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UsageError(
            f"bundle schema_version {version!r} is not supported (this runtime reads {SCHEMA_VERSION})",
            "rebuild the bundle with this version of adaptive-export, or upgrade adaptive-export",
        )
    for key in ("model", "tokenizer", "graphs", "backends", "files"):
        need_object(obj, key, "")
    need("configs" in obj, "missing key 'configs'")
    need(isinstance(obj["configs"], list), "key 'configs' has the wrong type")
    for key in ("max_len", "dtype", "router_threshold"):
        need(key in obj, f"missing key {key!r}")
    need(is_int(obj["max_len"]) and obj["max_len"] > 0, "key 'max_len' has the wrong type or is not positive")
    need(obj["dtype"] in DTYPES, f"key 'dtype' must be one of {', '.join(DTYPES)}")
    threshold = obj["router_threshold"]
    need(
        isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0.0 <= threshold <= 1.0,
        "key 'router_threshold' must be a number in [0, 1]",
    )
    need(obj["max_len"] <= limits.MAX_LEN, f"max_len {obj['max_len']} exceeds the runtime's limit {limits.MAX_LEN}")


def _graphs_and_configs(
    obj: Mapping[str, Any], num_layers: int
) -> tuple[dict[str, GraphEntry], tuple[ConfigEntry, ...]]:
    """The graphs (a prefill over every layer among them) and the configurations ('full' among them)."""
    need(
        len(obj["graphs"]) <= limits.MAX_GRAPHS
        and len(obj["configs"]) <= limits.MAX_CONFIGS
        and len(obj["files"]) <= limits.MAX_FILES,
        "too many graphs, configurations or files",
    )
    need("prefill" in obj["graphs"], "no 'prefill' graph")
    graphs = {name: GraphEntry.from_json(name, graph, num_layers) for name, graph in obj["graphs"].items()}
    prefill = graphs["prefill"]
    need(
        prefill.kind == "prefill" and prefill.source == "ids" and sorted(prefill.layers) == list(range(num_layers)),
        "graph 'prefill' must be a prefill over token ids and every layer",
    )
    configs: list[ConfigEntry] = []
    for config in obj["configs"]:
        parsed = ConfigEntry.from_json(config, graphs, num_layers)
        need(all(parsed.id != c.id for c in configs), f"config id {parsed.id!r} appears twice")
        configs.append(parsed)
    need(any(c.id == "full" for c in configs), "no 'full' configuration")
    full = next(c for c in configs if c.id == "full")
    need(sorted(set(full.kept)) == list(range(num_layers)), "configuration 'full' must keep every layer")
    return graphs, tuple(configs)


def validate(obj: Any) -> Manifest:
    """Parse and check a manifest.json object (Manifest.from_json)."""
    return Manifest.from_json(obj)
