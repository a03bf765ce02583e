"""Gemma 3 (gemma3_text) on a tiny random model: both ONNX flavours against HF transformers.

The model mixes sliding-window (window 8) and full-attention layers and generates well past
the window, so a graph that ignored the window at decode time, used one rotary table for both
layer types, missed a norm, the (1 + w) weight, the embedding scale or the query scale
would diverge from HF.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adaptive_export.commands.cli import main
from tests.conftest import make_tokenizer

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "The quick brown fox",
    "Static graphs",
]
NEW_TOKENS = 3 * WINDOW


def make_tiny_gemma3(directory: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        query_pre_attn_scalar=24,  # not head_dim, so a graph scaling by head_dim ** -0.5 would differ
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():  # peaked logits (few float ties); norm weights off zero so (1 + w) matters
        for param in model.parameters():
            param.normal_(0.0, 0.08 if param.dim() == 2 else 0.2)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture(scope="module", params=["ort", "portable"])
def gemma_bundle(gemma_dir: Path, request: pytest.FixtureRequest) -> Path:
    """The fused flavour (GroupQueryAttention with local_window_size, QK-norm before its rotary,
    one cos/sin cache per layer type) and the portable one (standard ops, explicit masks)."""
    out = gemma_dir.parent / f"bundle-{request.param}"
    assert main(["build", str(gemma_dir), "-o", str(out), "--max-len", "64", "--onnx-flavour", request.param]) == 0
    return out


@pytest.fixture(scope="module")
def hf(gemma_dir: Path):
    from adaptive_export.loading.model import load_model

    return load_model(str(gemma_dir))


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_check_passes_on_every_engine(gemma_bundle: Path, gemma_dir: Path, tmp_path: Path) -> None:
    import json

    report, prompts = tmp_path / "r.json", tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    )  # chat-templated (about 40 tokens) + 16 new fit max_len 64
    assert (
        main(
            [
                "check",
                str(gemma_bundle),
                "--model",
                str(gemma_dir),
                "--report",
                str(report),
                "--prompts",
                str(prompts),
                "--new-tokens",
                str(2 * WINDOW),
            ]
        )
        == 0
    )
    data = json.loads(report.read_text())
    engines = {r["engine"] for r in data["results"] if r["check"] == "parity"}
    assert {"prefill", "decode_full"} <= engines and data["passed"]


def test_greedy_equals_hf_generate_past_the_window(gemma_bundle: Path, hf) -> None:
    import torch

    from adaptive_export.runtimes import Generator

    generator = Generator(gemma_bundle)
    eos = sorted(generator.codec.eos_ids)
    for prompt in PROMPTS:
        ids = prompt_ids(hf.tokenizer, prompt)
        ours = generator.generate(ids, mode="ar", max_new_tokens=NEW_TOKENS, raw=True).tokens
        with torch.no_grad():
            out = hf.hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=hf.tokenizer.pad_token_id,
            )
        theirs = out[0, len(ids) :].tolist()
        assert ours == theirs, (prompt, ours, theirs)
        assert len(ids) + len(ours) > 2 * WINDOW  # the window mattered


def test_logits_match_hf_prefill_and_decode(gemma_bundle: Path, hf) -> None:
    """Prefill over the prompt, then one decode pass over a forced continuation that runs past
    the window (the arena holds more rows than a sliding layer may see)."""
    import torch

    from adaptive_export.exporter.check import teacher_forced_logits
    from adaptive_export.runtimes import Generator

    generator = Generator(gemma_bundle)
    rng = np.random.default_rng(0)
    for prompt in PROMPTS:
        ids = prompt_ids(hf.tokenizer, prompt)
        continuation = [int(t) for t in rng.integers(3, hf.spec.vocab_size, size=2 * WINDOW + 3)]
        ours = teacher_forced_logits(generator, ids, continuation)
        with torch.no_grad():
            full = hf.hf_model(torch.tensor([ids + continuation[:-1]])).logits[0].numpy()
        theirs = full[len(ids) - 1 :]
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours[0], theirs[0], atol=1e-4, rtol=1e-4)  # prefill
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)  # decode past the window


def test_sliding_window_masks_the_arena_at_decode() -> None:
    """Decode at P past the window: a sliding layer's mask hides every row older than the window."""
    from adaptive_export.graphs.architectures import LayerAttention
    from adaptive_export.graphs.layers import MASK_VALUE, layer_masks

    sliding, full = layer_masks([LayerAttention(rope="sliding_attention", window=WINDOW), LayerAttention()], 20, 1)
    assert (sliding[0, 20 - WINDOW + 1 :] == 0).all() and (sliding[0, : 20 - WINDOW + 1] == MASK_VALUE).all()
    assert (full == 0).all()


def test_config_reading(gemma_dir: Path) -> None:
    from transformers import AutoConfig

    from adaptive_export.graphs.architectures import DEFAULT_ROPE, architecture

    config = AutoConfig.from_pretrained(gemma_dir)
    arch = architecture("gemma3_text")
    spec = arch.spec_from_config(config)
    assert [arch.layer_attention(config, i).window for i in range(4)] == [WINDOW, None, WINDOW, WINDOW]
    assert [arch.layer_attention(config, i).rope for i in range(4)] == ["sliding_attention", DEFAULT_ROPE] + [
        "sliding_attention"
    ] * 2
    assert arch.attention_scale(spec, config) == pytest.approx(24**-0.5)
    assert arch.embed_scale(spec) == 8.0 and spec.tie_word_embeddings
    assert arch.unsupported(config) is None
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        capped = AutoConfig.from_pretrained(gemma_dir, **{name: 30.0})
        problem, fix = arch.unsupported(capped)
        assert name in problem and "null" in fix


