"""Llama and the decoders that share its layer: Qwen2 (QKV biases) and Mistral (without sliding window).

Pre-norm RMSNorm (weight x normalised), SiLU-gated MLP, one rotary table for every layer
(the HF module's own inv_freq and scaling, so rope_scaling variants such as Llama 3's come
along), full causal attention, unscaled embeddings: the adapter's defaults.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphs.architectures.base import DecoderArchitecture, LayerWeights

if TYPE_CHECKING:
    from torch import nn


class Llama(DecoderArchitecture):
    model_types = ("llama", "qwen2", "mistral")

    def unsupported(self, config: Any) -> tuple[str, str] | None:
        model_type = config.model_type
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", model_type == "mistral"):
            return (f"{model_type} with sliding-window attention is not supported",
                    "use a model without sliding_window, or set it to null in config.json")
        return None

    def layer(self, hf_model: nn.Module, index: int) -> LayerWeights:
        layer = hf_model.model.layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        return LayerWeights(q=attn.q_proj, k=attn.k_proj, v=attn.v_proj, o=attn.o_proj, gate=mlp.gate_proj, up=mlp.up_proj,
                            down=mlp.down_proj, act=mlp.act_fn, input_norm=layer.input_layernorm,
                            pre_mlp_norm=layer.post_attention_layernorm)
