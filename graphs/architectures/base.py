"""What differs per decoder architecture, said once: the adapter every static graph reads
(docs/architecture.md section 7).

A family is one module in this package with a `DecoderArchitecture` subclass, registered by
its HF `config.model_type`s in graphs/architectures/__init__.py (like mlx-lm's
models/<arch>.py). The graphs (graphs/layers.py: both the portable graphs and calibration's
PyTorch passes; graphs/fused_graph.py) never reach into the HF model themselves: they ask the
adapter for the modules of a layer, the norm style, the activation, the rotary tables and
window of each layer, and the embedding scale. Modules are the HF model's own (references,
never copies), so each graph uses the model's parameters and the exporter names its weights
after them.

Gemma 3 (gemma3.py) answers these: QK-norm (`q_norm`/`k_norm`), RMSNorm with
(1 + w) (`norm_weight`), embeddings times sqrt(hidden) (`embed_scale`), a GELU-tanh gated MLP
(`act`, read from the HF module), sandwich norms around attention and MLP
(`post_attention_norm`, `post_mlp_norm`), per-layer sliding window 512 with rope theta
10k on sliding layers, 1M on global ones (`layer_attention` from config.layer_types,
`rotary` returning both tables), and query_pre_attn_scalar ** -0.5 (`attention_scale`).
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar

from adaptive_export.graphs.spec import ModelSpec

if TYPE_CHECKING:  # torch only for annotations: reading a config's spec needs no torch
    from torch import Tensor, nn

DEFAULT_ROPE = "default"


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's modules as the static graphs use them (the HF model's own)."""

    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module
    act: Callable[[Tensor], Tensor]  # the gated MLP's activation: down(act(gate(h)) * up(h))
    input_norm: nn.Module  # before attention
    pre_mlp_norm: nn.Module  # before the MLP (Llama: post_attention_layernorm)
    post_attention_norm: nn.Module | None = None  # on the attention output, before the residual add
    post_mlp_norm: nn.Module | None = None  # on the MLP output, before the residual add
    q_norm: nn.Module | None = None  # per-head RMSNorm of queries before rotary (QK-norm)
    k_norm: nn.Module | None = None  # per-head RMSNorm of keys before rotary


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: which rotary table, and its sliding window (None: full causal)."""

    rope: str = DEFAULT_ROPE
    window: int | None = None


class DecoderArchitecture(ABC):
    """The per-family answers. Only `model_types` is required; the defaults are Llama's."""

    model_types: ClassVar[tuple[str, ...]]
    # tie_word_embeddings when the config does not say (HF's default differs per family)
    tied_by_default: ClassVar[bool] = False
    # LayerWeights field -> the module's attribute path in an HF decoder layer (Llama's names:
    # a pre-norm layer without QK-norm); a family overrides the names that differ
    layer_modules: ClassVar[Mapping[str, str]] = {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
        "act": "mlp.act_fn",
        "input_norm": "input_layernorm",
        "pre_mlp_norm": "post_attention_layernorm",
    }

    def spec_from_config(self, config: Any) -> ModelSpec:
        """The dimensions every static shape is built from (the standard HF config fields)."""
        heads = config.num_attention_heads
        return ModelSpec(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", self.tied_by_default)),
        )

    def unsupported(self, config: Any) -> tuple[str, str] | None:
        """(problem, fix) when this config uses something the graphs do not implement, else None."""
        return None

    def layer(self, hf_model: nn.Module, index: int) -> LayerWeights:
        """The modules of decoder layer `index`, found by `layer_modules`."""
        layer = hf_model.model.layers[index]
        return LayerWeights(**{name: attrgetter(path)(layer) for name, path in self.layer_modules.items()})

    def embed(self, hf_model: nn.Module) -> nn.Module:
        return hf_model.model.embed_tokens

    def embed_scale(self, spec: ModelSpec) -> float | None:
        """Factor on the token embeddings (None: none, Llama)."""
        return None

    def final_norm(self, hf_model: nn.Module) -> nn.Module:
        return hf_model.model.norm

    def lm_head(self, hf_model: nn.Module) -> nn.Module:
        return hf_model.lm_head

    def norm_weight(self, norm: nn.Module) -> Tensor:
        """The multiplier an RMSNorm module applies after normalising (Llama: its weight)."""
        return norm.weight

    def rotary(self, hf_model: nn.Module) -> dict[str, nn.Module]:
        """HF rotary modules (holding inv_freq and attention_scaling) by key; DEFAULT_ROPE first."""
        return {DEFAULT_ROPE: hf_model.model.rotary_emb}

    def layer_attention(self, config: Any, index: int) -> LayerAttention:
        return LayerAttention()

    def attention_scale(self, spec: ModelSpec, config: Any) -> float:
        """The factor on q.k (Llama: head_dim ** -0.5; Gemma 3 reads query_pre_attn_scalar from the config)."""
        return spec.head_dim**-0.5


LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # HF recomputes these tables from the sequence length


def length_dependent_rope(config: Any) -> tuple[str, str] | None:
    """(problem, fix) when the config's rope scaling changes its tables with the sequence length
    (`dynamic` NTK, `longrope` / Phi-3's `su`): a static graph holds one table for every length,
    so it would be right only below the original context. None for static tables (default,
    linear, llama3, yarn), which the graphs read from HF's own rotary module."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return None
    nested = bool(params) and all(isinstance(value, dict) for value in params.values())  # per layer type
    tables = list(params.values()) if nested else [params]
    kinds = {str(table.get("rope_type") or table.get("type")) for table in tables if isinstance(table, dict)}
    found = sorted(kinds & {*LENGTH_DEPENDENT_ROPE, "su"})
    if not found:
        return None
    return (
        f"{config.model_type} with rope_type {found[0]!r} is not supported (its rotary tables change with the "
        "sequence length; the static graphs hold one table)",
        "use a config with default, linear, llama3 or yarn rope scaling",
    )
