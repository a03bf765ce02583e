"""Qwen3 decoders (HF model_type "qwen3", Qwen3ForCausalLM).

Llama's layer (graphs/architectures/llama.py) plus a per-head RMSNorm of queries and keys before
rotary (`q_norm`, `k_norm`: QK-norm with the plain weight multiplier), and no QKV biases. Both ONNX
flavours express it: the portable graphs normalise q and k before their rotary, the fused one
normalises the packed QKV before GroupQueryAttention applies its rotary (graphs/fused_graph.py
`qk_normed`). What the graphs do not implement is refused by `unsupported`: sliding-window layers
(`use_sliding_window`), attention biases (Qwen3 checkpoints have none; the packed output projection
carries no bias) and rope scalings whose tables change with the sequence length.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from adaptive_export.graphs.architectures.base import DecoderArchitecture, LayerWeights, length_dependent_rope

if TYPE_CHECKING:
    from torch import nn


class Qwen3(DecoderArchitecture):
    model_types = ("qwen3",)

    def unsupported(self, config: Any) -> tuple[str, str] | None:
        if getattr(config, "use_sliding_window", False):
            return (
                "qwen3 with sliding-window attention (use_sliding_window) is not supported",
                "set use_sliding_window to false in config.json (Qwen3 checkpoints do)",
            )
        if getattr(config, "attention_bias", False):
            return (
                "qwen3 with attention_bias is not supported (the graphs' output projection has no bias)",
                "use a Qwen3 checkpoint without attention biases (attention_bias false, as released)",
            )
        return length_dependent_rope(config)

    def layer(self, hf_model: nn.Module, index: int) -> LayerWeights:
        attn = hf_model.model.layers[index].self_attn
        return replace(super().layer(hf_model, index), q_norm=attn.q_norm, k_norm=attn.k_norm)
