"""The ONNX Runtime flavour of every graph: fused ops over packed weights, KV cache in place.

Same graphs as graphs/span_graph.py (prefill, decode per configuration, draft, verify;
one `GraphSpec` each) and the same math, expressed with graphs/ort_ops.py so that the
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
from adaptive_export.graphs.architectures import DEFAULT_ROPE, architecture
from adaptive_export.graphs.layers import Rotary, embed_tokens
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts, draft_head, prompt_table, trainable_additions

GELU_TANH_MODULES = ("GELUTanh", "PytorchGELUTanh")  # transformers 5 / 4 names of gelu_pytorch_tanh


@dataclass
class PackedLayer:
    qkv: Tensor  # [H, (nh + 2 kv) hd]
    qkv_bias: Tensor | None
    o: Tensor  # [nh hd, H]
    gate_up: Tensor  # [H, 2 I]
    down: Tensor  # [I, H]


class PackedWeights:
    """The fused flavour's weight layout, computed once per build and shared by its graphs."""

    def __init__(self, parts: ModelParts, max_len: int) -> None:
        self.max_len = max_len
        hf, arch = parts.hf_model, architecture(parts.spec.model_type)
        self.layers: list[PackedLayer] = []
        for index in range(parts.spec.num_layers):
            w = arch.layer(hf, index)
            biases = [w.q.bias, w.k.bias, w.v.bias]
            self.layers.append(
                PackedLayer(
                    qkv=torch.cat([w.q.weight, w.k.weight, w.v.weight]).T.contiguous(),
                    qkv_bias=torch.cat(biases).contiguous() if all(b is not None for b in biases) else None,
                    o=w.o.weight.T.contiguous(),
                    gate_up=torch.cat([w.gate.weight, w.up.weight]).T.contiguous(),
                    down=w.down.weight.T.contiguous(),
                )
            )
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


