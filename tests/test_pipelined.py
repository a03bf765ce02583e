"""Predictive pipelined decoding (`--mode pipelined`) is exact: greedy tokens equal plain
decoding's (up to float ties), sampling with a seed draws plain decoding's tokens, and the arena
ends as plain decoding leaves it, through wrong guesses (a random model's exit rarely agrees) and
right ones (a model whose top layers change nothing, so every guess is the final token)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.commands.cli import main
from adaptive_export.runtimes import Generator, SamplingParams
from adaptive_export.runtimes.errors import UsageError
from tests.conftest import build_tiny, make_tiny_model
from tests.test_speculative import PROMPTS, assert_same_or_tie

NEW_TOKENS = 40


def staged_flags(exit_layer: int, flavour: str) -> list[str]:
    """Build flags for the early-exit engines at `exit_layer`: the two pipeline stages."""
    return ["--max-len", "128", "--speculate", f"{exit_layer}:1", "--onnx-flavour", flavour]


def build_staged(model: Path, out: Path, exit_layer: int, flavour: str) -> Path:
    """A bundle with the early-exit engines at `exit_layer`: the two pipeline stages."""
    assert main(["build", str(model), "-o", str(out), *staged_flags(exit_layer, flavour)]) == 0
    return out


@pytest.fixture(scope="module", params=["ort", "portable"])
def staged_bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 6-layer model, stages at layer 3, in both ONNX flavours."""
    return build_tiny(tmp_path_factory, *staged_flags(3, request.param))


@pytest.fixture(scope="module")
def agreeing_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 4 and 5 write nothing to the residual stream (attention and MLP outputs zeroed, their
    KV still written), so the exit at 4 sees the final hidden state: every guess is right."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("pipelined-agreeing")
    path = make_tiny_model(root / "model", "gqa_untied", layers=6, seed=5)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers[4:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return build_staged(path, root / "bundle", 4, "ort")


def assert_arena_is_plain(generator: Generator, ids: list[int], tokens: list[int]) -> None:
    """The arena's valid rows are those a prefill of the same tokens writes."""
    length = generator.arena.length
    after = generator.arena.valid_rows(length)
    generator.arena.reset()
    generator.backend.run("prefill", np.asarray([(ids + tokens)[:length]]), generator.arena, 0)
    np.testing.assert_allclose(after, generator.arena.valid_rows(length), atol=2e-5)


def test_greedy_pipelined_equals_plain_decoding(staged_bundle: Path) -> None:
    generator = Generator(staged_bundle)
    tokens = matches = 0
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt, raw=True)
        ar = generator.generate(ids, mode="ar", max_new_tokens=NEW_TOKENS).tokens
        result = generator.generate(ids, max_new_tokens=NEW_TOKENS, mode="pipelined")
        assert result.stats.mode == "pipelined"
        stats = result.stats.speculation
        assert stats["tokens"] == len(result.tokens) - 1 and stats["exit_layer"] == 3 and stats["candidates"] == 1
        tokens, matches = tokens + stats["tokens"], matches + stats["matches"]
        assert_same_or_tie(generator, ids, ar, result.tokens)
    assert matches < tokens  # the wrong-guess path ran: a random model's layer-3 exit often disagrees


def test_arena_after_pipelined_decoding_equals_plain(staged_bundle: Path) -> None:
    """Rows a wrong guess wrote at s+1 are written again for the true token: nothing stale stays."""
    generator = Generator(staged_bundle)
    ids = generator.codec.encode("Write a short poem about the sea", raw=True)
    result = generator.generate(ids, max_new_tokens=30, mode="pipelined")
    assert result.stats.speculation["matches"] < result.stats.speculation["tokens"]
    assert_arena_is_plain(generator, ids, result.tokens)


def test_sampling_draws_plain_decodings_tokens(staged_bundle: Path) -> None:
    """The token is drawn from stage 2's final distribution with the same generator, one draw per
    token, as plain decoding draws it: a fixed seed gives the same tokens."""
    generator = Generator(staged_bundle)
    for prompt in PROMPTS[:5]:
        ids = generator.codec.encode(prompt, raw=True)
        for seed in (0, 1, 2):
            params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
            ar = generator.generate(ids, mode="ar", max_new_tokens=20, sampling=params).tokens
            pipelined = generator.generate(ids, max_new_tokens=20, sampling=params, mode="pipelined").tokens
            assert pipelined == ar, (prompt, seed)


def test_right_guesses_keep_stage_one(agreeing_bundle: Path) -> None:
    """Every guess matches, so every stage 1 after the first ran beside stage 2 and its rows were
    kept: the tokens and the arena are still plain decoding's."""
    generator = Generator(agreeing_bundle)
    for prompt in PROMPTS[:4]:
        ids = generator.codec.encode(prompt, raw=True)
        ar = generator.generate(ids, mode="ar", max_new_tokens=NEW_TOKENS).tokens
        result = generator.generate(ids, max_new_tokens=NEW_TOKENS, mode="pipelined")
        stats = result.stats.speculation
        assert stats["matches"] == stats["tokens"] > 0 and stats["match_rate"] == 1.0, stats
        assert_same_or_tie(generator, ids, ar, result.tokens)
        assert_arena_is_plain(generator, ids, result.tokens)


def test_cli_pipelined_reports_its_guesses(staged_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(staged_bundle), "-p", "The quick brown fox", "--raw", "--max-new-tokens", "12", "--json"]
    assert main([*args, "--mode", "pipelined", "--threads", "2"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["mode"] == "pipelined" and stats["tokens"] == 11 and stats["stage_threads"] == 1
    assert 0.0 <= stats["match_rate"] <= 1.0
    assert main(args) == 0  # the default, auto, never pipelines
    assert json.loads(capsys.readouterr().out)["stats"]["mode"] != "pipelined"


def test_cli_refuses_a_bundle_without_stages(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(tiny_bundle), "-p", "hello", "--raw", "--max-new-tokens", "4", "--mode", "pipelined"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "has no pipeline stages" in err and "Fix: rebuild it with --speculate" in err


def test_pipelined_takes_no_other_draft_source(staged_bundle: Path) -> None:
    generator = Generator(staged_bundle)
    with pytest.raises(UsageError, match="does not apply to --mode pipelined"):
        generator.generate("The quick brown fox", raw=True, max_new_tokens=4, mode="pipelined", draft="precision")


def test_stage_sessions_have_their_own_thread_pools(staged_bundle: Path) -> None:
    """The stages' backend shares the weights and the run guard but not a session: the plain
    engines keep the run's threads, the stage engines get their own sessions with fewer."""
    generator = Generator(staged_bundle, threads=2)
    backend = generator.backend.inner
    stages = generator.backend.with_threads(1).inner
    assert stages is generator.backend.with_threads(1).inner and backend.with_threads(2) is backend
    assert stages.weights is backend.weights and stages.guard is backend.guard
    draft = generator.bundle.config("full").engines["draft"]
    assert stages.session(draft) is not backend.session(draft)
    assert stages.session(draft).get_session_options().intra_op_num_threads == 1
    assert backend.session(draft).get_session_options().intra_op_num_threads == 2
