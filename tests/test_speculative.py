"""Self-speculative decoding is lossless: greedy output equals plain decoding (up to float
ties), sampling keeps the full model's distribution, and the arena ends up as plain
decoding would leave it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.commands.cli import main
from adaptive_export.runtimes import Generator, SamplingParams
from adaptive_export.runtimes.acceptance import judge
from adaptive_export.runtimes.drafting import lookup_ngram
from adaptive_export.runtimes.sampling import Sampler
from tests.conftest import assert_sampling_matches_plain, build_tiny

TIE_MARGIN = 1e-3
PROMPTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "Write a short poem about the sea and the sky",
    "Static graphs make edge compilers happy",
    "the sea the sea the sea",
    "Paris is the capital of France. Paris is",
    "dog lazy the over jumps",
    "What is the sea?",
    "short poem",
    "France France capital",
]


@pytest.fixture(scope="module")
def spec_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    flags = ["--max-len", "128", "--speculate", "3:3", "--draft-precision", "int8", "--prompt-tokens", "2"]
    return build_tiny(tmp_path_factory, *flags)


def assert_same_or_tie(generator: Generator, prompt_ids: list[int], ar: list[int], spec: list[int]) -> None:
    """Equal, or different only from a position where plain decoding shows a top-1/top-2 tie."""
    if ar == spec:
        return
    at = next(i for i, (a, b) in enumerate(zip(ar, spec)) if a != b)
    generator.arena.reset()
    ids = prompt_ids + ar[:at]
    out = generator.backend.run("prefill", np.asarray([ids]), generator.arena, 0)
    top2 = np.sort(out.logits[0, -1])[-2:]
    assert top2[1] - top2[0] < TIE_MARGIN, f"real mismatch at {at}: margin {top2[1] - top2[0]}"


def test_manifest_has_draft_and_verify_engines(spec_bundle: Path) -> None:
    manifest = json.loads((spec_bundle / "manifest.json").read_text())
    full = next(c for c in manifest["configs"] if c["id"] == "full")
    assert full["engines"] == {
        "decode": "decode_full",
        "draft": "draft_full_e3",
        "verify": "verify_full_e3",
        "precision_draft": "pdraft_full_int8",
        "prompt_tokens": "decode_full",
    }
    assert manifest["graphs"]["decode_full"]["prompt_tokens"] == 2
    assert manifest["speculation"]["prompt_tokens"] == {"draft_len": 2}
    assert "prompt_tokens.safetensors" in manifest["files"]
    assert manifest["graphs"]["pdraft_full_int8"]["precision"] == "int8"
    assert manifest["graphs"]["pdraft_full_int8"]["layers"] == list(range(6))
    assert manifest["graphs"]["draft_full_e3"]["layers"] == [0, 1, 2]
    assert manifest["graphs"]["verify_full_e3"]["layers"] == [3, 4, 5]
    assert manifest["speculation"]["source"] == "early_exit" and manifest["speculation"]["exit_layer"] == 3


@pytest.mark.parametrize(
    "draft,k",
    [
        ("early_exit", 1),
        ("early_exit", 3),
        ("early_exit", 5),
        ("prompt_lookup", 2),
        ("prompt_lookup", 4),
        ("precision", 1),
        ("precision", 4),
        ("prompt_tokens", 1),
        ("prompt_tokens", 2),
    ],
)
def test_greedy_speculation_equals_plain_decoding(spec_bundle: Path, draft: str, k: int) -> None:
    generator = Generator(spec_bundle)
    rounds = 0
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt, raw=True)
        ar = generator.generate(ids, mode="ar", max_new_tokens=40).tokens
        result = generator.generate(ids, max_new_tokens=40, mode="spec", draft=draft, draft_len=k)
        assert result.stats.mode == "spec" and result.stats.speculation["draft_source"] == draft
        spec = result.stats.speculation
        rounds += spec["rounds"]
        assert_same_or_tie(generator, ids, ar, result.tokens)
        if draft in ("prompt_lookup", "precision", "prompt_tokens") and result.stats.stop_reason == "length":
            # every round emits its accepted drafts plus one verifier token (correction or bonus)
            assert spec["accepted"] + spec["rounds"] == result.stats.new_tokens - 1
    assert rounds > 0


def test_precision_draft_is_accepted_and_its_kv_is_overwritten(spec_bundle: Path) -> None:
    """An int8 copy of the same weights agrees with fp32 almost always (a runtime that
    rejected every draft would still be lossless: this catches it), and after the verifier's
    passes the arena holds the verifier's KV, as plain decoding leaves it."""
    generator = Generator(spec_bundle)
    ids = generator.codec.encode("Write a short poem about the sea", raw=True)
    result = generator.generate(ids, max_new_tokens=30, mode="spec", draft="precision", draft_len=4)
    stats = result.stats.speculation
    assert stats["acceptance"] >= 0.8, stats
    length = generator.arena.length
    after = generator.arena.valid_rows(length)
    generator.arena.reset()
    generator.backend.run("prefill", np.asarray([(ids + result.tokens)[:length]]), generator.arena, 0)
    np.testing.assert_allclose(after, generator.arena.valid_rows(length), atol=2e-5)


