"""Static decoder pieces over a Hugging Face decoder's own parameters (the portable flavour
and every PyTorch reference: `check`, calibration): rotary tables, masks, the embedding,
`PortableOps` (how a graphs/decoder_layer.py `DecoderLayer` computes in standard ops), the
head and `DecoderStack`.

Every module here holds references to the HF modules (never copies), so every graph that
uses a layer refers to the same weight, and the exporter names it after the HF parameter.
What differs per family comes from its adapter (graphs/architectures). Shapes depend only
on T (new tokens) and P (past length, read from the K prefix), so prefill and decode are the
same code.

Internal tensors drop the batch axis: the project decodes one sequence at a time, and the
portable KV arena is sequence-major [P, n_kv_heads, head_dim] (docs/architecture.md
section 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from adaptive_export.graphs.architectures import (
    DEFAULT_ROPE,
    LayerAttention,
    LayerWeights,
    architecture,
)
from adaptive_export.graphs.decoder_layer import DecoderLayer, QKNorm
from adaptive_export.graphs.spec import ModelSpec

# Finite stand-in for -inf in the causal mask: safe in fp16 (CoreML) and exact in fp32
# after softmax, since exp(-30000) underflows to 0.
MASK_VALUE = -30000.0

NormOp = Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps) -> RMSNorm(x) * weight


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """RoPE for positions P..P+T-1, using the HF module's own inv_freq and scaling."""

    def __init__(self, hf_rotary: nn.Module) -> None:
        super().__init__()
        self.register_buffer("inv_freq", hf_rotary.inv_freq.detach().clone().float(), persistent=False)
        self.scaling = float(getattr(hf_rotary, "attention_scaling", 1.0))

    def forward(self, past_len: int, new_len: int) -> tuple[Tensor, Tensor]:
        return self.at(torch.arange(past_len, past_len + new_len, dtype=torch.float32))

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, sin) [N, hd] at arbitrary float positions (prompt-token training places prompt tokens
        after many prefixes in one pass)."""
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def embed_tokens(
    embed: nn.Module, scale: float | None, ids: Tensor, prompts: Tensor | None = None, vocab: int = 0
) -> Tensor:
    """Token embeddings, times the family's embedding scale where it has one (Gemma: sqrt(hidden)).

    With prompt-token `prompts` ([m, H], trained in the scaled space the layers read), ids vocab..vocab+m-1
    are the prompt tokens: two Gathers and a Where, so one decode graph serves plain steps and
    prompt-token verify passes."""
    if prompts is None:
        x = embed(ids)
        return x * scale if scale is not None else x
    is_prompt = ids >= vocab
    zero = torch.zeros_like(ids)
    x = embed(torch.where(is_prompt, zero, ids))
    if scale is not None:
        x = x * scale
    extra = nn.functional.embedding(torch.where(is_prompt, ids - vocab, zero), prompts)
    return torch.where(is_prompt.unsqueeze(-1), extra, x)


def causal_mask(past_len: int, new_len: int, window: int | None = None) -> Tensor:
    """Additive mask [T, P+T]: query at position P+i sees keys 0..P+i (the last `window` of them
    with a sliding window)."""
    key_pos = torch.arange(past_len + new_len)
    query_pos = torch.arange(past_len, past_len + new_len)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed = allowed & (key_pos[None, :] > query_pos[:, None] - window)
    return torch.where(allowed, torch.zeros((), dtype=torch.float32), torch.full((), MASK_VALUE))


def layer_masks(attention: list[LayerAttention], past_len: int, new_len: int) -> list[Tensor]:
    """Each layer's additive mask, one per distinct window (full causal: causal_mask)."""
    masks: dict[int | None, Tensor] = {}
    for layer in attention:
        if layer.window not in masks:
            masks[layer.window] = causal_mask(past_len, new_len, layer.window)
    return [masks[layer.window] for layer in attention]


