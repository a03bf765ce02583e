"""Llama with rope scaling (Llama 3.x's `llama3`, `linear` and `yarn`): the graphs read HF's own rotary
module, so the scaled tables must match HF's in both ONNX flavours. `dynamic` (and `longrope`)
recompute the tables from the sequence length, which one static table cannot express: refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_parity import assert_family_parity, build_refused, make_family_model

ROPE = {
    # original context 32 (of 512): the mid and low frequencies are scaled within the test's lengths
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    },
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    # static too, and its attention_scaling (mscale) multiplies cos and sin
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
}


@pytest.fixture(scope="module", params=["linear", "llama3"])  # yarn: its table only (below), to keep the module short
def scaled_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(f"llama-{request.param}") / "model"
    return make_family_model(directory, "llama", rope_parameters=ROPE[request.param])


@pytest.mark.parametrize("rope_type", sorted(ROPE))
def test_rotary_tables_are_hf_scaled_ones(rope_type: str, tmp_path: Path) -> None:
    """The static stack's table is HF's scaled table, not the default one (so the test below is not vacuous)."""
    import torch

    from adaptive_export.graphs.layers import DecoderStack
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(make_family_model(tmp_path / "model", "llama", rope_parameters=ROPE[rope_type])))
    stack = DecoderStack(loaded.hf_model, loaded.spec, range(loaded.spec.num_layers))
    hf_rotary = loaded.hf_model.model.rotary_emb
    positions = torch.arange(40)
    x = torch.zeros(1, 40, loaded.spec.head_dim)
    cos, sin = hf_rotary(x, positions[None])
    ours = stack.rotary(0, 40)
    torch.testing.assert_close(ours[0], cos[0])
    torch.testing.assert_close(ours[1], sin[0])
    default = 1.0 / (10000.0 ** (torch.arange(0, loaded.spec.head_dim, 2).float() / loaded.spec.head_dim))
    assert not torch.allclose(stack.rotary.inv_freq, default) or stack.rotary.scaling != 1.0


@pytest.mark.parametrize("flavour", ["ort", "portable"])
def test_scaled_rope_matches_hf(scaled_model: Path, flavour: str, tmp_path: Path) -> None:
    assert_family_parity(scaled_model, flavour, tmp_path)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused(tmp_path: Path, rope_type: str, capsys) -> None:
    params = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=32)
    model = make_family_model(tmp_path / "model", "llama", rope_parameters=params)
    build_refused(model, tmp_path, "ort", capsys, f"rope_type {rope_type!r}", "sequence length")
