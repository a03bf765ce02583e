"""The one decoder layer definition, for both graph flavours (docs/architecture.md section 2).

The layer says what a decoder layer computes and which of the family's norms it applies
(graphs/architectures); how each step is computed comes from its flavour's `LayerOps`:
- portable (graphs/layers.py `PortableOps`): standard ops, the HF projections as they are,
  attention over an explicit KV prefix;
- ort (graphs/fused_graph.py `FusedOps`): ONNX Runtime's fused ops (graphs/ort_ops.py) over
  packed QKV and gate/up weights, KV written in place by GroupQueryAttention.

The layer works on the residual stream (delta, residual): the residual add of the previous
block is done by this layer's input norm (`add_norm`), which the ort flavour fuses into one
SkipSimplifiedLayerNormalization and the portable flavour computes as Add then RMSNorm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from adaptive_export.graphs.architectures import DecoderArchitecture, LayerAttention, LayerWeights


@dataclass(frozen=True)
class QKNorm:
    """The RMSNorm multipliers of the per-head QK-norm (applied before rotary)."""

    query: Tensor
    key: Tensor


class LayerOps(Protocol):
    """How one flavour computes a layer's steps (and holds that flavour's layout of its weights)."""

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """RMSNorm of x times `weight`."""
        ...

    def add_norm(self, delta: Tensor | None, residual: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """(RMSNorm of residual + delta, residual + delta); no add when delta is None."""
        ...

    def attention(self, h: Tensor, kv: Any, qk_norm: QKNorm | None) -> tuple[Tensor, Tensor, Tensor]:
        """(output projection of the attention over h, the new or present K, V) with the flavour's
        KV inputs `kv` (built by `kv_inputs`)."""
        ...

    def mlp(self, h: Tensor) -> Tensor:
        """The gated MLP: down(act(gate(h)) * up(h))."""
        ...

    def kv_inputs(self, *tensors: Tensor) -> Any:
        """The flavour's typed KV inputs of one layer from its positional tensors."""
        ...


class DecoderLayer(nn.Module):
    """One HF decoder layer: norm, attention, optional post-attention norm, residual, norm, gated
    MLP, optional post-MLP norm. A hook the family does not use adds no op."""

    def __init__(
        self,
        ops: LayerOps,
        arch: DecoderArchitecture,
        weights: LayerWeights,
        layer_id: int,
        attention: LayerAttention,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.arch = arch
        self.layer_id = layer_id
        self.rope = attention.rope  # which rotary table the layer reads
        self.input_norm, self.pre_mlp_norm = weights.input_norm, weights.pre_mlp_norm
        self.post_attention_norm, self.post_mlp_norm = weights.post_attention_norm, weights.post_mlp_norm
        if (weights.q_norm is None) != (weights.k_norm is None):
            raise ValueError(f"layer {layer_id}: QK-norm needs both q_norm and k_norm")
        self.q_norm, self.k_norm = weights.q_norm, weights.k_norm

    def weight(self, norm: nn.Module) -> Tensor:
        return self.arch.norm_weight(norm)

    def normed_input(self, delta: Tensor | None, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm of this layer's input, the input itself) from the stream."""
        return self.ops.add_norm(delta, residual, self.weight(self.input_norm))

    def attend_and_mlp(self, h: Tensor, residual: Tensor, kv: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer after its input norm: (MLP delta, residual before it, K, V)."""
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = QKNorm(self.weight(self.q_norm), self.weight(self.k_norm))
        attn, key, value = self.ops.attention(h, kv, qk_norm)
        if self.post_attention_norm is not None:
            attn = self.ops.norm(attn, self.weight(self.post_attention_norm))
        h, residual = self.ops.add_norm(attn, residual, self.weight(self.pre_mlp_norm))
        delta = self.ops.mlp(h)
        if self.post_mlp_norm is not None:
            delta = self.ops.norm(delta, self.weight(self.post_mlp_norm))
        return delta, residual, key, value

    def forward(self, x: Tensor, *kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The layer on a plain hidden state x: (its output, K, V). The PyTorch passes of
        calibration call this; the graphs chain layers on the stream instead."""
        h, residual = self.normed_input(None, x)
        delta, residual, key, value = self.attend_and_mlp(h, residual, self.ops.kv_inputs(*kv))
        return residual + delta, key, value