class FusedDecoderLayer(nn.Module):
    """One decoder layer on the residual stream (delta, residual): the residual add of the
    previous block is fused into this block's input norm (SkipSimplifiedLayerNormalization).

    What the family adds (graphs/architectures) costs an op only where the model has it:
    QK-norm on the query and key heads before GroupQueryAttention's rotary, the sandwich norms
    on the attention and MLP outputs, the attention scale and the layer's sliding window."""

    def __init__(self, packed: PackedLayer, parts: ModelParts, layer_id: int) -> None:
        super().__init__()
        spec, config = parts.spec, parts.hf_model.config
        self.layer_id = layer_id
        self.eps = spec.rms_norm_eps
        self.num_heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.intermediate = spec.intermediate_size
        self.arch = architecture(spec.model_type)
        self.scale = self.arch.attention_scale(spec, config)
        attention = self.arch.layer_attention(config, layer_id)
        self.rope = attention.rope
        self.local_window_size = (
            attention.window if attention.window is not None else -1
        )  # HF's window, as ORT counts it
        weights = self.arch.layer(parts.hf_model, layer_id)
        # HF's GELUTanh (gelu_pytorch_tanh) as one fused node; any other activation as HF computes it
        self.act = ort_ops.gelu_tanh if type(weights.act).__name__ in GELU_TANH_MODULES else weights.act
        for name in ("qkv", "o", "gate_up", "down"):
            self.register_buffer(name, getattr(packed, name), persistent=False)
        if packed.qkv_bias is not None:
            self.register_buffer("qkv_bias", packed.qkv_bias, persistent=False)
        else:
            self.qkv_bias = None
        self.input_layernorm, self.post_attention_layernorm = weights.input_norm, weights.pre_mlp_norm
        self.q_norm, self.k_norm = weights.q_norm, weights.k_norm
        self.attention_out_norm, self.mlp_out_norm = weights.post_attention_norm, weights.post_mlp_norm

    def norm(self, x: Tensor, module: nn.Module) -> Tensor:
        return ort_ops.rms_norm(x, self.arch.norm_weight(module), self.eps)

    def normed_input(self, delta: Tensor | None, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm of this layer's input, the input itself) from the stream."""
        if delta is None:
            return self.norm(residual, self.input_layernorm), residual
        return ort_ops.skip_rms_norm(delta, residual, self.arch.norm_weight(self.input_layernorm), self.eps)

    def qk_normed(self, qkv: Tensor) -> Tensor:
        """Packed QKV with the per-head QK-norm applied to the query and key heads."""
        t = qkv.shape[1]
        q, k, v = qkv.split(
            (self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim), dim=-1
        )
        q = self.norm(q.reshape(1, t, self.num_heads, self.head_dim), self.q_norm).reshape(1, t, -1)
        k = self.norm(k.reshape(1, t, self.kv_heads, self.head_dim), self.k_norm).reshape(1, t, -1)
        return torch.cat((q, k, v), dim=-1)

    def forward(
        self,
        h: Tensor,
        residual: Tensor,
        past_key: Tensor,
        past_value: Tensor,
        seqlens_k: Tensor,
        total_length: Tensor,
        cos: Tensor,
        sin: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qkv = torch.matmul(h, self.qkv)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_norm is not None:
            qkv = self.qk_normed(qkv)
        attn, present_key, present_value = ort_ops.gqa(
            qkv,
            past_key,
            past_value,
            seqlens_k,
            total_length,
            cos,
            sin,
            self.num_heads,
            self.kv_heads,
            self.scale,
            self.local_window_size,
        )
        attn = torch.matmul(attn, self.o)
        if self.attention_out_norm is not None:
            attn = self.norm(attn, self.attention_out_norm)
        h2, residual = ort_ops.skip_rms_norm(
            attn, residual, self.arch.norm_weight(self.post_attention_layernorm), self.eps
        )
        gate, up = torch.matmul(h2, self.gate_up).split(self.intermediate, dim=-1)
        delta = torch.matmul(self.act(gate) * up, self.down)
        if self.mlp_out_norm is not None:
            delta = self.norm(delta, self.mlp_out_norm)
        return delta, residual, present_key, present_value


class FusedSpanGraph(nn.Module):
    """Static fused graph for one GraphSpec (flavour "ort"); traced with T and R dynamic."""

    def __init__(self, parts: ModelParts, graph: GraphSpec, packed: PackedWeights) -> None:
        super().__init__()
        if not graph.layers:
            raise ValueError(f"graph {graph.name!r} has no layers")
        self.graph = graph
        hf, self.arch = parts.hf_model, architecture(parts.spec.model_type)
        self.embed = self.arch.embed(hf) if graph.source == "ids" else None
        self.embed_scale = self.arch.embed_scale(parts.spec)
        self.layers = nn.ModuleList(FusedDecoderLayer(packed.layers[i], parts, i) for i in graph.layers)
        self.tables = sorted({layer.rope for layer in self.layers})  # the rotary tables these layers use, as buffers
        for index, key in enumerate(self.tables):
            cos, sin = packed.rotary[key]
            self.register_buffer(f"cos_cache_{index}", cos, persistent=False)
            self.register_buffer(f"sin_cache_{index}", sin, persistent=False)
        self.norm, self.lm_head = self.arch.final_norm(hf), self.arch.lm_head(hf)
        self.eps = parts.spec.rms_norm_eps
        self.routers, self.adapter = trainable_additions(parts, graph)
        self.vocab = parts.spec.vocab_size
        self.register_buffer("prompts", prompt_table(parts, graph), persistent=False)
        self.register_buffer("draft_head", draft_head(parts, graph), persistent=False)

    def forward(
        self, first: Tensor, logit_rows: Tensor, seqlens_k: Tensor, total_length: Tensor, *past: Tensor
    ) -> tuple[Tensor, ...]:
        n = len(self.layers)
        past_keys, past_values = past[:n], past[n:]
        residual = (
            embed_tokens(self.embed, self.embed_scale, first, self.prompts, self.vocab)
            if self.embed is not None
            else first
        )  # [1, T, H]
        delta: Tensor | None = None
        keys, values, scores = [], [], []
        for position, layer in enumerate(self.layers):
            h, residual = layer.normed_input(delta, residual)
            if self.routers is not None:
                scores.append(self.routers.score(layer.layer_id, residual[0]))
            delta, residual, k, v = layer(
                h,
                residual,
                past_keys[position],
                past_values[position],
                seqlens_k,
                total_length,
                *self.cos_sin(layer.rope),
            )
            keys.append(k)
            values.append(v)
        hidden = delta + residual
        if self.adapter is not None:
            head_in = ort_ops.rms_norm(
                self.adapter(hidden.index_select(1, logit_rows)), self.arch.norm_weight(self.norm), self.eps
            )
        else:
            head_in = ort_ops.rms_norm(hidden.index_select(1, logit_rows), self.arch.norm_weight(self.norm), self.eps)
        head = self.lm_head.weight if self.draft_head is None else self.draft_head
        outputs: list[Tensor] = [torch.nn.functional.linear(head_in[0], head)[None]]
        if self.routers is not None:
            outputs.append(torch.stack(scores))
        if self.graph.exit_hidden:
            outputs.append(hidden)
        return tuple(outputs + keys + values)

    def cos_sin(self, rope: str) -> tuple[Tensor, Tensor]:
        index = self.tables.index(rope)
        return getattr(self, f"cos_cache_{index}"), getattr(self, f"sin_cache_{index}")


def packed_weights(parts: ModelParts, max_len: int) -> PackedWeights:
    """PackedWeights of these parts, built once per max_len (packing copies every weight)."""
    cache: dict[int, PackedWeights] = parts.__dict__.setdefault("_packed_weights", {})
    if max_len not in cache:
        cache[max_len] = PackedWeights(parts, max_len)
    return cache[max_len]