def test_softcapping_is_refused_by_build(gemma_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import shutil

    model = tmp_path / "capped"
    shutil.copytree(gemma_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["final_logit_softcapping"] = 30.0
    (model / "config.json").write_text(json.dumps(config))
    assert (
        main(["build", str(model), "-o", str(tmp_path / "out"), "--max-len", "64", "--onnx-flavour", "portable"]) != 0
    )
    assert "final_logit_softcapping" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fused_graph_windows_and_tables_per_layer_type(gemma_bundle: Path) -> None:
    """The fused engine's GroupQueryAttention nodes carry each layer's window (HF's layer_types)
    and read the rotary table of their layer type: two cos caches, not one."""
    import json

    import onnx

    onnx_backend = json.loads((gemma_bundle / "manifest.json").read_text())["backends"]["onnx"]
    if onnx_backend["flavour"] != "ort":
        pytest.skip("the portable flavour has no fused attention (its masks are tested above)")
    model = onnx.load(str(gemma_bundle / onnx_backend["graphs"]["decode_full"]["file"]), load_external_data=False)
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    windows = [next(a.i for a in n.attribute if a.name == "local_window_size") for n in attention]
    assert windows == [WINDOW if t == "sliding_attention" else -1 for t in LAYER_TYPES]
    cos_inputs = {n.input[7] for n in attention}
    assert len(cos_inputs) == 2


def test_static_stack_matches_hf_with_linear_rope_on_full_layers() -> None:
    """Gemma 3 4B+ scale the global layers' rope linearly (factor 8): the adapter reads each layer
    type's table from HF's rotary module, so the scaled table comes along (PyTorch level, GQA 2)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from adaptive_export.graphs.architectures import architecture
    from adaptive_export.graphs.layers import DecoderStack

    config = Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=list(reversed(LAYER_TYPES)),
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08 if param.dim() == 2 else 0.2)
    arch = architecture("gemma3_text")
    assert arch.unsupported(config) is None
    stack = DecoderStack(model, arch.spec_from_config(config), range(4)).eval()
    ids = torch.randint(0, 300, (1, 5 * WINDOW))
    empty = torch.zeros(0, 2, 16)
    with torch.no_grad():
        expected = model(ids).logits[0]
        x = stack.embed_ids(ids[0])
        for layer, (cos, sin, mask) in zip(stack.layers, stack.frame(0, ids.shape[1])):
            x, _, _ = layer(x, empty, empty, cos, sin, mask)
        torch.testing.assert_close(stack.head(x), expected, atol=1e-4, rtol=1e-4)


def test_coreml_converts_gemma3(gemma_dir: Path, tmp_path: Path) -> None:
    """CoreML conversion runs for real on Linux (prediction needs macOS): every graph of a Gemma 3
    bundle, sliding-window masks and QK-norm included, becomes a function of one package."""
    import json

    ct = pytest.importorskip("coremltools", reason="coremltools is not installed (pip install adaptive-export[coreml])")
    out = tmp_path / "coreml"
    assert main(["build", str(gemma_dir), "-o", str(out), "--max-len", "64", "--backend", "onnx,coreml"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    spec = ct.utils.load_spec(str(out / manifest["backends"]["coreml"]["package"]))
    assert {f.name for f in spec.description.functions} == set(manifest["graphs"])


def test_routers_and_speculation_on_gemma3(gemma_dir: Path, tmp_path: Path) -> None:
    """Router training, skip configurations and early-exit speculation reach Gemma 3 through the
    same architecture adapter as the graphs: a routed, speculating fused bundle whose every
    engine and greedy path (plain, each skip configuration, each draft source) passes `check`."""
    import json

    from tests.conftest import ROUTER_CALIB

    calib, prompts = tmp_path / "calib.jsonl", tmp_path / "prompts.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ROUTER_CALIB))
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    out, report = tmp_path / "routed", tmp_path / "r.json"
    assert (
        main(
            [
                "build",
                str(gemma_dir),
                "-o",
                str(out),
                "--max-len",
                "96",
                "--routers",
                "train",
                "--calib",
                str(calib),
                "--router-lambda",
                "2.0",
                "--router-lr",
                "0.02",
                "--min-config-agreement",
                "0",
                "--speculate",
                "2:2",
            ]
        )
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["configs"]) >= 2, manifest["configs"]  # full plus at least one skip configuration
    assert (
        main(
            [
                "check",
                str(out),
                "--model",
                str(gemma_dir),
                "--report",
                str(report),
                "--prompts",
                str(prompts),
                "--new-tokens",
                str(WINDOW),
            ]
        )
        == 0
    )
    engines = {r["engine"] for r in json.loads(report.read_text())["results"]}
    assert {"spec:full:early_exit", "spec:full:prompt_lookup"} <= engines, engines
