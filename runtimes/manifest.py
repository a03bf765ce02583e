"""The manifest.json contract as frozen dataclasses, shared by the writer (exporter) and the
reader (runtime) (docs/architecture.md section 3): the model, tokenizer and draft vocabulary
here with the `Manifest` itself; graphs and configurations in runtimes/manifest_graphs.py,
speculation in runtimes/manifest_speculation.py, backends and files in runtimes/manifest_backends.py.

Each type is parsed and checked once, by its strict `from_json`, and written by `to_json`;
a field is declared, serialised and validated in one place. Keys a type does not read are
kept verbatim in `extra` (tools read them, e.g. calibration's notes in `speculation`) and
written back in their original order, so a bundle's manifest round-trips unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest_backends import DTYPE_SIZES, BackendEntry, EngineEntry, FileEntry, TensorEntry
from adaptive_export.runtimes.manifest_fields import (
    extras,
    fail,
    is_int,
    need,
    need_object,
    need_path,
    ordered,
    path_problem,
)
from adaptive_export.runtimes.manifest_graphs import GRAPH_KINDS, PRECISIONS, ConfigEntry, GraphEntry
from adaptive_export.runtimes.manifest_prompt_rows import PromptRows
from adaptive_export.runtimes.manifest_speculation import SourceSpeculation, Speculation

SCHEMA_VERSION = 1
FORMAT = "adaptive-export-bundle"
DTYPES = ("float32", "float16", "int8", "int4")

__all__ = [  # the types live in the manifest_* modules; import them from here
    "SCHEMA_VERSION",
    "FORMAT",
    "PRECISIONS",
    "DTYPES",
    "DTYPE_SIZES",
    "GRAPH_KINDS",
    "ModelDims",
    "ChatFormat",
    "TokenizerEntry",
    "GraphEntry",
    "ConfigEntry",
    "SourceSpeculation",
    "Speculation",
    "PromptRows",
    "TensorEntry",
    "EngineEntry",
    "BackendEntry",
    "DraftVocab",
    "FileEntry",
    "Manifest",
    "path_problem",
    "validate",
]

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

    def to_json(self) -> dict[str, object]:
        values = {key: getattr(self, key) for key in _MODEL_INTS}
        values.update(model_type=self.model_type, **self.extra, source=self.source)
        return ordered(values, self.key_order or ("model_type",))


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

    def to_json(self) -> dict[str, object]:
        return {
            "file": self.file,
            "chat": self.chat.to_json() if self.chat else None,
            "eos_token_ids": list(self.eos_token_ids),
            "prefix_token_ids": list(self.prefix_token_ids),
        }


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

    def to_json(self) -> dict[str, str | int]:
        return {"file": self.file, "size": self.size}


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
    prompt_rows: PromptRows | None = None  # the rows each prompt kind decodes on, as build measured

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
        for name, entry in self.backends.items():
            if name == "onnx" and entry.weights is not None:  # only onnx's weights is a file; others describe
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
            backends, obj.get("calibration"), draft_vocab, files, PromptRows.from_json(obj.get("prompt_rows")),
        )  # fmt: skip
        for path in manifest.referenced_files():
            need_path(path, ascii(path))
            need(path in files, f"file {ascii(path)} is used but not listed in 'files' with a checksum")
        return manifest

    def to_json(self) -> dict[str, object]:
        optional = {"prompt_rows": self.prompt_rows.to_json()} if self.prompt_rows is not None else {}
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
            **optional,
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
