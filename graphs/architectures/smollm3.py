"""SmolLM3 decoders (HF model_type "smollm3", SmolLM3ForCausalLM).

Llama's layer, tied embeddings by default, and NoPE layers: config.no_rope_layers[i] == 0 means
layer i applies no rotary embedding (HF skips apply_rotary_pos_emb there). The adapter expresses
that with the existing per-layer table hook: NoPE layers read a table with inv_freq 0, i.e.
cos 1 and sin 0, the identity rotation (q * 1 + rotate_half(q) * 0 is q exactly), in both the
portable graphs and GroupQueryAttention's rotary (`rotary`, `layer_attention`). Refused by
`unsupported`: sliding-window layers, projection biases and length-dependent rope scaling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from adaptive_export.graphs.architectures.base import (
    DEFAULT_ROPE,
    DecoderArchitecture,
    LayerAttention,
    length_dependent_rope,
)

if TYPE_CHECKING:
    from torch import nn

NOPE = "no_rope"


class _IdentityTable:
    """A rotary table that rotates by zero at every position (the attributes graphs.layers.Rotary reads)."""

    def __init__(self, hf_rotary: Any) -> None:
        self.inv_freq = hf_rotary.inv_freq * 0.0
        self.attention_scaling = 1.0


def _rope_layers(config: Any) -> list[int]:
    return [int(flag) for flag in (getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers)]


class SmolLM3(DecoderArchitecture):
    model_types = ("smollm3",)
    tied_by_default = True

    def unsupported(self, config: Any) -> tuple[str, str] | None:
        flags = getattr(config, "no_rope_layers", None)
        if flags is not None and (len(flags) != config.num_hidden_layers or set(flags) - {0, 1}):
            return (
                f"smollm3 no_rope_layers {flags!r} is not one 0 (no rope) or 1 (rope) per layer",
                "use a config whose no_rope_layers lists every layer",
            )
        if getattr(config, "use_sliding_window", False):
            return (
                "smollm3 with sliding-window attention (use_sliding_window) is not supported",
                "set use_sliding_window to false in config.json (SmolLM3 checkpoints do)",
            )
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return ("smollm3 with projection biases is not supported", "use a SmolLM3 checkpoint without biases")
        return length_dependent_rope(config)

    def rotary(self, hf_model: nn.Module) -> dict[str, nn.Module]:
        tables: dict[str, Any] = {DEFAULT_ROPE: hf_model.model.rotary_emb}
        if 0 in _rope_layers(hf_model.config):
            tables[NOPE] = _IdentityTable(hf_model.model.rotary_emb)
        return tables

    def layer_attention(self, config: Any, index: int) -> LayerAttention:
        return LayerAttention() if _rope_layers(config)[index] else LayerAttention(rope=NOPE)
