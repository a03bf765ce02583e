"""Phi-3 (phi3) on a tiny random model: packed qkv_proj and gate_up_proj (sliced by the adapter,
restacked by the fused flavour) and a sliding window on every layer, generating past it; both ONNX
flavours against HF transformers. partial_rotary_factor < 1 and su / longrope scaling are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_parity import NEW_TOKENS, assert_family_parity, build_refused, make_family_model

WINDOW = 8


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_model(tmp_path_factory.mktemp("phi3") / "model", "phi3", sliding_window=WINDOW)


def test_adapter_slices_the_packed_projections(phi3_dir: Path) -> None:
    import torch

    from adaptive_export.graphs.architectures import architecture
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(phi3_dir))
    assert type(loaded.hf_model).__name__ == "Phi3ForCausalLM"
    weights = architecture("phi3").layer(loaded.hf_model, 0)
    attn, mlp = loaded.hf_model.model.layers[0].self_attn, loaded.hf_model.model.layers[0].mlp
    assert torch.equal(torch.cat([weights.q.weight, weights.k.weight, weights.v.weight]), attn.qkv_proj.weight)
    assert torch.equal(torch.cat([weights.gate.weight, weights.up.weight]), mlp.gate_up_proj.weight)
    assert weights.q.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()  # a view of the HF parameter
    assert architecture("phi3").layer_attention(loaded.hf_model.config, 1).window == WINDOW < NEW_TOKENS


@pytest.mark.parametrize("flavour", ["ort", "portable"])
def test_phi3_matches_hf(phi3_dir: Path, flavour: str, tmp_path: Path) -> None:
    assert_family_parity(phi3_dir, flavour, tmp_path)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"partial_rotary_factor": 0.5}, ("partial_rotary_factor",)),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                },
                "original_max_position_embeddings": 32,
            },
            ("longrope", "sequence length"),
        ),
    ],
    ids=["partial_rotary", "longrope"],
)
def test_what_the_graphs_lack_is_refused(tmp_path: Path, config: dict, words: tuple[str, ...], capsys) -> None:
    model = make_family_model(tmp_path / "model", "phi3", **config)
    build_refused(model, tmp_path, "ort", capsys, *words)