def test_arena_after_rejections_equals_plain_decoding(spec_bundle: Path) -> None:
    generator = Generator(spec_bundle)
    ids = generator.codec.encode("Write a short poem about the sea", raw=True)
    result = generator.generate(ids, max_new_tokens=30, mode="spec", draft="early_exit", draft_len=4)
    stats = result.stats.speculation
    assert stats["accepted"] < stats["drafted"], "the test needs at least one rejection"
    length = generator.arena.length
    after = generator.arena.valid_rows(length)
    generator.arena.reset()
    generator.backend.run("prefill", np.asarray([(ids + result.tokens)[:length]]), generator.arena, 0)
    np.testing.assert_allclose(after, generator.arena.valid_rows(length), atol=2e-5)


def test_prompt_tokens_runtime_acceptance_matches_calibration(spec_bundle: Path) -> None:
    """The runtime's prompt-token rounds on the held-out calibration prompts are the ones calibration
    simulated in PyTorch (same greedy tokens, same guesses): acceptance within 0.05, and above 0,
    so prompt-token drafts that silently stopped being accepted (or guessed from the wrong rows) fail."""
    from adaptive_export.calibration.drafts.prompt_tokens import PROMPT_TOKEN_CALIB_TOKENS
    from adaptive_export.calibration.exit_adapters import is_held_out
    from adaptive_export.calibration.measure import BUILTIN_CALIB
    from adaptive_export.loading.prompts import read_prompts

    simulated = json.loads((spec_bundle / "calibration.json").read_text())["speculation"]["prompt_tokens"]["per_k"]["2"]
    generator = Generator(spec_bundle)
    rates = []
    for index, prompt in enumerate(read_prompts(str(BUILTIN_CALIB))):
        if not is_held_out(index):
            continue
        result = generator.generate(
            generator.codec.encode(prompt),
            max_new_tokens=PROMPT_TOKEN_CALIB_TOKENS,
            mode="spec",
            draft="prompt_tokens",
            draft_len=2,
        )
        stats = result.stats.speculation
        if stats["drafted"]:
            rates.append(stats["accepted"] / stats["drafted"])
    measured = sum(rates) / len(rates)
    assert measured > 0.05, (measured, simulated)
    assert abs(measured - simulated["acceptance"]) <= 0.05, (measured, simulated)


