"""Static decoder pieces over a Hugging Face decoder's own parameters (the portable flavour
and every PyTorch reference: `check`, calibration).

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

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from adaptive_export.graphs.architectures import (
    DEFAULT_ROPE,
    DecoderArchitecture,
    LayerAttention,
    LayerWeights,
    architecture,
)
from adaptive_export.graphs.spec import ModelSpec

# Finite stand-in for -inf in the causal mask: safe in fp16 (CoreML) and exact in fp32
# after softmax, since exp(-30000) underflows to 0.
MASK_VALUE = -30000.0


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
        """(cos, sin) [N, hd] at arbitrary float positions (PPD training places prompt tokens
        after many prefixes in one pass)."""
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def embed_tokens(
    embed: nn.Module, scale: float | None, ids: Tensor, prompts: Tensor | None = None, vocab: int = 0
) -> Tensor:
    """Token embeddings, times the family's embedding scale where it has one (Gemma: sqrt(hidden)).

    With PPD `prompts` ([m, H], trained in the scaled space the layers read), ids vocab..vocab+m-1
    are the prompt tokens: two Gathers and a Where, so one decode graph serves plain steps and
    PPD verify passes."""
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


class StaticDecoderLayer(nn.Module):
    """One HF decoder layer, re-expressed with an explicit KV prefix in and new rows out.

    What the family decides (norm style, QK-norm, sandwich norms, activation, attention scale)
    comes from its adapter (graphs/architectures); a hook a family does not use adds no op."""

    def __init__(self, arch: DecoderArchitecture, weights: LayerWeights, spec: ModelSpec, config: Any) -> None:
        super().__init__()
        self.arch = arch
        self.spec = spec
        self.scale = arch.attention_scale(spec, config)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = weights.q, weights.k, weights.v, weights.o
        self.gate_proj, self.up_proj, self.down_proj, self.act = weights.gate, weights.up, weights.down, weights.act
        self.input_norm, self.pre_mlp_norm = weights.input_norm, weights.pre_mlp_norm
        self.post_attention_norm, self.post_mlp_norm = weights.post_attention_norm, weights.post_mlp_norm
        self.q_norm, self.k_norm = weights.q_norm, weights.k_norm

    def norm(self, x: Tensor, module: nn.Module) -> Tensor:
        return rms_norm(x, self.arch.norm_weight(module), self.spec.rms_norm_eps)

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        spec = self.spec
        t = x.shape[0]
        h = self.norm(x, self.input_norm)
        q = self.q_proj(h).view(t, spec.num_heads, spec.head_dim)
        k = self.k_proj(h).view(t, spec.num_kv_heads, spec.head_dim)
        v = self.v_proj(h).view(t, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None:
            q = self.norm(q, self.q_norm)
        if self.k_norm is not None:
            k = self.norm(k, self.k_norm)
        q = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]
        k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
        keys = torch.cat((past_k, k), dim=0).permute(1, 2, 0)  # [kv, hd, P+T]
        values = torch.cat((past_v, v), dim=0).transpose(0, 1)  # [kv, P+T, hd]
        # Group query heads by their KV head (HF repeat_kv: head h reads kv head h // groups)
        # so GQA needs no repeated K/V.
        qg = q.view(t, spec.num_kv_heads, spec.kv_groups, spec.head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(spec.num_kv_heads, spec.kv_groups * t, spec.head_dim)
        scores = torch.matmul(qg, keys) * self.scale
        scores = scores.view(spec.num_kv_heads, spec.kv_groups, t, -1) + mask
        probs = torch.softmax(scores, dim=-1).view(spec.num_kv_heads, spec.kv_groups * t, -1)
        ctx = torch.matmul(probs, values).view(spec.num_kv_heads, spec.kv_groups, t, spec.head_dim)
        ctx = ctx.permute(2, 0, 1, 3).reshape(t, spec.num_heads * spec.head_dim)
        attn = self.o_proj(ctx)
        if self.post_attention_norm is not None:
            attn = self.norm(attn, self.post_attention_norm)
        x = x + attn
        h = self.norm(x, self.pre_mlp_norm)
        mlp = self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))
        if self.post_mlp_norm is not None:
            mlp = self.norm(mlp, self.post_mlp_norm)
        x = x + mlp
        return x, k, v


class Head(nn.Module):
    """Final norm + LM head, shared by the full model and every early exit."""

    def __init__(self, hf_model: nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.arch = architecture(spec.model_type)
        self.norm = self.arch.final_norm(hf_model)
        self.lm_head = self.arch.lm_head(hf_model)
        self.eps = spec.rms_norm_eps

    def forward(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """Logits over the vocabulary, or over a draft vocabulary's head `rows` (VocabTrim)."""
        normed = rms_norm(x, self.arch.norm_weight(self.norm), self.eps)
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
        self.layers = nn.ModuleList(
            StaticDecoderLayer(arch, arch.layer(hf_model, i), spec, hf_model.config) for i in layers
        )
        self.head = Head(hf_model, spec)
        self.register_buffer("prompts", None, persistent=False)

    def set_prompt_tokens(self, table: Tensor | None) -> None:
        """Embed ids vocab.. as these PPD prompt tokens (a buffer, so export names it a weight)."""
        self.prompts = table

    def embed_ids(self, ids: Tensor) -> Tensor:
        return embed_tokens(self.embed, self.embed_scale, ids, self.prompts, self.spec.vocab_size)

    def frame_at(self, query_pos: Tensor, key_pos: Tensor, allowed: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Each layer's (cos, sin, additive mask) for queries at arbitrary positions over keys at
        `key_pos`, seeing those `allowed` ([T, K] bool) within the layer's window: PPD training
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
