"""Gemma 3 text decoders (HF model_type "gemma3_text", Gemma3ForCausalLM).

What differs from Llama, each answered by one adapter hook (graphs/architectures/base.py):
- RMSNorm multiplies by (1 + w) (`norm_weight`), on every norm: input, the sandwich norms
  around attention and MLP (`post_attention_norm`, `pre_mlp_norm`, `post_mlp_norm`), the
  per-head QK-norm (`q_norm`, `k_norm`) and the final norm;
- token embeddings times sqrt(hidden_size) (`embed_scale`); `embed` is a plain lookup of the
  HF embedding's own weight, since HF's Gemma3TextScaledWordEmbedding scales in its forward;
- GELU-tanh gated MLP (`act`: the HF module's own act_fn, gelu_pytorch_tanh);
- per layer, from config.layer_types: "sliding_attention" layers attend to the last
  config.sliding_window positions with their own rotary table (rope_local_base_freq, 10k),
  "full_attention" layers attend causally with the global one (rope_theta, 1M, plus any
  rope scaling) (`rotary`, `layer_attention`);
- queries scaled by query_pre_attn_scalar ** -0.5 (`attention_scale`);
- tied LM head (HF ties lm_head.weight to the embedding; `lm_head` is the HF module).
Softcapping (attn_logit_softcapping, final_logit_softcapping; None in Gemma 3) and
bidirectional attention are refused by `unsupported`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from adaptive_export.graphs.architectures.base import DEFAULT_ROPE, DecoderArchitecture, LayerAttention
from adaptive_export.graphs.spec import ModelSpec

if TYPE_CHECKING:
    from torch import Tensor, nn

SLIDING, FULL = "sliding_attention", "full_attention"


class _RopeTable:
    """One layer type's table of HF's Gemma3RotaryEmbedding (which holds `<type>_inv_freq` and
    `<type>_attention_scaling`), with the attributes graphs.layers.Rotary reads."""

    def __init__(self, hf_rotary: Any, layer_type: str) -> None:
        self.inv_freq = getattr(hf_rotary, f"{layer_type}_inv_freq")
        self.attention_scaling = getattr(hf_rotary, f"{layer_type}_attention_scaling", 1.0)


def _lookup(embedding: nn.Module) -> nn.Module:
    """A plain embedding lookup over the HF module's own weight (no scaling in its forward)."""
    from torch import nn

    class EmbeddingLookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = embedding.weight  # the same Parameter: named model.embed_tokens.weight in the bundle

        def forward(self, ids: Tensor) -> Tensor:
            return nn.functional.embedding(ids, self.weight)

    return EmbeddingLookup()


class Gemma3(DecoderArchitecture):
    model_types = ("gemma3_text",)
    tied_by_default = True
    layer_modules = {  # sandwich norms around attention and MLP, QK-norm
        **DecoderArchitecture.layer_modules,
        "pre_mlp_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
    }

    def unsupported(self, config: Any) -> tuple[str, str] | None:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                return (
                    f"gemma3_text with {name}={getattr(config, name)} is not supported (the graphs do not softcap)",
                    f"set {name} to null in config.json (Gemma 3 checkpoints do)",
                )
        if getattr(config, "use_bidirectional_attention", False):
            return (
                "gemma3_text with use_bidirectional_attention is not supported (the graphs are causal decoders)",
                "set use_bidirectional_attention to false in config.json",
            )
        layer_types = list(getattr(config, "layer_types", None) or [])
        if len(layer_types) != config.num_hidden_layers or set(layer_types) - {SLIDING, FULL}:
            return (
                f"gemma3_text layer_types {layer_types!r} is not one of {SLIDING!r} / {FULL!r} per layer",
                "use a config whose layer_types lists every layer's attention type",
            )
        rope = getattr(config, "rope_parameters", None) or {}
        dynamic = sorted({p.get("rope_type") for p in rope.values() if isinstance(p, dict)} & {"dynamic", "longrope"})
        if dynamic:
            return (
                f"gemma3_text with rope_type {dynamic[0]!r} is not supported (its tables change with the length)",
                "use a config with default or linear rope scaling",
            )
        return None

    def embed(self, hf_model: nn.Module) -> nn.Module:
        return _lookup(hf_model.model.embed_tokens)

    def embed_scale(self, spec: ModelSpec) -> float | None:
        # HF: torch.tensor(hidden ** 0.5) cast to the weight dtype; the graphs run fp32 weights
        return float(_fp32(math.sqrt(spec.hidden_size)))

    def norm_weight(self, norm: nn.Module) -> Tensor:
        return 1.0 + norm.weight

    def rotary(self, hf_model: nn.Module) -> dict[str, nn.Module]:
        hf_rotary = hf_model.model.rotary_emb
        types = set(hf_model.config.layer_types)
        default = FULL if FULL in types else SLIDING
        tables = {DEFAULT_ROPE: _RopeTable(hf_rotary, default)}
        if SLIDING in types:
            tables[SLIDING] = _RopeTable(hf_rotary, SLIDING)
        return tables  # type: ignore[return-value]

    def layer_attention(self, config: Any, index: int) -> LayerAttention:
        if config.layer_types[index] == SLIDING:
            return LayerAttention(rope=SLIDING, window=int(config.sliding_window))
        return LayerAttention()

    def attention_scale(self, spec: ModelSpec, config: Any) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5


def _fp32(value: float) -> float:
    import numpy as np

    return float(np.float32(value))
