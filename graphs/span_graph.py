"""One exportable graph: a span of decoder layers between an input and the outputs.

Every graph of a bundle (prefill, decode per configuration, draft, verify) is one `GraphSpec`
with a different layer list and I/O options. `SpanFlow` is what such a graph computes, in
either flavour (graphs/decoder_layer.py's layers, routers, exit adapter, head, outputs);
`SpanGraph` is the portable flavour, whose inputs and outputs follow the portable arena
contract (docs/architecture.md section 4): per layer i in the span, `past_key_i` and
`past_value_i` are prefix views [P, n_kv, hd]; `new_key_i` / `new_value_i` are the T new rows,
which the runtime writes into the arena at [P:P+T]. The ort flavour is graphs/fused_graph.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import Tensor, nn

from adaptive_export.graphs.adaptive import ExitAdapter, Routers
from adaptive_export.graphs.architectures import architecture
from adaptive_export.graphs.decoder_layer import DecoderLayer
from adaptive_export.graphs.layers import DecoderStack, Head, PrefixKV
from adaptive_export.graphs.spec import ModelSpec

# the exported names of a guessing head's initializers (the graph module's `guess` attribute)
GUESS_PREFIX = "guess."

if TYPE_CHECKING:  # the ort flavour's module imports this one
    from adaptive_export.graphs.fused_graph import PackedWeights


@dataclass(frozen=True)
class GraphSpec:
    """What one graph computes; stored in the manifest so the runtime knows its I/O.

    Its manifest form is runtimes.manifest.GraphEntry, with the same field names, which alone
    derives the I/O names (graphs/ may not import runtimes/, so exporter/graph_entry.py copies
    the fields by name and checks at import that both declare the same ones)."""

    name: str
    kind: Literal["prefill", "decode", "draft", "verify"]
    layers: tuple[int, ...]
    source: Literal["ids", "hidden"] = "ids"
    logits: Literal["all", "last"] = "all"
    router_scores: bool = False
    exit_hidden: bool = False
    exit_adapter: bool = False
    config: str = "full"
    exit_layer: int | None = None
    # "portable": KV prefix in, new rows out, standard ops (CoreML, TensorRT, any runtime);
    # "ort": ONNX Runtime's fused ops, KV blocks updated in place (graphs/fused_graph.py).
    flavour: Literal["portable", "ort"] = "portable"
    # A precision draft (kind "decode"): the same graph with its weights at this precision
    # ("int8"/"int4": RTN of the float weights; "native4": the GGUF's blocks at accuracy 4),
    # drafting for the bundle's own precision on the same arena. None: the bundle's precision.
    precision: str | None = None
    # Integer fields a draft source's graph piece sets (graphs/drafts/<name>.py; its runtime class
    # declares and checks them in the manifest), as sorted (key, value) pairs; unset keys are 0.
    draft_fields: tuple[tuple[str, int], ...] = ()
    # VocabTrim (a precision draft): the head scores only the bundle's `draft_vocab` token ids
    # (draft_vocab.bin), so logits are [.., draft_vocab] and the runtime maps row j to id ids[j].
    # 0: the full vocabulary.
    draft_vocab: int = 0
    # A skip configuration's decode graph adapts every kept layer's output with the bundle's
    # shared skip adapters (FiRST's LoRA compensation, calibration/skip_adapters.py).
    skip_adapters: bool = False

    def draft_field(self, key: str) -> int:
        return dict(self.draft_fields).get(key, 0)

    def with_draft_field(self, key: str, value: int) -> GraphSpec:
        fields = {**dict(self.draft_fields), key: value}
        return replace(self, draft_fields=tuple(sorted((k, v) for k, v in fields.items() if v)))


@dataclass
class ModelParts:
    """The HF model plus the optional routers and exit adapters the graphs may use."""

    hf_model: nn.Module
    spec: ModelSpec
    routers: Routers | None = None
    exit_adapters: dict[int, ExitAdapter] = field(default_factory=dict)
    skip_adapters: dict[int, ExitAdapter] = field(default_factory=dict)  # per layer, shared by the configurations
    # trained tables a draft source's graphs embed or run, by source name (graphs/drafts/<name>.py)
    draft_tables: dict[str, torch.Tensor] = field(default_factory=dict)
    draft_vocab: torch.Tensor | None = None  # VocabTrim: the sorted token ids a draft head scores (int64)
    # Derived once per build and shared by its graphs (graphs/fused_graph.packed_weights, draft_head):
    packed_by_max_len: dict[int, PackedWeights] = field(default_factory=dict, repr=False, compare=False)
    draft_heads: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)


def appended_embeddings(parts: ModelParts, graph: GraphSpec) -> torch.Tensor | None:
    """Rows that ids vocab.. embed as (a draft source's trained table; graphs/drafts/), or None."""
    from adaptive_export.graphs.drafts import appended_embeddings as of_pieces  # the pieces import this module

    return of_pieces(parts, graph)


def guess_head(parts: ModelParts, graph: GraphSpec) -> nn.Module | None:
    """The head a graph guesses with after each row (a draft source's; graphs/drafts/), or None."""
    from adaptive_export.graphs.drafts import guess_head as of_pieces  # the pieces import this module

    return of_pieces(parts, graph)


def draft_head(parts: ModelParts, graph: GraphSpec) -> torch.Tensor | None:
    """The LM head rows a graph's reduced draft vocabulary scores (the same tensor for every graph
    and flavour, so the weight store keeps one copy), or a clear error if the ids are missing."""
    if not graph.draft_vocab:
        return None
    ids = parts.draft_vocab
    if ids is None or ids.numel() != graph.draft_vocab:
        raise ValueError(
            f"graph {graph.name!r} drafts over {graph.draft_vocab} token ids, but the model parts hold "
            f"{0 if ids is None else ids.numel()}"
        )
    if graph.draft_vocab not in parts.draft_heads:
        weight = architecture(parts.spec.model_type).lm_head(parts.hf_model).weight.detach()
        parts.draft_heads[graph.draft_vocab] = weight.index_select(0, ids).contiguous()
    return parts.draft_heads[graph.draft_vocab]


def trainable_additions(parts: ModelParts, graph: GraphSpec) -> tuple[Routers | None, ExitAdapter | None]:
    """The routers and exit adapter a graph uses (both flavours), or a clear error if missing."""
    routers = parts.routers if graph.router_scores else None
    if graph.router_scores and parts.routers is None:
        raise ValueError("router_scores requested but the model has no routers")
    adapter = parts.exit_adapters.get(graph.exit_layer) if graph.exit_adapter else None
    if graph.exit_adapter and adapter is None:
        raise ValueError(f"no exit adapter fitted for exit layer {graph.exit_layer}")
    return routers, adapter


def layer_adapters(parts: ModelParts, graph: GraphSpec) -> nn.ModuleDict | None:
    """The skip adapters of a graph's layers, keyed by layer id, or None (a clear error if missing)."""
    if not graph.skip_adapters:
        return None
    missing = sorted(set(graph.layers) - set(parts.skip_adapters))
    if missing:
        raise ValueError(f"graph {graph.name!r} adapts its layers, but no skip adapter was trained for {missing}")
    return nn.ModuleDict({str(layer): parts.skip_adapters[layer] for layer in graph.layers})


class SpanFlow(nn.Module):
    """What every graph computes over its layers, in either flavour: the layers on the residual
    stream (each router scoring its layer's input), then the head on the chosen rows (through
    the exit adapter where the graph has one), then the outputs the GraphSpec asks for.

    A flavour's graph sets the attributes below and says how its tensors carry the batch axis.
    """

    graph: GraphSpec
    layers: nn.ModuleList
    head: Head
    routers: Routers | None
    adapter: ExitAdapter | None
    layer_adapters: nn.ModuleDict | None
    draft_head: Tensor | None
    guess: nn.Module | None

    def add_graph_parts(self, parts: ModelParts, graph: GraphSpec) -> None:
        """The GraphSpec's own additions: routers, exit adapter, a VocabTrim draft head, a guessing head."""
        self.graph = graph
        self.routers, self.adapter = trainable_additions(parts, graph)
        self.layer_adapters = layer_adapters(parts, graph)
        self.register_buffer("draft_head", draft_head(parts, graph), persistent=False)
        self.guess = guess_head(parts, graph)  # its initializers' names start with GUESS_PREFIX

    def tokens(self, x: Tensor) -> Tensor:
        """x [.., T, H] as [T, H] (the routers score tokens, the head reads rows)."""
        raise NotImplementedError

    def batched(self, x: Tensor) -> Tensor:
        """x [.., T, H] as the graph's [1, T, H] output."""
        raise NotImplementedError

    def run_layers(self, x: Tensor, kv: Sequence[Any]) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """(hidden state after the span, each layer's K, V, each router's score) from input x and
        each layer's KV inputs; with skip adapters, each layer's output is adapted."""
        keys, values, scores = [], [], []
        delta: Tensor | None = None
        residual = x
        for layer, inputs in zip(cast("list[DecoderLayer]", list(self.layers)), kv):
            h, residual = layer.normed_input(delta, residual)
            if self.routers is not None:
                scores.append(self.routers.score(layer.layer_id, self.tokens(residual)))
            delta, residual, key, value = layer.attend_and_mlp(h, residual, inputs)
            if self.layer_adapters is not None:
                residual, delta = self.layer_adapters[str(layer.layer_id)](residual + delta), None
            keys.append(key)
            values.append(value)
        return residual if delta is None else residual + delta, keys, values, scores

    def outputs(
        self, hidden: Tensor, rows: Tensor, keys: list[Tensor], values: list[Tensor], scores: list[Tensor]
    ) -> tuple[Tensor, ...]:
        """The graph's outputs in GraphEntry.output_names order; `rows` [.., R, H] get logits (the
        exit adapter and the final norm keep the flavour's axes, the head reads [R, H])."""
        if self.adapter is not None:
            rows = self.adapter(rows)
        logits = self.head.logits(self.tokens(self.head.normed(rows)), self.draft_head)
        outputs: list[Tensor] = [logits[None]]
        if self.routers is not None:
            outputs.append(torch.stack(scores))
        if self.graph.exit_hidden:
            outputs.append(self.batched(hidden))
        if self.guess is not None:  # per row, the token after the row's choice (a draft source's head)
            outputs.append(self.guess(self.tokens(rows), logits, self.head)[None])
        return tuple(outputs + keys + values)


class SpanGraph(DecoderStack, SpanFlow):
    """Portable static graph for one GraphSpec; traced once with T and P as dynamic axes."""

    def __init__(self, parts: ModelParts, graph: GraphSpec) -> None:
        if not graph.layers:
            raise ValueError(f"graph {graph.name!r} has no layers")
        super().__init__(parts.hf_model, parts.spec, graph.layers, embed=graph.source == "ids")
        self.add_graph_parts(parts, graph)
        self.set_appended_embeddings(appended_embeddings(parts, graph))

    def tokens(self, x: Tensor) -> Tensor:
        return x

    def batched(self, x: Tensor) -> Tensor:
        return x[None]

    def forward(self, first: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        n = len(self.layers)
        past_keys, past_values = past[:n], past[n:]
        x = self.embed_ids(first[0]) if self.embed is not None else first[0]
        frame = self.frame(past_keys[0].shape[0], x.shape[0])
        kv = [PrefixKV(key, value, *at) for key, value, at in zip(past_keys, past_values, frame)]
        hidden, keys, values, scores = self.run_layers(x, kv)
        rows = hidden[-1:] if self.graph.logits == "last" else hidden
        return self.outputs(hidden, rows, keys, values, scores)