@dataclass(frozen=True)
class PrefixKV:
    """A portable layer's KV inputs: the prefix rows [P, n_kv, hd] and the frame of the T new
    positions (rotary tables [T, hd] and the additive mask [T, P+T])."""

    past_key: Tensor
    past_value: Tensor
    cos: Tensor
    sin: Tensor
    mask: Tensor


class PortableOps(nn.Module):
    """The portable flavour of a layer's steps: standard ops on [T, H], the HF projections as
    they are, attention over the KV prefix plus the T new rows (which it returns)."""

    def __init__(self, weights: LayerWeights, spec: ModelSpec, scale: float) -> None:
        super().__init__()
        self.spec = spec
        self.scale = scale
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = weights.q, weights.k, weights.v, weights.o
        self.gate_proj, self.up_proj, self.down_proj, self.act = weights.gate, weights.up, weights.down, weights.act

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x, weight, self.spec.rms_norm_eps)

    def add_norm(self, delta: Tensor | None, residual: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        total = residual if delta is None else residual + delta
        return self.norm(total, weight), total

    def kv_inputs(self, *tensors: Tensor) -> PrefixKV:
        return PrefixKV(*tensors)

    def attention(self, h: Tensor, kv: PrefixKV, qk_norm: QKNorm | None) -> tuple[Tensor, Tensor, Tensor]:
        spec = self.spec
        t = h.shape[0]
        q = self.q_proj(h).view(t, spec.num_heads, spec.head_dim)
        k = self.k_proj(h).view(t, spec.num_kv_heads, spec.head_dim)
        v = self.v_proj(h).view(t, spec.num_kv_heads, spec.head_dim)
        if qk_norm is not None:
            q, k = self.norm(q, qk_norm.query), self.norm(k, qk_norm.key)
        q = q * kv.cos[:, None, :] + rotate_half(q) * kv.sin[:, None, :]
        k = k * kv.cos[:, None, :] + rotate_half(k) * kv.sin[:, None, :]
        keys = torch.cat((kv.past_key, k), dim=0).permute(1, 2, 0)  # [kv, hd, P+T]
        values = torch.cat((kv.past_value, v), dim=0).transpose(0, 1)  # [kv, P+T, hd]
        # Group query heads by their KV head (HF repeat_kv: head h reads kv head h // groups)
        # so GQA needs no repeated K/V.
        qg = q.view(t, spec.num_kv_heads, spec.kv_groups, spec.head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(spec.num_kv_heads, spec.kv_groups * t, spec.head_dim)
        scores = torch.matmul(qg, keys) * self.scale
        scores = scores.view(spec.num_kv_heads, spec.kv_groups, t, -1) + kv.mask
        probs = torch.softmax(scores, dim=-1).view(spec.num_kv_heads, spec.kv_groups * t, -1)
        ctx = torch.matmul(probs, values).view(spec.num_kv_heads, spec.kv_groups, t, spec.head_dim)
        ctx = ctx.permute(2, 0, 1, 3).reshape(t, spec.num_heads * spec.head_dim)
        return self.o_proj(ctx), k, v

    def mlp(self, h: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


def portable_layer(hf_model: nn.Module, spec: ModelSpec, index: int) -> DecoderLayer:
    """Decoder layer `index` of the HF model in the portable flavour."""
    arch, config = architecture(spec.model_type), hf_model.config
    weights = arch.layer(hf_model, index)
    ops = PortableOps(weights, spec, arch.attention_scale(spec, config))
    return DecoderLayer(ops, arch, weights, index, arch.layer_attention(config, index))


class Head(nn.Module):
    """Final norm + LM head, shared by the full model and every early exit. `norm_op` is the
    flavour's RMSNorm (the ort flavour passes its fused op)."""

    def __init__(self, hf_model: nn.Module, spec: ModelSpec, norm_op: NormOp = rms_norm) -> None:
        super().__init__()
        self.arch = architecture(spec.model_type)
        self.norm = self.arch.final_norm(hf_model)
        self.lm_head = self.arch.lm_head(hf_model)
        self.eps = spec.rms_norm_eps
        self.norm_op = norm_op

    def forward(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """Logits over the vocabulary, or over a draft vocabulary's head `rows` (VocabTrim)."""
        return self.logits(self.normed(x), rows)

    def normed(self, x: Tensor) -> Tensor:
        """The final norm."""
        return self.norm_op(x, self.arch.norm_weight(self.norm), self.eps)

    def logits(self, normed: Tensor, rows: Tensor | None = None) -> Tensor:
        """The LM head (or the draft vocabulary's `rows`) on normed hidden states."""
        return self.lm_head(normed) if rows is None else nn.functional.linear(normed, rows)


class DecoderStack(nn.Module):
    """The PyTorch decoder every static graph and calibration pass is built from, in one place:
    embedding (scaled where the family scales it), rotary tables, the chosen layers, head.

    `frame(P, T)` gives each layer its (cos, sin, mask) for positions P..P+T-1, per the family's
    per-layer rotary table and window; families with one table and full attention get one of each.
    """

    def __init__(self, hf_model: nn.Module, spec: ModelSpec, layers: Sequence[int], embed: bool = True) -> None:
        super().__init__()
        arch = architecture(spec.model_type)
        self.spec = spec
        self.embed = arch.embed(hf_model) if embed else None
        self.embed_scale = arch.embed_scale(spec)
        tables = arch.rotary(hf_model)
        self.rotary = Rotary(tables[DEFAULT_ROPE])
        self.rotaries = nn.ModuleDict({key: Rotary(module) for key, module in tables.items() if key != DEFAULT_ROPE})
        self.attention = [arch.layer_attention(hf_model.config, i) for i in layers]
        self.layers = nn.ModuleList(portable_layer(hf_model, spec, i) for i in layers)
        self.head = Head(hf_model, spec)
        self.register_buffer("prompts", None, persistent=False)

    def set_appended_embeddings(self, table: Tensor | None) -> None:
        """Embed ids vocab.. as these rows, a draft source's trained table (a buffer, so export names it a weight)."""
        self.prompts = table

    def embed_ids(self, ids: Tensor) -> Tensor:
        return embed_tokens(self.embed, self.embed_scale, ids, self.prompts, self.spec.vocab_size)

    def frame_at(self, query_pos: Tensor, key_pos: Tensor, allowed: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Each layer's (cos, sin, additive mask) for queries at arbitrary positions over keys at
        `key_pos`, seeing those `allowed` ([T, K] bool) within the layer's window: prompt-token training
        attends many groups of prompt tokens, each after its own prefix, in one pass."""
        tables = {DEFAULT_ROPE: self.rotary.at(query_pos.float())}
        tables.update({key: rotary.at(query_pos.float()) for key, rotary in self.rotaries.items()})
        masks: dict[int | None, Tensor] = {}
        for layer in self.attention:
            if layer.window not in masks:
                seen = (
                    allowed
                    if layer.window is None
                    else allowed & (key_pos[None, :] > query_pos[:, None] - layer.window)
                )
                masks[layer.window] = torch.where(
                    seen, torch.zeros((), dtype=torch.float32), torch.full((), MASK_VALUE)
                )
        return [(*tables[layer.rope], masks[layer.window]) for layer in self.attention]

    def frame(self, past_len: int, new_len: int) -> list[tuple[Tensor, Tensor, Tensor]]:
        tables = {DEFAULT_ROPE: self.rotary(past_len, new_len)}
        tables.update({key: rotary(past_len, new_len) for key, rotary in self.rotaries.items()})
        masks = layer_masks(self.attention, past_len, new_len)
        return [(*tables[layer.rope], mask) for layer, mask in zip(self.attention, masks)]
