"""The ONNX Runtime flavour of every graph: fused ops over packed weights, KV cache in place.

Same graphs as graphs/span_graph.py (prefill, decode per configuration, draft, verify;
one `GraphSpec` each), the same definitions (`SpanFlow`, graphs/decoder_layer.py's
`DecoderLayer`), whose steps `FusedOps` computes with graphs/ort_ops.py so that the
exporter emits ONNX Runtime's fused kernels. What differs is the I/O contract:
- each layer's K and V live in one preallocated [1, n_kv, max_len, head_dim] block that is
  both input (`past_key_i`) and output (`present_key_i`): the runtime binds the arena
  block to both once and ONNX Runtime writes the T new rows in place at [P, P + T);
- `seqlens_k` ([1] int32, P + T - 1) and `total_sequence_length` ([] int32, P + T) carry
  the arena length, as GroupQueryAttention expects;
- `logit_rows` ([R] int64) picks the positions whose logits are computed: the last one at
  prefill and plain decoding, all T when verifying drafts.
Weights are packed once per build (QKV and gate/up, transposed for MatMul) by
`PackedWeights`, shared by every graph, and named after the layer they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from adaptive_export.graphs import ort_ops
from adaptive_export.graphs.architectures import DEFAULT_ROPE, LayerWeights, architecture
from adaptive_export.graphs.decoder_layer import DecoderLayer, QKNorm
from adaptive_export.graphs.layers import Head, Rotary, embed_tokens
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts, SpanFlow, appended_embeddings
from adaptive_export.graphs.spec import ModelSpec

GELU_TANH_MODULES = ("GELUTanh", "PytorchGELUTanh")  # transformers 5 / 4 names of gelu_pytorch_tanh


@dataclass
class PackedLayer:
    qkv: Tensor  # [H, (nh + 2 kv) hd]
    qkv_bias: Tensor | None
    o: Tensor  # [nh hd, H]
    gate_up: Tensor  # [H, 2 I]
    down: Tensor  # [I, H]


def share_storage(w: LayerWeights, packed: PackedLayer) -> None:
    """Point the HF model's own weights at views of the packed ones, so the layer's weights are
    held once, not twice (issue #36: `check` of the 1.5B held both fp32 copies, 5.2 GB more).
    The values are the same; a weight that is not its module's own parameter (phi3's slices of
    a fused projection) keeps its storage."""
    stacked = {"qkv": (w.q, w.k, w.v), "o": (w.o,), "gate_up": (w.gate, w.up), "down": (w.down,)}
    for name, modules in stacked.items():
        whole, start = getattr(packed, name), 0
        for module in modules:
            weight = module.weight
            rows = weight.shape[0]
            view = whole[:, start : start + rows].T
            start += rows
            if isinstance(weight, nn.Parameter) and weight.device.type != "meta" and view.shape == weight.shape:
                weight.data = view


class PackedWeights:
    """The fused flavour's weight layout, computed once per build and shared by its graphs."""

    def __init__(self, parts: ModelParts, max_len: int) -> None:
        self.max_len = max_len
        hf, arch = parts.hf_model, architecture(parts.spec.model_type)
        self.layers: list[PackedLayer] = []
        for index in range(parts.spec.num_layers):
            w = arch.layer(hf, index)
            biases = [w.q.bias, w.k.bias, w.v.bias]
            packed = PackedLayer(
                qkv=torch.cat([w.q.weight, w.k.weight, w.v.weight]).T.contiguous(),
                qkv_bias=torch.cat(biases).contiguous() if all(b is not None for b in biases) else None,
                o=w.o.weight.T.contiguous(),
                gate_up=torch.cat([w.gate.weight, w.up.weight]).T.contiguous(),
                down=w.down.weight.T.contiguous(),
            )
            share_storage(w, packed)
            self.layers.append(packed)
        # GroupQueryAttention's cos/sin caches [max_len, hd / 2] (the first half of each rotate_half
        # table: its two halves are equal), one pair per rotary table
        self.rotary: dict[str, tuple[Tensor, Tensor]] = {}
        for key, module in arch.rotary(hf).items():
            cos, sin = Rotary(module)(0, max_len)
            half = cos.shape[-1] // 2
            self.rotary[key] = (cos[:, :half].contiguous(), sin[:, :half].contiguous())

    @staticmethod
    def sources(num_layers: int) -> dict[str, list[str]]:
        """Packed tensor name -> the HF weights it stacks along the output dimension, in order
        (what a GGUF-exact build reads from the file for that tensor)."""
        out = {}
        for i in range(num_layers):
            p = f"model.layers.{i}"
            out[f"{p}.self_attn.qkv_proj.weight_t"] = [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]
            out[f"{p}.self_attn.o_proj.weight_t"] = [f"{p}.self_attn.o_proj.weight"]
            out[f"{p}.mlp.gate_up_proj.weight_t"] = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]
            out[f"{p}.mlp.down_proj.weight_t"] = [f"{p}.mlp.down_proj.weight"]
        return out

    def named(self) -> list[tuple[str, Tensor]]:
        """Stable names for the packed tensors, so every graph and build names them alike."""
        out = []
        for key, (cos, sin) in self.rotary.items():
            prefix = "rotary" if key == DEFAULT_ROPE else f"rotary.{key}"
            out += [(f"{prefix}.cos_cache", cos), (f"{prefix}.sin_cache", sin)]
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            out += [
                (f"{prefix}.self_attn.qkv_proj.weight_t", layer.qkv),
                (f"{prefix}.self_attn.o_proj.weight_t", layer.o),
                (f"{prefix}.mlp.gate_up_proj.weight_t", layer.gate_up),
                (f"{prefix}.mlp.down_proj.weight_t", layer.down),
            ]
            if layer.qkv_bias is not None:
                out.append((f"{prefix}.self_attn.qkv_proj.bias", layer.qkv_bias))
        return out


