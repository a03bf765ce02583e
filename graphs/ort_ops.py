"""Fused operators as small torch custom ops: one PyTorch reference, two ONNX translations.

Each op computes in eager PyTorch exactly what the fused ONNX Runtime contrib op computes,
so the graphs of graphs/fused_graph.py stay the one definition and the reference that
`check` compares against. The exporter translates each op to ONNX Runtime's fused kernel
(exporter/ort_translations.py); the portable flavour (CoreML, TensorRT) never uses them.

- rms_norm       -> SimplifiedLayerNormalization (default domain, an ORT contrib op)
- skip_rms_norm  -> com.microsoft.SkipSimplifiedLayerNormalization: (norm(x + skip), x + skip)
- gelu_tanh      -> com.microsoft.FastGelu: GELU with the tanh approximation (Gemma's MLP),
                    one node instead of the eight of its decomposition
- gqa            -> com.microsoft.GroupQueryAttention over packed QKV, rotary inside, the
                    KV cache a preallocated [1, n_kv, max_len, head_dim] block per layer that
                    is both the past input and the present output (written in place by ORT);
                    `local_window_size` > 0 limits each query to the last local_window_size
                    keys, its own included: HF's sliding window (measured against ORT 1.32's
                    CPU kernel, tests/test_ort_ops.py)
"""

from __future__ import annotations

import torch
from torch import Tensor

from adaptive_export.graphs.layers import causal_mask


@torch.library.custom_op("adaptive_export::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("adaptive_export::skip_rms_norm", mutates_args=())
def skip_rms_norm(x: Tensor, skip: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + skip
    variance = total.pow(2).mean(-1, keepdim=True)
    return weight * (total * torch.rsqrt(variance + eps)), total


@skip_rms_norm.register_fake
def _(x: Tensor, skip: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("adaptive_export::gelu_tanh", mutates_args=())
def gelu_tanh(x: Tensor) -> Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


@gelu_tanh.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Non-interleaved RoPE on [T, heads, hd] with cos/sin [T, hd/2] (HF rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@torch.library.custom_op("adaptive_export::gqa", mutates_args=())
def gqa(
    qkv: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    seqlens_k: Tensor,
    total_length: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    num_heads: int,
    kv_heads: int,
    scale: float,
    local_window_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [1, T, (nh + 2 kv) hd]; past_* [1, kv, M, hd] hold rows [0, P) with P = total - T.

    Returns the attention output [1, T, nh hd] and the caches with the T new (rotated) rows
    written at [P, P + T): what ORT's GroupQueryAttention writes in place when the past and
    present buffers are the same memory.
    """
    del seqlens_k  # ORT reads the valid length from it; here it is total_length - 1
    t = qkv.shape[1]
    head_dim = past_key.shape[-1]
    total = int(total_length)
    past = total - t
    q, k, v = qkv[0].split((num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, kv_heads, head_dim)
    v = v.reshape(t, kv_heads, head_dim)
    cos, sin = cos_cache[past:total], sin_cache[past:total]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key[0, :, past:total] = k.transpose(0, 1)
    present_value[0, :, past:total] = v.transpose(0, 1)
    keys = present_key[0, :, :total]  # [kv, total, hd]
    values = present_value[0, :, :total]
    groups = num_heads // kv_heads
    qg = q.reshape(t, kv_heads, groups, head_dim).permute(1, 2, 0, 3)  # [kv, g, T, hd]
    scores = torch.matmul(qg, keys[:, None].transpose(-1, -2)) * scale  # [kv, g, T, total]
    scores = scores + causal_mask(past, t, local_window_size if local_window_size > 0 else None)
    ctx = torch.matmul(torch.softmax(scores, dim=-1), values[:, None])  # [kv, g, T, hd]
    out = ctx.permute(2, 0, 1, 3).reshape(1, t, num_heads * head_dim)
    return out, present_key, present_value


@gqa.register_fake
def _(qkv: Tensor, past_key: Tensor, past_value: Tensor, *_controls: object) -> tuple[Tensor, Tensor, Tensor]:
    """Shapes only: the output is qkv's rows at qkv's width less the packed K and V
    (kv_heads x head_dim each, read off the [1, kv, M, hd] caches); the caches keep their shape."""
    kv_width = past_key.shape[1] * past_key.shape[-1]
    out = qkv.new_empty((qkv.shape[0], qkv.shape[1], qkv.shape[-1] - 2 * kv_width))
    return out, torch.empty_like(past_key), torch.empty_like(past_value)
