"""Llama and the decoders that share its layer: Qwen2 (QKV biases) and Mistral (without sliding window).

Pre-norm RMSNorm (weight x normalised), SiLU-gated MLP, one rotary table for every layer
(the HF module's own inv_freq and scaling, so the static rope scalings come along: Llama 3.x's
`llama3`, `linear`, `yarn`), full causal attention, unscaled embeddings: the adapter's defaults.
Scalings whose tables HF recomputes from the sequence length (`dynamic`, `longrope`) are refused.
"""

from __future__ import annotations

from typing import Any

from adaptive_export.graphs.architectures.base import DecoderArchitecture, length_dependent_rope


class Llama(DecoderArchitecture):
    model_types = ("llama", "qwen2", "mistral")

    def unsupported(self, config: Any) -> tuple[str, str] | None:
        model_type = config.model_type
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", model_type == "mistral"):
            return (
                f"{model_type} with sliding-window attention is not supported",
                "use a model without sliding_window, or set it to null in config.json",
            )
        return length_dependent_rope(config)