@dataclass(frozen=True)
class ArenaKV:
    """An ort layer's KV inputs: its arena blocks [1, n_kv, max_len, hd] (past and present, written
    in place), the arena length GroupQueryAttention reads, and the layer's cos/sin caches."""

    past_key: Tensor
    past_value: Tensor
    seqlens_k: Tensor
    total_length: Tensor
    cos_cache: Tensor
    sin_cache: Tensor


class FusedOps(nn.Module):
    """The ort flavour of a layer's steps on [1, T, H]: ONNX Runtime's fused norms, MatMuls over
    the packed QKV and gate/up weights, GroupQueryAttention with rotary inside and the layer's
    sliding window (HF's window, as ORT counts it), writing K and V in place."""

    def __init__(self, packed: PackedLayer, weights: LayerWeights, spec: ModelSpec, scale: float, window: int) -> None:
        super().__init__()
        self.eps = spec.rms_norm_eps
        self.num_heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.intermediate = spec.intermediate_size
        self.scale = scale
        self.local_window_size = window
        # HF's GELUTanh (gelu_pytorch_tanh) as one fused node; any other activation as HF computes it
        self.act = ort_ops.gelu_tanh if type(weights.act).__name__ in GELU_TANH_MODULES else weights.act
        for name in ("qkv", "o", "gate_up", "down"):
            self.register_buffer(name, getattr(packed, name), persistent=False)
        self.register_buffer("qkv_bias", packed.qkv_bias, persistent=False)

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return ort_ops.rms_norm(x, weight, self.eps)

    def add_norm(self, delta: Tensor | None, residual: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        if delta is None:
            return self.norm(residual, weight), residual
        return ort_ops.skip_rms_norm(delta, residual, weight, self.eps)

    def kv_inputs(self, *tensors: Tensor) -> ArenaKV:
        return ArenaKV(*tensors)

    def qk_normed(self, qkv: Tensor, qk_norm: QKNorm) -> Tensor:
        """Packed QKV with the per-head QK-norm applied to the query and key heads."""
        t = qkv.shape[1]
        q, k, v = qkv.split(
            (self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim), dim=-1
        )
        q = self.norm(q.reshape(1, t, self.num_heads, self.head_dim), qk_norm.query).reshape(1, t, -1)
        k = self.norm(k.reshape(1, t, self.kv_heads, self.head_dim), qk_norm.key).reshape(1, t, -1)
        return torch.cat((q, k, v), dim=-1)

    def attention(self, h: Tensor, kv: ArenaKV, qk_norm: QKNorm | None) -> tuple[Tensor, Tensor, Tensor]:
        qkv = torch.matmul(h, self.qkv)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if qk_norm is not None:
            qkv = self.qk_normed(qkv, qk_norm)
        attn, present_key, present_value = ort_ops.gqa(
            qkv,
            kv.past_key,
            kv.past_value,
            kv.seqlens_k,
            kv.total_length,
            kv.cos_cache,
            kv.sin_cache,
            self.num_heads,
            self.kv_heads,
            self.scale,
            self.local_window_size,
        )
        return torch.matmul(attn, self.o), present_key, present_value

    def mlp(self, h: Tensor) -> Tensor:
        gate, up = torch.matmul(h, self.gate_up).split(self.intermediate, dim=-1)
        return torch.matmul(self.act(gate) * up, self.down)


def fused_layer(packed: PackedLayer, parts: ModelParts, index: int) -> DecoderLayer:
    """Decoder layer `index` of the HF model in the ort flavour, over its packed weights."""
    spec, config = parts.spec, parts.hf_model.config
    arch = architecture(spec.model_type)
    weights, attention = arch.layer(parts.hf_model, index), arch.layer_attention(config, index)
    window = attention.window if attention.window is not None else -1
    ops = FusedOps(packed, weights, spec, arch.attention_scale(spec, config), window)
    return DecoderLayer(ops, arch, weights, index, attention)


class FusedSpanGraph(SpanFlow):
    """Static fused graph for one GraphSpec (flavour "ort"); traced with T and R dynamic."""

    def __init__(self, parts: ModelParts, graph: GraphSpec, packed: PackedWeights) -> None:
        super().__init__()
        if not graph.layers:
            raise ValueError(f"graph {graph.name!r} has no layers")
        hf, arch = parts.hf_model, architecture(parts.spec.model_type)
        self.embed = arch.embed(hf) if graph.source == "ids" else None
        self.embed_scale = arch.embed_scale(parts.spec)
        self.layers = nn.ModuleList(fused_layer(packed.layers[i], parts, i) for i in graph.layers)
        self.tables = sorted({layer.rope for layer in self.layers})  # the rotary tables these layers use, as buffers
        for index, key in enumerate(self.tables):
            cos, sin = packed.rotary[key]
            self.register_buffer(f"cos_cache_{index}", cos, persistent=False)
            self.register_buffer(f"sin_cache_{index}", sin, persistent=False)
        self.head = Head(hf, parts.spec, ort_ops.rms_norm)
        self.add_graph_parts(parts, graph)
        self.vocab = parts.spec.vocab_size
        self.register_buffer("prompts", appended_embeddings(parts, graph), persistent=False)

    def tokens(self, x: Tensor) -> Tensor:
        return x[0]

    def batched(self, x: Tensor) -> Tensor:
        return x

    def forward(
        self, first: Tensor, logit_rows: Tensor, seqlens_k: Tensor, total_length: Tensor, *past: Tensor
    ) -> tuple[Tensor, ...]:
        n = len(self.layers)
        past_keys, past_values = past[:n], past[n:]
        x = (
            embed_tokens(self.embed, self.embed_scale, first, self.prompts, self.vocab)
            if self.embed is not None
            else first
        )  # [1, T, H]
        kv = [
            ArenaKV(key, value, seqlens_k, total_length, *self.cos_sin(layer.rope))
            for layer, key, value in zip(self.layers, past_keys, past_values)
        ]
        hidden, keys, values, scores = self.run_layers(x, kv)
        return self.outputs(hidden, hidden.index_select(1, logit_rows), keys, values, scores)

    def cos_sin(self, rope: str) -> tuple[Tensor, Tensor]:
        index = self.tables.index(rope)
        return getattr(self, f"cos_cache_{index}"), getattr(self, f"sin_cache_{index}")


def packed_weights(parts: ModelParts, max_len: int) -> PackedWeights:
    """PackedWeights of these parts, built once per max_len (packing copies every weight)."""
    if max_len not in parts.packed_by_max_len:
        parts.packed_by_max_len[max_len] = PackedWeights(parts, max_len)
    return parts.packed_by_max_len[max_len]
