"""Exact speculation on accuracy-4 bundles (issue #24 item 1).

ONNX Runtime computes the row of a one-row pass differently from the same row of a wider pass,
and MatMulNBits at accuracy level 4 turns that into different tokens; its passes of two rows and
more compute every row alike. A bundle that decodes two rows at least (`min_decode_rows`, or
`Generator(decode_rows=2)`: every plain step carries one guess, runtimes/speculative.py) therefore
gives the same tokens in every mode, and `build --speculate auto` measures that and decides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_export.calibration.verify_exactness import measure_verify_exactness
from adaptive_export.commands.cli import main
from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.drafting.prompt_lookup import GROWING_MOST, GrowingLookup, lookup_match
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.gate import DraftingGate
from adaptive_export.runtimes.limits import check_decode_rows
from adaptive_export.runtimes.manifest_speculation import Speculation, VerifyExactness
from tests.conftest import assert_sampling_matches_plain, make_tiny_model

# hidden 256 x 4 layers: a verify pass tips an int8 rounding against T=1 steps (tests/test_verify_exactness.py)
WIDE = {"layers": 4, "hidden": 256, "seed": 3}
PROMPTS = [
    "the sea the sea the sea the sea the sea",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is the capital of France?",
    "Write a short poem about the sea and the sky",
    "Static graphs make edge compilers happy",
    "Paris is the capital of France. Paris is",
]
TWO_ROWS = {"max_logit_diff": 0.0, "logit_scale": 30.0, "top1_flips": 0, "worst_flip_margin": 0.0, "exact": True}


@pytest.fixture(scope="module")
def accuracy4_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two_rows")
    model = make_tiny_model(root / "model", "gqa_untied", **WIDE)
    flags = ["--max-len", "128", "--quantize", "int4", "--quant-accuracy", "4"]
    assert main(["build", str(model), "-o", str(root / "bundle"), *flags]) == 0
    return root / "bundle"


@pytest.fixture(scope="module")
def two_rows_measured(accuracy4_bundle: Path) -> VerifyExactness:
    """The property the design rests on, measured on this machine's kernels: rows of two-row passes
    are bit for bit the rows of one T=9 pass."""
    return measure_verify_exactness(accuracy4_bundle, max_k=8, prompts=4, plain_rows=2)


def test_two_row_passes_compute_the_rows_of_a_verify_pass(two_rows_measured: VerifyExactness) -> None:
    assert two_rows_measured.plain_rows == 2 and two_rows_measured.logit_scale > 0
    assert two_rows_measured.max_logit_diff == 0.0, two_rows_measured
    assert two_rows_measured.exact and two_rows_measured.top1_flips == 0


def test_every_mode_gives_the_same_tokens_on_two_rows(accuracy4_bundle: Path) -> None:
    """Greedy ar (floor rounds), spec with prompt lookup at k = 1 and 4, and auto: identical tokens,
    not merely up to ties, since every kept row comes from the same kernels."""
    generator = Generator(accuracy4_bundle, decode_rows=2)
    floors = 0
    for prompt in PROMPTS:
        plain = generator.generate(prompt, raw=True, max_new_tokens=24, mode="ar")
        assert plain.stats.mode == "ar"
        floors += plain.stats.speculation["floor_rounds"]
        for k in (1, 4):
            spec = generator.generate(prompt, raw=True, max_new_tokens=24, mode="spec", draft_len=k)
            assert spec.tokens == plain.tokens, (prompt, k)
        auto = generator.generate(prompt, raw=True, max_new_tokens=24, mode="auto")
        assert auto.tokens == plain.tokens, prompt
        assert not auto.stats.speculation["gated"] and auto.stats.speculation["draft_len"] == GROWING_MOST
        gated = generator.generate(prompt, raw=True, max_new_tokens=24, mode="auto", draft_len=4)
        assert gated.tokens == plain.tokens and gated.stats.speculation["gated"], prompt
    assert floors > 0  # plain decoding ran floor rounds, not one-row steps


def grown(context: list[int], then: list[int]) -> list[int]:
    """What a fresh GrowingLookup proposes after `context`, then after `then` is emitted."""
    lookup = GrowingLookup(None, None, None, GROWING_MOST)  # type: ignore[arg-type]  # propose reads only context
    lookup.propose(0, context, GROWING_MOST, 0, None, None)  # type: ignore[arg-type]
    return lookup.propose(0, context + then, GROWING_MOST, 0, None, None).tokens  # type: ignore[arg-type]


def test_growing_lookup_drafts_more_only_after_all_were_accepted() -> None:
    """One draft first; after it is accepted, two from a 4-token match; after a rejection, one again;
    never more than one from a match shorter than SURE_NGRAM tokens."""
    text = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    lookup = GrowingLookup(None, None, None, GROWING_MOST)  # type: ignore[arg-type]
    assert lookup.propose(0, text, GROWING_MOST, 0, None, None).tokens == [4]  # type: ignore[arg-type]
    assert grown(text, [4, 5]) == [6, 7]  # [4] was accepted: two, from the 4-gram 2 3 4 5
    assert grown(text, [9, 5]) == [6]  # [4] was rejected: one again
    assert grown([4, 5, 9, 1, 4], [5]) == [9]  # [5] was accepted, but the match is 2 tokens: one
    assert lookup_match([1, 2, 3, 1, 2], 3) == ([3, 1, 2], 2)


def test_a_one_token_budget_still_decodes_two_rows(accuracy4_bundle: Path) -> None:
    """The last token of a budget gets a floor guess too: with the prompt and the budget filling
    max_len, that guess's row is the arena's last, and the run ends at its length."""
    generator = Generator(accuracy4_bundle, decode_rows=2)
    filled = 0
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt, raw=True)
        longest = generator.bundle.max_len - len(ids)
        full = generator.generate(ids, max_new_tokens=longest, mode="ar")
        if full.stats.stop_reason == "length":
            assert len(full.tokens) == longest
            filled += 1
        assert generator.generate(ids, max_new_tokens=2, mode="ar").tokens == full.tokens[:2]
    assert filled >= 1  # some prompt ran to the end of the arena rather than to EOS


def test_sampling_on_two_rows_keeps_the_distribution(accuracy4_bundle: Path) -> None:
    """A floor guess is judged by the rejection rule, so sampled tokens follow the model's own
    distribution: plain (floor rounds) against speculation (lookup, k = 3), 2nd and 3rd tokens."""
    generator = Generator(accuracy4_bundle, decode_rows=2)
    assert_sampling_matches_plain(generator, "the sea the sea the", 4, 500, mode="spec", draft_len=3)


def test_calibration_records_both_measurements(
    accuracy4_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`build --speculate auto` on an accuracy-4 bundle: T=1 steps measured inexact, two-row steps
    exact; where it chose two rows, auto speculates and equals ar; elsewhere auto decodes plainly."""
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    model = make_tiny_model(tmp_path / "model", "gqa_untied", **WIDE)
    out = tmp_path / "bundle"
    flags = ["--max-len", "128", "--quantize", "int4", "--quant-accuracy", "4", "--speculate", "auto"]
    assert main(["build", str(model), "-o", str(out), *flags, "--calib", str(calib)]) == 0
    speculation = Speculation.from_json(json.loads((out / "manifest.json").read_text())["speculation"])
    assert speculation is not None and speculation.verify_exactness is not None
    assert speculation.multi_row_exactness is not None and speculation.multi_row_exactness.plain_rows == 2
    capsys.readouterr()
    runs = {}
    for mode in ("auto", "ar"):
        flags = ["--raw", "--max-new-tokens", "24", "--json", "--mode", mode]
        assert main(["run", str(out), "-p", PROMPTS[0], *flags]) == 0
        runs[mode] = json.loads(capsys.readouterr().out)
    assert runs["auto"]["tokens"] == runs["ar"]["tokens"]
    if speculation.min_decode_rows == 2:
        assert speculation.multi_row_exactness.exact and not speculation.verify_exactness.exact
        assert runs["auto"]["stats"]["mode"] == "spec" and runs["ar"]["stats"]["floor_rounds"] > 0
    elif not speculation.verify_exactness.exact:
        assert runs["auto"]["stats"]["mode"] == "ar"


