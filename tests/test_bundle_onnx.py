"""Tiny-model bundles on ONNX Runtime: every graph against PyTorch, greedy output against HF."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.exporter.check import engine_parity, greedy_check
from adaptive_export.loading.artifacts import load_parts
from adaptive_export.runtimes import Generator, SamplingParams, load_bundle
from adaptive_export.runtimes.backends import make_backend
from tests.conftest import TINY_VARIANTS, make_tiny_model

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.", "The quick brown fox"]


# the session's tiny bundles (conftest) are this variant built from the same model (max_len 128, not 96):
# reusing them saves a model, a fused build and a portable one (about 40 s of CPU on 2 cores)
SESSION_BUNDLES = {("gqa_untied", "ort"): "tiny_bundle", ("gqa_untied", "portable"): "tiny_portable_bundle"}


@dataclass(frozen=True)
class Built:
    """A variant's bundle and the HF model directory it was built from."""

    bundle: Path
    model: Path


@pytest.fixture(
    scope="module",
    params=[(v, f) for v in sorted(TINY_VARIANTS) for f in ("ort", "portable")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def variant_bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Every tiny architecture variant in both ONNX flavours: fused ONNX Runtime ops and portable."""
    from adaptive_export.commands.cli import main

    variant, flavour = request.param
    if (variant, flavour) in SESSION_BUNDLES:
        return Built(
            request.getfixturevalue(SESSION_BUNDLES[variant, flavour]), request.getfixturevalue("tiny_model_dir")
        )
    root = tmp_path_factory.mktemp(variant)
    model = make_tiny_model(root / "model", variant)
    assert main(["build", str(model), "-o", str(root / "bundle"), "--max-len", "96", "--onnx-flavour", flavour]) == 0
    return Built(root / "bundle", model)


def test_every_graph_matches_pytorch(variant_bundle: Built) -> None:
    bundle = load_bundle(variant_bundle.bundle)
    _, parts = load_parts(bundle, str(variant_bundle.model))
    backend = make_backend(bundle, "onnx")
    assert set(bundle.manifest.graphs) == {"prefill", "decode_full"}
    for graph in bundle.manifest.graphs:
        result = engine_parity(bundle, backend, parts, graph)
        assert result.passed, result.detail
        assert result.max_abs < 1e-4


def test_greedy_equals_transformers(variant_bundle: Built) -> None:
    bundle = load_bundle(variant_bundle.bundle)
    _, parts = load_parts(bundle, str(variant_bundle.model))
    generator = Generator(bundle)
    for prompt in PROMPTS:
        result = greedy_check(generator, parts, bundle.config("full"), prompt, 24)
        assert result.passed and "identical" in result.detail, result.detail


def test_weights_stored_once(variant_bundle: Built) -> None:
    manifest = json.loads((variant_bundle.bundle / "manifest.json").read_text())
    params = {}
    from safetensors.numpy import load_file

    params = load_file(str(variant_bundle.model / "model.safetensors"))
    unique = {v.tobytes() for v in params.values()}
    param_bytes = sum(len(b) for b in unique)
    weights = manifest["backends"]["onnx"]["weight_bytes"]
    assert weights <= param_bytes * 1.02 + 4096, (weights, param_bytes)
    onnx_files = [p for p in manifest["files"] if p.endswith(".onnx")]
    engines = manifest["backends"]["onnx"]["graphs"]
    fused = manifest["backends"]["onnx"]["flavour"] == "ort"
    # fused: prefill is the full model's decode graph (one engine, one session); portable: two
    assert len(onnx_files) == (1 if fused else 2)
    assert (engines["prefill"]["file"] == engines["decode_full"]["file"]) == fused
    import onnx

    for path in onnx_files:
        model = onnx.load(str(variant_bundle.bundle / path), load_external_data=False)
        inline = [
            i.name
            for i in model.graph.initializer
            if i.data_location != onnx.TensorProto.EXTERNAL and len(i.raw_data) >= 1024
        ]
        assert not inline, f"{path} stores weights inline: {inline}"
        ops = {(n.domain or "ai.onnx", n.op_type) for n in model.graph.node}
        fused_ops = {("com.microsoft", "GroupQueryAttention"), ("com.microsoft", "SkipSimplifiedLayerNormalization")}
        assert fused_ops <= ops if fused else not any(domain == "com.microsoft" for domain, _ in ops), ops


def test_streaming_equals_text_and_stop_strings(tiny_bundle: Path) -> None:
    generator = Generator(tiny_bundle)
    full = generator.generate("The quick brown fox", max_new_tokens=20, raw=True)
    chunks: list[str] = []
    again = generator.generate("The quick brown fox", max_new_tokens=20, raw=True, on_text=chunks.append)
    assert "".join(chunks) == again.text == full.text
    assert again.tokens == full.tokens
    if len(full.text) > 4:
        stop = full.text[2:4]
        cut = generator.generate("The quick brown fox", max_new_tokens=20, raw=True, stop=[stop])
        assert stop not in cut.text and full.text.startswith(cut.text)
        assert cut.stats.stop_reason == "stop"


@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_stream_is_incremental(tiny_bundle: Path, mode: str) -> None:
    """stream() yields text while decoding: the first piece arrives after a few engine calls,
    not after all of them, and the pieces are generate()'s text (one loop serves both)."""
    generator = Generator(tiny_bundle)
    kwargs = dict(
        max_new_tokens=24,
        raw=True,
        mode=mode,
        draft="prompt_lookup" if mode == "spec" else None,
        sampling=SamplingParams(temperature=1.0, seed=3),
    )  # sampled: the random tiny model rarely stops early
    full = generator.generate("The quick brown fox", **kwargs)
    calls = []
    run = generator.backend.run
    generator.backend.run = lambda *args: (calls.append(args[0]), run(*args))[1]  # count engine calls
    pieces = generator.stream("The quick brown fox", **kwargs)
    assert calls == []  # nothing runs before the caller iterates
    first = next(pieces)
    at_first = len(calls)
    rest = list(pieces)
    assert first + "".join(rest) == full.text and generator.last_result.tokens == full.tokens
    assert len(full.tokens) > 8, "the test needs a longer generation"
    assert at_first < len(calls) and at_first <= len(full.tokens) // 2, (at_first, len(calls))


def test_sampling_is_seeded_and_valid(tiny_bundle: Path) -> None:
    generator = Generator(tiny_bundle)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7)
    first = generator.generate("The sea", max_new_tokens=12, sampling=params, raw=True)
    second = generator.generate("The sea", max_new_tokens=12, sampling=params, raw=True)
    other = generator.generate("The sea", max_new_tokens=12, sampling=SamplingParams(temperature=0.9, seed=8), raw=True)
    assert first.tokens == second.tokens
    assert len(first.tokens) == 12 or first.stats.stop_reason == "eos"
    assert first.tokens != other.tokens or len(first.tokens) < 3


def test_prompt_too_long_is_a_clear_error(tiny_bundle: Path) -> None:
    from adaptive_export.runtimes.errors import UsageError

    generator = Generator(tiny_bundle)
    with pytest.raises(UsageError, match="exceeds the bundle's max_len 128"):
        generator.generate(list(range(100)), max_new_tokens=40)


def test_arena_rows_are_written_in_place(tiny_bundle: Path) -> None:
    """After generation the arena holds exactly the rows a fresh prefill of all tokens writes."""
    generator = Generator(tiny_bundle)
    result = generator.generate("The quick brown fox", max_new_tokens=6, raw=True)
    length = generator.arena.length
    after_decode = generator.arena.valid_rows(length)
    ids = (result.prompt_ids + result.tokens)[:length]
    generator.arena.reset()
    generator.backend.run("prefill", np.asarray([ids]), generator.arena, 0)
    np.testing.assert_allclose(after_decode, generator.arena.valid_rows(length), atol=1e-5)
