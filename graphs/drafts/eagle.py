"""The EAGLE head's graph piece: the full configuration's decode graph also guesses, per row, the
token after the one that row chooses, from the row's last hidden state and that token's embedding
(EAGLE's feature + token input, k = 1). The guess rides out of the same pass as an int64 output
(`guesses`), so the next round's draft costs no engine call of its own and every mode of the
bundle runs the same decode graph (its rows, and so its tokens, do not change).

The head: a gated MLP over [rms(h), rms(embed(x))] added to h, the model's own final norm, and
the LM head's rows of the bundle's draft vocabulary (VocabTrim: draft_vocab.bin); its argmax
mapped back to a token id. Its trained weights are one table (`pack`), shipped as
eagle_head.safetensors and read back by `check`. Graph field `eagle`: the MLP's width."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from adaptive_export.graphs.architectures import architecture
from adaptive_export.graphs.layers import Head, embed_tokens
from adaptive_export.graphs.plan import decode_field_role, with_full_decode_field

if TYPE_CHECKING:  # the plan applies this piece
    from adaptive_export.graphs.plan import BuildPlan
    from adaptive_export.graphs.span_graph import GraphSpec, ModelParts

# the decode graph's field (the head's width), its engine role and its table's key in ModelParts.draft_tables
FIELD = ROLE = TABLE = "eagle"


def rms(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class EagleBlock(nn.Module):
    """h + down(silu(gate(n)) * up(n)), n = [rms(h), rms(e)]: the next state the head reads.
    Both inputs are normalised, so the family's embedding scale does not matter."""

    def __init__(self, hidden_size: int, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.gate = nn.Linear(2 * hidden_size, width, bias=False)
        self.up = nn.Linear(2 * hidden_size, width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)  # starts as the identity: the head then reads h as the model's head does

    def forward(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        n = torch.cat([rms(hidden, self.eps), rms(embedded, self.eps)], -1)
        return hidden + self.down(nn.functional.silu(self.gate(n)) * self.up(n))


class PairBlock(nn.Module):
    """The block over [h | e] features in one tensor: the one input a training draft hands its block
    (calibration/draft_training.py TrimmedDraft)."""

    def __init__(self, block: EagleBlock, hidden: int) -> None:
        super().__init__()
        self.block, self.hidden = block, hidden

    def forward(self, pair: Tensor) -> Tensor:
        return self.block(pair[..., : self.hidden], pair[..., self.hidden :])


def pack(block: EagleBlock) -> Tensor:
    """The block's weights as one [5 * width, hidden] table: gate and up as [2 * width, hidden] each
    (their [width, 2 * hidden] rows split in halves), then down transposed."""
    width = block.gate.weight.shape[0]
    hidden = block.down.weight.shape[0]
    parts = (
        block.gate.weight.reshape(2 * width, hidden),
        block.up.weight.reshape(2 * width, hidden),
        block.down.weight.t(),
    )
    return torch.cat([p.detach().float() for p in parts]).contiguous()


def unpack(table: Tensor, eps: float) -> EagleBlock:
    """The block a `pack`ed table holds (its width is a fifth of its rows)."""
    rows, hidden = table.shape
    width = rows // 5
    if rows != 5 * width or width < 1:
        raise ValueError(f"an EAGLE head table has 5 x width rows, not {rows}")
    block = EagleBlock(hidden, width, eps)
    with torch.no_grad():
        block.gate.weight.copy_(table[: 2 * width].reshape(width, 2 * hidden))
        block.up.weight.copy_(table[2 * width : 4 * width].reshape(width, 2 * hidden))
        block.down.weight.copy_(table[4 * width :].t())
    return block.eval()


class Guesses(nn.Module):
    """Per row: block(h, embed(argmax logits)) -> final norm -> trimmed head -> argmax -> token id."""

    def __init__(self, parts: ModelParts, table: Tensor, ids: Tensor) -> None:
        super().__init__()
        spec = parts.spec
        arch = architecture(spec.model_type)
        self.block = unpack(table, spec.rms_norm_eps)
        self.embed, self.embed_scale, self.vocab = arch.embed(parts.hf_model), arch.embed_scale(spec), spec.vocab_size
        rows = parts.draft_heads.get(ids.numel())  # VocabTrim's rows when a draft graph already took them
        if rows is None:
            rows = arch.lm_head(parts.hf_model).weight.detach().index_select(0, ids).contiguous()
            parts.draft_heads[ids.numel()] = rows
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("ids", ids.to(torch.int64), persistent=False)

    def forward(self, hidden: Tensor, logits: Tensor, head: Head) -> Tensor:
        """hidden [R, H] before the final norm, logits [R, V]: the guessed ids [R] (int64)."""
        chosen = logits.argmax(-1)
        embedded = embed_tokens(self.embed, self.embed_scale, chosen, None, self.vocab)
        scores = head.logits(head.normed(self.block(hidden, embedded)), self.rows)
        return self.ids.index_select(0, scores.argmax(-1))  # a Gather (indexing would export GatherND)


def add_graphs(plan: BuildPlan, graphs: list[GraphSpec]) -> list[GraphSpec]:
    """The full decode graph, now guessing with the plan's head (width unset: unchanged), and the
    prefill graph too: in the fused flavour prefill and decode are then still one engine file, so
    one ONNX Runtime session (two would each hold their own prepacked copy of the weights)."""
    width = plan.draft_fields.get(FIELD, 0)
    graphs = with_full_decode_field(plan, graphs, FIELD)
    return [graph.with_draft_field(FIELD, width) if graph.kind == "prefill" else graph for graph in graphs]


def engine_role(graph: GraphSpec) -> str | None:
    """A decode graph at the bundle's precision that guesses with the head is the EAGLE engine."""
    return decode_field_role(graph, FIELD, ROLE)


def guess_head(parts: ModelParts, graph: GraphSpec) -> nn.Module | None:
    """The head a graph guesses with, or a clear error if its table or vocabulary is missing."""
    width = graph.draft_field(FIELD)
    if not width:
        return None
    table, ids = parts.draft_tables.get(TABLE), parts.draft_vocab
    if table is None or table.shape[0] != 5 * width or ids is None:
        raise ValueError(
            f"graph {graph.name!r} guesses with an EAGLE head of width {width}, but the model parts hold "
            f"{'no table' if table is None else f'a table of {table.shape[0]} rows'}"
            f"{'' if ids is not None else ' and no draft vocabulary'}"
        )
    return Guesses(parts, table, ids)
