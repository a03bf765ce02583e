"""What every family test (tests/test_family_*.py) asserts on its tiny random model, in both ONNX
flavours: the bundle's logits (prefill and decode, teacher-forced) equal HF's within the tolerances
of tests/test_gemma3.py, greedy decoding is token-identical to HF's generate, and `check` passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.commands.cli import main
from tests.conftest import make_tokenizer

PROMPTS = ["What is the capital of France?", "The quick brown fox", "Static graphs"]
NEW_TOKENS = 20
MAX_LEN = 96


def make_family_model(directory: Path, model_type: str, seed: int = 0, **config: Any) -> Path:
    """A tiny random model of `model_type` (2 layers, hidden 64, 4 heads, GQA 2) saved with the test
    tokenizer; norm weights off one and biases off zero, so a graph that ignored one would differ."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    fields: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    model_config = AutoConfig.for_model(model_type, **{**fields, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config)
    with torch.no_grad():  # peaked logits (few float ties)
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    return directory


def build(model: Path, out: Path, flavour: str) -> Path:
    argv = ["build", str(model), "-o", str(out), "--max-len", str(MAX_LEN), "--onnx-flavour", flavour]
    assert main(argv) == 0
    return out


def assert_check_passes(bundle: Path, model: Path, tmp_path: Path) -> None:
    report, prompts = tmp_path / "report.json", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    argv = ["check", str(bundle), "--model", str(model), "--report", str(report), "--prompts", str(prompts)]
    assert main([*argv, "--new-tokens", "8"]) == 0
    data = json.loads(report.read_text())
    engines = {r["engine"] for r in data["results"] if r["check"] == "parity"}
    assert {"prefill", "decode_full"} <= engines and data["passed"]


def assert_logits_and_greedy_match_hf(bundle: Path, model: Path) -> None:
    """Prefill, then one decode pass over a forced continuation (logits), then greedy generation."""
    import torch

    from adaptive_export.exporter.check import teacher_forced_logits
    from adaptive_export.loading.model import load_model
    from adaptive_export.runtimes import Generator

    hf = load_model(str(model))
    generator = Generator(bundle)
    rng = np.random.default_rng(0)
    eos = sorted(generator.codec.eos_ids)
    for prompt in PROMPTS:
        ids = hf.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        continuation = [int(t) for t in rng.integers(3, hf.spec.vocab_size, size=NEW_TOKENS)]
        ours = teacher_forced_logits(generator, ids, continuation)
        with torch.no_grad():
            theirs = hf.hf_model(torch.tensor([ids + continuation[:-1]])).logits[0].numpy()[len(ids) - 1 :]
            out = hf.hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=hf.tokenizer.pad_token_id,
            )
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours[0], theirs[0], atol=1e-4, rtol=1e-4)  # prefill
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)  # decode
        tokens = generator.generate(ids, mode="ar", max_new_tokens=NEW_TOKENS, raw=True).tokens
        assert tokens == out[0, len(ids) :].tolist(), prompt


def assert_family_parity(model: Path, flavour: str, tmp_path: Path) -> Path:
    """Build `model` in `flavour`, then every parity assertion above; returns the bundle."""
    bundle = build(model, tmp_path / f"bundle-{flavour}", flavour)
    assert_logits_and_greedy_match_hf(bundle, model)
    assert_check_passes(bundle, model, tmp_path)
    return bundle


def build_refused(model: Path, tmp_path: Path, flavour: str, capsys: Any, *words: str) -> str:
    """`build` exits 2 with one line naming `words`, and leaves no bundle."""
    out = tmp_path / f"refused-{flavour}"
    argv = ["build", str(model), "-o", str(out), "--max-len", str(MAX_LEN), "--onnx-flavour", flavour]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and ". Fix: " in lines[-1], lines
    for word in words:
        assert word in lines[-1], lines[-1]
    assert not out.exists()
    return lines[-1]
