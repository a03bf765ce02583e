"""Decoder architectures by HF `config.model_type`: one module per family (graphs/architectures/base.py
says what an adapter answers). A new family is one module plus its line in FAMILIES."""

from __future__ import annotations

from adaptive_export.graphs.architectures.base import DEFAULT_ROPE, DecoderArchitecture, LayerAttention, LayerWeights
from adaptive_export.graphs.architectures.gemma3 import Gemma3
from adaptive_export.graphs.architectures.llama import Llama
from adaptive_export.graphs.architectures.phi3 import Phi3
from adaptive_export.graphs.architectures.qwen3 import Qwen3
from adaptive_export.graphs.architectures.smollm3 import SmolLM3

FAMILIES: tuple[DecoderArchitecture, ...] = (Llama(), Gemma3(), Qwen3(), Phi3(), SmolLM3())
ARCHITECTURES: dict[str, DecoderArchitecture] = {t: family for family in FAMILIES for t in family.model_types}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


def architecture(model_type: str) -> DecoderArchitecture:
    """The adapter of a model type (KeyError with the supported types for any other)."""
    if model_type not in ARCHITECTURES:
        raise KeyError(f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return ARCHITECTURES[model_type]


__all__ = [
    "ARCHITECTURES",
    "DEFAULT_ROPE",
    "DecoderArchitecture",
    "LayerAttention",
    "LayerWeights",
    "SUPPORTED_MODEL_TYPES",
    "architecture",
]
