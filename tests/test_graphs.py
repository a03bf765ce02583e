"""The static PyTorch graphs equal HF transformers on tiny random models (before any ONNX)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from adaptive_export.exporter.graph_entry import manifest_graph
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts, SpanGraph
from adaptive_export.loading.model import load_model
from tests.conftest import TINY_VARIANTS, make_tiny_model


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_prefill_then_decode_equals_hf(tmp_path: Path, variant: str) -> None:
    loaded = load_model(str(make_tiny_model(tmp_path / variant, variant)))
    parts = ModelParts(loaded.hf_model, loaded.spec)
    every = tuple(range(loaded.spec.num_layers))
    graph = SpanGraph(parts, GraphSpec("decode", "decode", every)).eval()
    ids = torch.randint(0, loaded.spec.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    n = len(every)
    with torch.no_grad():
        reference = loaded.hf_model(ids).logits
        empty = [torch.zeros(0, loaded.spec.num_kv_heads, loaded.spec.head_dim)] * (2 * n)
        first = graph(ids[:, :7], *empty)
        second = graph(
            ids[:, 7:], *[torch.cat(p) for p in zip(first[1 : 1 + n])], *[torch.cat(p) for p in zip(first[1 + n :])]
        )
    torch.testing.assert_close(first[0], reference[:, :7], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(second[0], reference[:, 7:], atol=1e-5, rtol=1e-4)
    assert first[1].shape == (7, loaded.spec.num_kv_heads, loaded.spec.head_dim)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from transformers import GPT2Config

    from adaptive_export.loading.model import spec_from_config
    from adaptive_export.runtimes.errors import UsageError

    with pytest.raises(UsageError, match="model type 'gpt2' is not supported.*llama"):
        spec_from_config(GPT2Config())


def test_sliding_window_mask() -> None:
    """The mask hook a sliding-window family (e.g. Gemma 3's local layers) gets: the last `window` keys."""
    from adaptive_export.graphs.layers import MASK_VALUE, causal_mask

    full, windowed = causal_mask(2, 3), causal_mask(2, 3, window=2)
    allowed = [[k <= q and k > q - 2 for k in range(5)] for q in range(2, 5)]
    assert (windowed == 0).tolist() == allowed and (windowed[~(windowed == 0)] == MASK_VALUE).all()
    assert (full == 0).tolist() == [[k <= q for k in range(5)] for q in range(2, 5)]


def test_every_model_type_has_one_architecture() -> None:
    from adaptive_export.graphs.architectures import ARCHITECTURES, FAMILIES, SUPPORTED_MODEL_TYPES

    assert set(SUPPORTED_MODEL_TYPES) == {"llama", "qwen2", "mistral", "gemma3_text", "qwen3", "phi3", "smollm3"}
    assert sum(len(family.model_types) for family in FAMILIES) == len(ARCHITECTURES)


@pytest.mark.parametrize("family", ["qwen2_gqa", "gemma3"])
def test_both_flavours_share_one_layer_and_agree(tmp_path: Path, family: str) -> None:
    """The portable and ort graphs are one DecoderLayer definition with two sets of ops: in PyTorch
    they give the same logits, router scores, exit hidden state and new K/V rows (QKV biases,
    GQA; Gemma 3's QK-norm, sandwich norms and sliding window past the window)."""
    from adaptive_export.graphs.adaptive import Routers
    from adaptive_export.graphs.decoder_layer import DecoderLayer
    from adaptive_export.graphs.fused_graph import FusedSpanGraph, packed_weights
    from tests.test_gemma3 import WINDOW, make_tiny_gemma3

    model = make_tiny_gemma3(tmp_path / "m") if family == "gemma3" else make_tiny_model(tmp_path / "m", family)
    loaded = load_model(str(model))
    spec = loaded.spec
    routers = Routers(spec.num_layers, spec.hidden_size)
    torch.nn.init.normal_(routers.weight, 0.0, 0.1, generator=torch.Generator().manual_seed(0))
    parts = ModelParts(loaded.hf_model, spec, routers=routers.requires_grad_(False))
    every = tuple(range(spec.num_layers))
    graph = GraphSpec("decode", "decode", every, router_scores=True, exit_hidden=True)
    portable = SpanGraph(parts, graph).eval()
    fused = FusedSpanGraph(parts, replace(graph, flavour="ort"), packed_weights(parts, 32)).eval()
    assert packed_weights(parts, 32) is packed_weights(parts, 32)  # packed once per build
    assert {type(layer) for layer in [*portable.layers, *fused.layers]} == {DecoderLayer}
    past_len, new = WINDOW + 3, 4
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, spec.vocab_size, (1, new), generator=generator)
    prefix = [
        torch.randn(past_len, spec.num_kv_heads, spec.head_dim, generator=generator) for _ in range(2 * len(every))
    ]
    blocks = [torch.zeros(1, spec.num_kv_heads, 32, spec.head_dim) for _ in prefix]
    for block, rows in zip(blocks, prefix):
        block[0, :, :past_len] = rows.transpose(0, 1)
    control = (
        torch.arange(new),
        torch.tensor([past_len + new - 1], dtype=torch.int32),
        torch.tensor(past_len + new, dtype=torch.int32),
    )
    with torch.no_grad():
        ours = portable(ids, *prefix)
        theirs = fused(ids, *control, *blocks)
    for name, a, b in zip(manifest_graph(graph).output_names(), ours[:3], theirs[:3]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)
    for rows, block in zip(ours[3:], theirs[3:]):
        torch.testing.assert_close(rows, block[0, :, past_len : past_len + new].transpose(0, 1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_gqa", "phi3"])
def test_packing_holds_each_layer_weight_once(tmp_path: Path, family: str) -> None:
    """The fused layout and the HF model share storage (issue #36: `check` of the 1.5B held both
    fp32 copies, 16.6 GB against 11.5 GB), and the HF model computes what it computed before;
    phi3's q/k/v and gate/up are slices of fused projections and keep their own storage."""
    from adaptive_export.graphs.architectures import architecture
    from adaptive_export.graphs.fused_graph import packed_weights
    from tests.family_parity import make_family_model

    made = make_family_model(tmp_path / "m", "phi3") if family == "phi3" else make_tiny_model(tmp_path / "m", family)
    loaded = load_model(str(made))
    hf, spec = loaded.hf_model.eval(), loaded.spec
    ids = torch.randint(0, spec.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = hf(ids).logits
    packed = packed_weights(ModelParts(hf, spec), 32)
    with torch.no_grad():
        after = hf(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    arch = architecture(spec.model_type)
    for index, layer in enumerate(packed.layers):
        w = arch.layer(hf, index)
        assert w.o.weight.data_ptr() == layer.o.data_ptr() and w.down.weight.data_ptr() == layer.down.data_ptr()
        shared = w.gate.weight.untyped_storage().data_ptr() == layer.gate_up.untyped_storage().data_ptr()
        assert shared == (family != "phi3")
