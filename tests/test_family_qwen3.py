"""Qwen3 (qwen3) on a tiny random model: QK-norm (per-head RMSNorm of q and k, weight off one)
before rotary, no QKV biases; both ONNX flavours against HF transformers. What the graphs do not
implement (sliding-window layers, attention biases) is refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_parity import assert_family_parity, build_refused, make_family_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_model(tmp_path_factory.mktemp("qwen3") / "model", "qwen3", head_dim=16)


def test_adapter_reads_the_qk_norms(qwen3_dir: Path) -> None:
    from adaptive_export.graphs.architectures import architecture
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(qwen3_dir))
    assert type(loaded.hf_model).__name__ == "Qwen3ForCausalLM"
    weights = architecture("qwen3").layer(loaded.hf_model, 1)
    attn = loaded.hf_model.model.layers[1].self_attn
    assert weights.q_norm is attn.q_norm and weights.k_norm is attn.k_norm
    assert weights.q.bias is None and not (attn.q_norm.weight == 1).all()  # the norm's weight matters


@pytest.mark.parametrize("flavour", ["ort", "portable"])
def test_qwen3_matches_hf(qwen3_dir: Path, flavour: str, tmp_path: Path) -> None:
    assert_family_parity(qwen3_dir, flavour, tmp_path)


@pytest.mark.parametrize(
    ("config", "word"),
    [
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_what_the_graphs_lack_is_refused(tmp_path: Path, config: dict, word: str, capsys) -> None:
    model = make_family_model(tmp_path / "model", "qwen3", head_dim=16, **config)
    build_refused(model, tmp_path, "ort", capsys, word)
