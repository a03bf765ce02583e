"""Phi-3 decoders (HF model_type "phi3", Phi3ForCausalLM).

Llama's layer with two packed projections: `qkv_proj` (queries, keys, values stacked along the
output rows) and `gate_up_proj` (gate, then up). The adapter hands the graphs each part as a
row slice of the HF module's own weight (`RowSlice`: a view, never a copy), so the portable graphs
project with it and the fused flavour's packing (graphs/fused_graph.py `PackedWeights`) stacks the
slices back into the very same matrix. `sliding_window`, when the config sets it, applies to every
layer (HF builds one sliding-window mask), so every layer gets that window (`layer_attention`).
Refused by `unsupported`: `partial_rotary_factor` below 1 (the graphs rotate the whole head) and
the su / longrope scaling of the 128k models (its tables change with the sequence length).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from adaptive_export.graphs.architectures.base import (
    DecoderArchitecture,
    LayerAttention,
    LayerWeights,
    length_dependent_rope,
)

if TYPE_CHECKING:
    from torch import Tensor, nn


def row_slice(linear: nn.Module, start: int, stop: int) -> nn.Module:
    """A bias-free linear over rows start..stop of `linear`'s weight (the HF parameter, sliced in the graph)."""
    from torch import nn

    class RowSlice(nn.Module):
        bias = None

        def __init__(self) -> None:
            super().__init__()
            self.packed = linear  # registered, so the exporter names the weight after the HF parameter

        @property
        def weight(self) -> Tensor:
            return self.packed.weight[start:stop]

        def forward(self, x: Tensor) -> Tensor:
            return nn.functional.linear(x, self.weight)

    return RowSlice()


def partial_rotary_factor(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(factor if factor is not None else getattr(config, "partial_rotary_factor", 1.0) or 1.0)


class Phi3(DecoderArchitecture):
    model_types = ("phi3",)

    def unsupported(self, config: Any) -> tuple[str, str] | None:
        factor = partial_rotary_factor(config)
        if factor != 1.0:
            return (
                f"phi3 with partial_rotary_factor {factor} is not supported (the graphs rotate every head dimension)",
                "use a Phi-3 config without partial_rotary_factor (or 1.0), as Phi-3-mini's",
            )
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return ("phi3 with projection biases is not supported", "use a Phi-3 checkpoint without biases")
        return length_dependent_rope(config)

    def layer(self, hf_model: nn.Module, index: int) -> LayerWeights:
        layer, config = hf_model.model.layers[index], hf_model.config
        attn, mlp = layer.self_attn, layer.mlp
        head_dim = attn.head_dim
        queries, keys = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        inner = config.intermediate_size
        return LayerWeights(
            q=row_slice(attn.qkv_proj, 0, queries),
            k=row_slice(attn.qkv_proj, queries, queries + keys),
            v=row_slice(attn.qkv_proj, queries + keys, queries + 2 * keys),
            o=attn.o_proj,
            gate=row_slice(mlp.gate_up_proj, 0, inner),
            up=row_slice(mlp.gate_up_proj, inner, 2 * inner),
            down=mlp.down_proj,
            act=mlp.activation_fn,
            input_norm=layer.input_layernorm,
            pre_mlp_norm=layer.post_attention_layernorm,
        )

    def layer_attention(self, config: Any, index: int) -> LayerAttention:
        window = getattr(config, "sliding_window", None)
        return LayerAttention(window=int(window)) if window else LayerAttention()
