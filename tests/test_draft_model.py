"""A smaller bundle drafting for a larger one (`run --draft-bundle`, runtimes/draft_model.py):
the target's tokens under greedy decoding, its distribution under sampling, a draft arena that
holds the rows plain prefill would write, and one line for a draft bundle that cannot pair."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.commands.cli import main
from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.draft_model import DRAFT_MODEL_K, DRAFT_STOP_BELOW, DRAFT_WINDOW
from adaptive_export.runtimes.sampling import SamplingParams, make_sampler
from tests.conftest import assert_sampling_matches_plain
from tests.test_bad_bundles import expect_usage_error
from tests.test_hardening import resign
from tests.test_speculative import PROMPTS, assert_same_or_tie


@pytest.fixture(scope="module")
def draft_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny target's model at int4 (same tokenizer): a draft that agrees often, not always
    (its first two layers alone agree never: random layers are no refinement of each other)."""
    out = tmp_path_factory.mktemp("draft-bundle") / "bundle"
    argv = ["build", str(tiny_model_dir), "-o", str(out), "--max-len", "128", "--prompt-rows", "rule"]
    assert main([*argv, "--quantize", "int4"]) == 0
    return out


@pytest.fixture(scope="module")
def paired(tiny_bundle: Path, draft_bundle: Path) -> Generator:
    return Generator(tiny_bundle, draft_bundle=draft_bundle)


def test_draft_model_rounds_give_the_tokens_of_ar(paired: Generator, tiny_bundle: Path) -> None:
    """Greedy rounds emit ar's tokens beside the draft bundle, which are two-row plain decoding's
    without it; the rounds both accept and reject drafts, so the catch-up after each is exercised."""
    alone = Generator(tiny_bundle, decode_rows=2)
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids = paired.codec.encode(prompt, raw=True)
        ar = paired.generate(ids, mode="ar", max_new_tokens=40)
        result = paired.generate(ids, max_new_tokens=40)
        stats, spec = result.stats, result.stats.speculation
        assert stats.mode == "spec" and spec["draft_source"] == "draft_model", spec
        assert ar.stats.decode_policy.rows == stats.decode_policy.rows == 2
        assert ar.tokens == alone.generate(ids, mode="ar", max_new_tokens=40).tokens
        assert_same_or_tie(paired, ids, ar.tokens, result.tokens)
        if stats.stop_reason == "length":  # every round emits its accepted drafts plus the target's token
            assert spec["accepted"] + spec["rounds"] == stats.new_tokens - 1, spec
        accepted, drafted = accepted + spec["accepted"], drafted + spec["drafted"]
    assert 0 < accepted < drafted, (accepted, drafted)


def test_the_draft_arena_holds_the_rows_prefill_writes(paired: Generator) -> None:
    """After rounds of catch-ups, drafts and rejections, the draft's arena holds for the tokens it
    records the rows one prefill over them writes: no stale row of a rejected draft is read."""
    ids = paired.codec.encode("Write a short poem about the sea", raw=True)
    paired.generate(ids, max_new_tokens=30)
    draft = paired.decoding.draft_model
    assert draft is not None and draft.arena.length == len(draft.written) > len(ids)
    after = draft.arena.valid_rows(draft.arena.length)
    draft.arena.reset()
    draft.backend.run("prefill", np.asarray([draft.written]), draft.arena, 0)
    np.testing.assert_allclose(after, draft.arena.valid_rows(len(draft.written)), atol=2e-5)


def test_a_doubting_draft_ends_its_round_and_keeps_the_tokens_of_ar(paired: Generator) -> None:
    """With the confidence stop (`stop_below`) the draft ends a round after a draft whose own top-1
    probability is below it: at 1.0 after its first draft, at 0 after all k; the tokens stay ar's."""
    draft = paired.decoding.draft_model
    assert draft is not None
    ids = paired.codec.encode("Write a short poem about the sea", raw=True)
    ar = paired.generate(ids, mode="ar", max_new_tokens=30).tokens
    greedy = make_sampler(SamplingParams())
    try:
        drafted = {}
        for stop in (0.0, 1.0):
            draft.stop_below = stop
            drafted[stop] = len(draft.draft(ids, 4, greedy).tokens)
        result = paired.generate(ids, max_new_tokens=30, draft_len=4)  # still at 1.0: a round of one draft
        assert_same_or_tie(paired, ids, ar, result.tokens)
    finally:
        draft.stop_below = DRAFT_STOP_BELOW
    assert drafted == {0.0: 4, 1.0: 1}, drafted


