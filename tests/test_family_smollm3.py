"""SmolLM3 (smollm3) on a tiny random model: NoPE layers (no_rope_layers: layer 1 of 3 applies no
rotary embedding), tied embeddings; both ONNX flavours against HF transformers. A graph that rotated
every layer, or none, would diverge. Sliding-window layers and biases are refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_parity import assert_family_parity, build_refused, make_family_model

NO_ROPE_LAYERS = [1, 0, 1]  # 1: rotary, 0: none (HF's convention)


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("smollm3") / "model"
    return make_family_model(directory, "smollm3", num_hidden_layers=3, no_rope_layers=NO_ROPE_LAYERS)


def test_nope_layers_read_the_identity_table(smollm3_dir: Path) -> None:
    import torch

    from adaptive_export.graphs.architectures import DEFAULT_ROPE, architecture
    from adaptive_export.graphs.layers import DecoderStack
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(smollm3_dir))
    assert type(loaded.hf_model).__name__ == "SmolLM3ForCausalLM" and loaded.spec.tie_word_embeddings
    arch, config = architecture("smollm3"), loaded.hf_model.config
    assert [arch.layer_attention(config, i).rope for i in range(3)] == [DEFAULT_ROPE, "no_rope", DEFAULT_ROPE]
    stack = DecoderStack(loaded.hf_model, loaded.spec, range(3))
    cos, sin = stack.rotaries["no_rope"](5, 7)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))


@pytest.mark.parametrize("flavour", ["ort", "portable"])
def test_smollm3_matches_hf(smollm3_dir: Path, flavour: str, tmp_path: Path) -> None:
    assert_family_parity(smollm3_dir, flavour, tmp_path)


def test_sliding_window_is_refused(tmp_path: Path, capsys) -> None:
    model = make_family_model(tmp_path / "model", "smollm3", use_sliding_window=True, sliding_window=8)
    build_refused(model, tmp_path, "ort", capsys, "use_sliding_window")
