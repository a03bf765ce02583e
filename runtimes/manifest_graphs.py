"""The manifest's graphs and skip configurations (docs/architecture.md sections 2-4), typed.

A graph entry says what one engine computes, so the runtime knows its I/O without opening it;
a configuration names the engines of one kept-layer set by role. A draft source's own graph
fields and engine roles are declared and checked by its contract (runtimes/draft_contracts.py
DraftContract: `graph_fields`, `engine_kinds`, `check_graph_field`, `check_engines`), which its
runtime class inherits; the manifest types never import the draft sources themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.draft_contracts import CONTRACTS, GUESS_FIELDS, PRECISIONS
from adaptive_export.runtimes.manifest_fields import is_int, is_name, is_str_list, need

GRAPH_KINDS = ("prefill", "decode", "draft", "verify")
_KIND_SOURCE = {"prefill": "ids", "decode": "ids", "draft": "ids", "verify": "hidden"}
_ROLE_KINDS = {
    "decode": "decode",
    **{role: kind for source in CONTRACTS.values() for role, kind in source.engine_kinds.items()},
}
# every draft source's integer graph fields, in registry order (the manifest writes each, 0 when unset)
DRAFT_FIELDS = tuple((source, key) for source in CONTRACTS.values() for key in source.graph_fields)


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
    # the draft sources' graph fields that are set (DRAFT_FIELDS), as sorted (key, value) pairs
    draft_fields: tuple[tuple[str, int], ...] = ()
    draft_vocab: int = 0  # VocabTrim: the token ids a precision draft's head scores (0: all)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    skip_adapters: bool = False  # a skip configuration's decode adapts its kept layers (FiRST's LoRA)

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
        if self.guesses:
            names.append("guesses")
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
            self.draft_fields,
            self.draft_vocab,
            self.skip_adapters,
        )

    @property
    def guesses(self) -> bool:
        """Whether the graph also outputs a draft source's guess per row (GUESS_FIELDS)."""
        return any(self.draft_field(key) for key in GUESS_FIELDS)

    def draft_field(self, key: str) -> int:
        """A draft source's graph field (DRAFT_FIELDS), 0 when unset."""
        return dict(self.draft_fields).get(key, 0)

    def draft_fields_json(self) -> dict[str, int]:
        """Every registered draft field by key, 0 when unset: the manifest's and `inspect`'s form."""
        return {key: self.draft_field(key) for _, key in DRAFT_FIELDS}

    def logits_width(self, vocab_size: int) -> int:
        """Columns of the logits: the vocabulary, or a reduced draft head's token count."""
        return self.draft_vocab or vocab_size

    @classmethod
    def from_json(cls, name: Any, obj: Any, num_layers: int) -> GraphEntry:
        entry = _graph_fields(name, obj, num_layers)
        _check_graph_io(entry)
        return entry

    def to_json(self) -> dict[str, object]:
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
            **self.draft_fields_json(),
            "draft_vocab": self.draft_vocab,
            "skip_adapters": self.skip_adapters,
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
    for flag in ("router_scores", "exit_hidden", "exit_adapter", "skip_adapters"):
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
    draft_fields, draft_vocab = _draft_fields(name, kind, graph), graph.get("draft_vocab", 0)
    need(
        is_int(draft_vocab)
        and 0 <= draft_vocab <= limits.MAX_VOCAB
        and (precision is not None or kind == "draft" or not draft_vocab),
        f"graph {name!r} has a bad draft_vocab "
        "(a precision or early-exit draft may score 1..vocab_size-1 token ids, other graphs 0)",
    )
    need(graph.get("flavour", "portable") in ("portable", "ort"), f"graph {name!r} has an unknown flavour")
    routers, exit_hidden, adapter, skip_adapters = (
        graph.get(flag, False) for flag in ("router_scores", "exit_hidden", "exit_adapter", "skip_adapters")
    )
    need(
        not skip_adapters or (kind != "prefill" and graph.get("config") not in (None, "full")),
        f"graph {name!r} adapts skipped layers, which only a skip configuration's decode, draft or verify graph may",
    )
    return GraphEntry(
        name, kind, tuple(layers), source, logits, routers, exit_hidden, adapter, graph.get("config"),
        graph.get("exit_layer"), graph.get("flavour", "portable"), precision, draft_fields, draft_vocab,
        tuple(graph["inputs"]), tuple(graph["outputs"]), skip_adapters,
    )  # fmt: skip


def _draft_fields(name: str, kind: str, graph: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The draft sources' graph fields, each checked by its source; the set ones, sorted by key."""
    values = []
    for source, key in DRAFT_FIELDS:
        value = graph.get(key, 0)
        source.check_graph_field(name, kind, key, value)
        if value:
            values.append((key, int(value)))
    return tuple(sorted(values))


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
    for flag in ("router_scores", "exit_hidden", "guesses"):
        need(getattr(graph, flag) or flag not in outputs, f"graph {name!r} has output {flag!r} without its flag")


@dataclass(frozen=True)
class ConfigEntry:
    """A skip configuration: the layers it keeps and its engines by role (decode, and the draft
    sources' own roles: runtimes/draft_contracts.py), each the name of a graph."""

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
            need(role in _ROLE_KINDS, f"config {config_id!r} has an engine of unknown role {str(role)[:40]!r}")
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
        for source in CONTRACTS.values():
            source.check_engines(self.id, engines, graphs)

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "kept": list(self.kept), "engines": dict(self.engines)}