def test_a_draft_window_reads_the_prompt_from_its_last_tokens(paired: Generator) -> None:
    """With a window shorter than the prompt the draft prefills only the prompt's last tokens and
    keeps them across the request's rounds; the tokens are still ar's."""
    draft = paired.decoding.draft_model
    assert draft is not None
    ids = paired.codec.encode("Write a short poem about the sea and the sky and the stars", raw=True)
    draft.window, draft.skipped, draft.written = 4, [], []  # as a fresh draft holds nothing
    try:
        ar = paired.generate(ids, mode="ar", max_new_tokens=30)
        result = paired.generate(ids, max_new_tokens=30)
    finally:
        draft.window = DRAFT_WINDOW
    assert_same_or_tie(paired, ids, ar.tokens, result.tokens)
    assert result.stats.speculation["drafted"] > 0
    full = ids + result.tokens  # the window starts 4 tokens before the context of the first drafting round
    assert len(ids) - 4 <= len(draft.skipped) < len(ids), (len(ids), len(draft.skipped))
    tail = ids[len(draft.skipped) :]  # the prompt's last tokens head the window (its last drafts may be rejected)
    assert draft.skipped == full[: len(draft.skipped)] and draft.written[: len(tail)] == tail


def test_draft_model_sampling_matches_plain_sampling(paired: Generator) -> None:
    assert_sampling_matches_plain(paired, "The quick brown fox", 4, 700, mode="spec", draft_len=2)


def test_an_edit_prompt_keeps_its_own_drafts_beside_a_draft_bundle(paired: Generator, tiny_bundle: Path) -> None:
    """Auto drafts with the draft bundle on chat prompts only: an edit prompt (code an answer copies)
    decodes as it would without it, on two rows, and its tokens are still ar's."""
    code = "The quick brown fox jumps over the lazy dog. " * 2  # the tiny tokenizer's own text: few tokens
    prompt = f"Fix this.\n```\n{code}\n```"
    ar = paired.generate(prompt, mode="ar", max_new_tokens=30, raw=True)
    result = paired.generate(prompt, max_new_tokens=30, raw=True)
    assert result.stats.decode_policy.kind == "edit" and result.stats.decode_policy.rows == 2
    assert result.stats.speculation["draft_source"] == "prompt_lookup", result.stats.speculation
    assert_same_or_tie(paired, result.prompt_ids, ar.tokens, result.tokens)
    alone = Generator(tiny_bundle, decode_rows=2).generate(prompt, max_new_tokens=30, raw=True)
    assert result.tokens == alone.tokens


def test_run_reports_the_draft_model(tiny_bundle: Path, draft_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", str(tiny_bundle), "-p", "The quick brown fox", "--raw", "--max-new-tokens", "12", "--json"]
    assert main([*argv, "--draft-bundle", str(draft_bundle)]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["mode"] == "spec" and stats["draft_source"] == "draft_model", stats
    assert stats["draft_len"] == DRAFT_MODEL_K, stats
    assert stats["decode_rows"] == 2 and stats["policy"] == "draft_model", stats


def swapped_token_names(bundle: Path, tmp_path: Path) -> Path:
    """A copy of the bundle whose tokenizer gives two tokens each other's ids, re-signed."""
    copy = tmp_path / "swapped"
    shutil.copytree(bundle, copy)
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = "a", "b"
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    resign(copy)
    return copy


def test_a_draft_bundle_that_names_tokens_otherwise_is_refused(
    tiny_bundle: Path, draft_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = swapped_token_names(draft_bundle, tmp_path)
    argv = ["run", str(tiny_bundle), "-p", "The quick brown fox", "--raw", "--draft-bundle", str(other)]
    expect_usage_error(argv, capsys, "tokenizer names its tokens differently")


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [(["--draft", "prompt_lookup"], "both name a draft source"), (["--decode-rows", "1"], "drop --decode-rows 1")],
)
def test_draft_bundle_refuses_what_contradicts_it(
    tiny_bundle: Path, draft_bundle: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    argv = ["run", str(tiny_bundle), "-p", "The quick brown fox", "--raw", "--draft-bundle", str(draft_bundle)]
    expect_usage_error([*argv, *extra], capsys, fragment)