def test_manifest_round_trip_and_refusals() -> None:
    obj = {"source": None, "auto_enabled": False, "multi_row_exactness": {**TWO_ROWS, "plain_rows": 2}}
    two_rows = Speculation.from_json({**obj, "min_decode_rows": 2})
    assert two_rows is not None and two_rows.min_decode_rows == 2
    assert Speculation.from_json(json.loads(json.dumps(two_rows.to_json()))) == two_rows
    one_row = Speculation.from_json(obj)
    assert one_row is not None and one_row.min_decode_rows == 1 and "min_decode_rows" not in one_row.to_json()
    with pytest.raises(UsageError, match="without an exact multi_row_exactness"):
        Speculation.from_json({"min_decode_rows": 2})
    with pytest.raises(UsageError, match="min_decode_rows must be 1 or 2"):
        Speculation.from_json({**obj, "min_decode_rows": 3})
    for bad in (0, 3, True, "2"):
        with pytest.raises(UsageError, match="decode rows"):
            check_decode_rows(bad)


def test_the_gate_prices_plain_rounds_by_the_tokens_they_emit() -> None:
    """A floor round costs a T=2 pass and may emit two tokens: drafting pays only against that."""
    gate = DraftingGate(round_passes=2.0, plain_passes=1.3)
    assert gate.would_pay(2.0) and not gate.would_pay(1.5)  # 2 / 2.0 >= 1 / 1.3, 1.5 / 2.0 < 1 / 1.3
    for emitted in (2, 2, 2, 2):  # plain rounds: every floor guess accepted
        gate.record_round(False, emitted, 0.010)
    assert gate.timed_plain_ms() is not None and gate.timed_plain_ms() < 6.0  # ms per token, not per round
    gate.record_round(True, 3, 0.020)
    gate.record_round(True, 3, 0.020)
    assert not gate.would_pay(3.0)  # 20 ms / 3 tokens is slower than 10 ms / 2 tokens


def test_run_decode_rows_from_the_command_line(accuracy4_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`run --decode-rows 2` makes any accuracy-4 bundle decode two rows at least: auto and spec then
    give ar's tokens; without it the bundle's own setting (1 here) applies."""
    capsys.readouterr()
    runs = {}
    for mode in ("ar", "auto", "spec"):
        flags = ["--raw", "--max-new-tokens", "20", "--json", "--mode", mode, "--decode-rows", "2"]
        assert main(["run", str(accuracy4_bundle), "-p", PROMPTS[1], *flags]) == 0
        runs[mode] = json.loads(capsys.readouterr().out)
    assert runs["ar"]["tokens"] == runs["auto"]["tokens"] == runs["spec"]["tokens"]
    assert runs["ar"]["stats"]["mode"] == "ar" and runs["ar"]["stats"]["floor_rounds"] > 0
    assert main(["run", str(accuracy4_bundle), "-p", PROMPTS[1], "--raw", "--max-new-tokens", "8", "--json"]) == 0
    assert "floor_rounds" not in json.loads(capsys.readouterr().out)["stats"]  # T=1 steps: auto decoded plainly
    assert main(["run", str(accuracy4_bundle), "-p", "x", "--decode-rows", "3"]) == 2