def test_prompt_lookup_proposals() -> None:
    assert lookup_ngram([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert lookup_ngram([5, 6, 7], 3) == []
    assert lookup_ngram([4, 8, 4], 3) == [8, 4]
    assert lookup_ngram([4, 8, 4], 3, min_ngram=2) == []  # only a 1-gram recurs
    assert lookup_ngram([7, 2, 5, 2, 9, 2], 1) == [9] and lookup_ngram([7, 2, 5, 2, 9, 2], 1, min_ngram=2) == []


def _chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    from scipy.stats import chisquare

    keep = expected > 0
    return float(chisquare(observed[keep], expected[keep] * observed.sum() / expected[keep].sum()).pvalue)


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_rejection_rule_keeps_the_target_distribution(one_hot_draft: bool) -> None:
    rng = np.random.default_rng(0)
    vocab, samples = 6, 30000
    target_logits = rng.standard_normal((1, vocab)) * 1.5
    draft_logits = rng.standard_normal(vocab) * 1.5
    params = SamplingParams(temperature=1.0, seed=0)
    p = np.exp(target_logits[0] - target_logits[0].max())
    p /= p.sum()
    q = np.exp(draft_logits - draft_logits.max())
    q /= q.sum()
    counts = np.zeros(vocab)
    for _ in range(samples):
        draft = int(rng.choice(vocab, p=q))
        verdict = judge([draft], None if one_hot_draft else [draft_logits], target_logits, Sampler(params, rng))
        accepted, correction = verdict.accepted, verdict.token
        counts[draft if accepted else correction] += 1
    assert _chi_square_pvalue(counts, p) > 1e-3


@pytest.mark.parametrize("draft", ["early_exit", "precision", "prompt_tokens"])
def test_spec_sampling_matches_plain_sampling_end_to_end(spec_bundle: Path, draft: str) -> None:
    """Distribution of the 2nd and 3rd generated tokens, AR vs speculation, over seeds."""
    generator = Generator(spec_bundle)
    assert_sampling_matches_plain(generator, "The quick brown fox", 4, 700, mode="spec", draft=draft, draft_len=2)


def test_cli_spec_stats(spec_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "run",
                str(spec_bundle),
                "-p",
                "The quick brown fox",
                "--raw",
                "--mode",
                "spec",
                "--max-new-tokens",
                "12",
                "--json",
            ]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["mode"] == "spec" and stats["draft_source"] == "early_exit"
    assert {"acceptance", "mean_accepted", "draft_ms", "verify_ms", "rounds"} <= set(stats)
    assert 0.0 <= stats["acceptance"] <= 1.0


def draft_session_files(generator: Generator) -> set[str]:
    """The ONNX files whose sessions the generator's backend holds, besides prefill/decode's."""
    backend = generator.backend
    plain = {backend.entry.engine(name).file for name in ("prefill", generator.bundle.config("full").decode)}
    return set(backend._sessions) - plain


def test_spec_mode_creates_the_draft_session_in_the_background(spec_bundle: Path) -> None:
    """`--mode spec` starts creating the draft engine's session before prefill, in a thread;
    the first drafting round waits for it, and the tokens are plain decoding's."""
    generator = Generator(spec_bundle)
    assert not draft_session_files(generator)
    ids = generator.codec.encode(PROMPTS[5], raw=True)
    ar = generator.generate(ids, mode="ar", max_new_tokens=24).tokens
    assert not draft_session_files(generator) and not generator.decoding.warmups  # plain decoding creates none
    spec = generator.generate(ids, max_new_tokens=24, mode="spec", draft="precision", draft_len=2)
    precision = generator.bundle.config("full").engines["precision_draft"]
    warmup = generator.decoding.warmups[precision]
    assert warmup.thread.name == "draft-session-warmup" and not warmup.thread.is_alive()
    assert draft_session_files(generator) == {generator.backend.entry.engine(precision).file}
    assert spec.stats.speculation["drafted"] > 0
    assert_same_or_tie(generator, ids, ar, spec.tokens)
    again = generator.generate(ids, max_new_tokens=24, mode="spec", draft="precision", draft_len=2)
    assert generator.decoding.warmups[precision] is warmup and again.tokens == spec.tokens  # started once per generator


def test_auto_creates_no_draft_session_where_calibration_chose_none(spec_bundle: Path) -> None:
    """This bundle's speculation was forced (auto_enabled false): auto drafts by prompt lookup,
    which has no engine, so no draft session is created at all."""
    generator = Generator(spec_bundle)
    assert not generator.bundle.manifest.speculation.auto_enabled
    for prompt in PROMPTS[:4]:
        ids = generator.codec.encode(prompt, raw=True)
        result = generator.generate(ids, max_new_tokens=24, mode="auto")
        assert result.stats.speculation["draft_source"] == "prompt_lookup"
    assert not draft_session_files(generator) and not generator.decoding.warmups


def full_config(manifest: dict) -> dict:
    return next(c for c in manifest["configs"] if c["id"] == "full")


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: full_config(m)["engines"].pop("verify"), "both or neither of draft and verify"),
        (
            lambda m: full_config(m)["engines"].update(precision_draft=full_config(m)["engines"]["decode"]),
            "no draft precision of its decode graph",
        ),
    ],
)
def test_a_manifest_breaking_early_exit_or_precision_contracts_is_refused(
    spec_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: object, words: str
) -> None:
    """The sources' manifest contracts (runtimes/draft_contracts.py) hold on a hostile bundle whose
    file checksums all match: a draft engine without its verify engine, a precision draft that is
    the decode graph itself."""
    from tests.test_bad_bundles import corrupt_copy, edit_manifest, expect_usage_error

    copy = corrupt_copy(spec_bundle, tmp_path, edit_manifest(edit))  # type: ignore[arg-type]
    expect_usage_error(["run", str(copy), "-p", "hi", "--mode", "ar"], capsys, words)
