"""The static PyTorch graphs equal HF transformers on tiny random models (before any ONNX)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loading.model import load_model
from graphs.span_graph import GraphSpec, ModelParts, SpanGraph
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
        second = graph(ids[:, 7:], *[torch.cat(p) for p in zip(first[1:1 + n])], *[torch.cat(p) for p in zip(first[1 + n:])])
    torch.testing.assert_close(first[0], reference[:, :7], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(second[0], reference[:, 7:], atol=1e-5, rtol=1e-4)
    assert first[1].shape == (7, loaded.spec.num_kv_heads, loaded.spec.head_dim)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from transformers import GPT2Config

    from loading.model import spec_from_config
    from runtimes.errors import UsageError

    with pytest.raises(UsageError, match="model type 'gpt2' is not supported.*llama"):
        spec_from_config(GPT2Config())
