"""The static PyTorch graphs equal HF transformers on tiny random models (before any ONNX)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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

    assert set(SUPPORTED_MODEL_TYPES) == {"llama", "qwen2", "mistral", "gemma3_text"}
    assert sum(len(family.model_types) for family in FAMILIES) == len(ARCHITECTURES)
