"""Static decoder pieces over a Hugging Face Llama-family model's own parameters.

Every module here holds references to the HF modules (never copies), so the
parameter names seen by the ONNX exporter are the HF names and every graph that
uses a layer refers to the same weight. Shapes depend only on T (new tokens) and
P (past length, read from the K prefix), so prefill and decode are the same code.

Internal tensors drop the batch axis: the project decodes one sequence at a time,
and the KV arena is sequence-major [P, n_kv_heads, head_dim] (DESIGN.md section 4).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from graphs.spec import ModelSpec

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
        positions = torch.arange(past_len, past_len + new_len, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def causal_mask(past_len: int, new_len: int) -> Tensor:
    """Additive mask [T, P+T]: query at position P+i sees keys 0..P+i."""
    key_pos = torch.arange(past_len + new_len)
    query_pos = torch.arange(past_len, past_len + new_len)
    allowed = key_pos[None, :] <= query_pos[:, None]
    return torch.where(allowed, torch.zeros((), dtype=torch.float32), torch.full((), MASK_VALUE))


class StaticDecoderLayer(nn.Module):
    """One HF decoder layer, re-expressed with an explicit KV prefix in and new rows out."""

    def __init__(self, hf_layer: nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.hf = hf_layer
        self.spec = spec
        self.scale = spec.head_dim ** -0.5

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        spec, attn, mlp = self.spec, self.hf.self_attn, self.hf.mlp
        t = x.shape[0]
        h = rms_norm(x, self.hf.input_layernorm.weight, spec.rms_norm_eps)
        q = attn.q_proj(h).view(t, spec.num_heads, spec.head_dim)
        k = attn.k_proj(h).view(t, spec.num_kv_heads, spec.head_dim)
        v = attn.v_proj(h).view(t, spec.num_kv_heads, spec.head_dim)
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
        x = x + attn.o_proj(ctx)
        h = rms_norm(x, self.hf.post_attention_layernorm.weight, spec.rms_norm_eps)
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
        return x, k, v


class Head(nn.Module):
    """Final norm + LM head, shared by the full model and every early exit."""

    def __init__(self, hf_model: nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = hf_model.model.norm
        self.lm_head = hf_model.lm_head
        self.eps = spec.rms_norm_eps

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(rms_norm(x, self.norm.weight, self.eps))
