"""Fast by default (issue #24): `run` decodes with `--mode auto` unless told otherwise, gives
plain decoding's tokens under greedy decoding, and a `--speculate auto` build measures what a
verify pass of k drafts costs on its own decode engine, which the choice of source and k reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_export.calibration.latency import choose_measured
from adaptive_export.calibration.verify_cost import (
    MAX_VERIFY_DRAFTS,
    VerifyCosts,
    measure_verify_costs,
    priced_with,
    recorded_verify_costs,
)
from adaptive_export.commands.cli import build_parser, main
from adaptive_export.runtimes.speculative import default_verify_cost
from tests.conftest import make_tiny_model

CALIB = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is the capital of France? Paris is the capital of France.",
    "Write a short poem about the sea and the sky",
    "the sea the sea the sea the sea",
]


def run_json(capsys: pytest.CaptureFixture[str], bundle: Path, prompt: str, *flags: str) -> dict:
    assert main(["run", str(bundle), "-p", prompt, "--raw", "--max-new-tokens", "24", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_defaults_to_auto() -> None:
    run = build_parser().parse_args(["run", "bundle", "-p", "hi"])
    assert run.mode == "auto"
    assert build_parser().parse_args(["run", "bundle", "-p", "hi", "--mode", "ar"]).mode == "ar"


@pytest.mark.parametrize("prompt", ["the sea the sea the sea the sea the sea", "What is the capital of France?"])
def test_default_run_is_gated_prompt_lookup_with_plain_tokens(
    tiny_bundle: Path, capsys: pytest.CaptureFixture[str], prompt: str
) -> None:
    """A default build has no calibration: the default run drafts by prompt lookup (no draft
    engine), gated, and emits exactly `--mode ar`'s tokens."""
    default = run_json(capsys, tiny_bundle, prompt)
    plain = run_json(capsys, tiny_bundle, prompt, "--mode", "ar")
    stats = default["stats"]
    assert stats["mode"] == "spec" and stats["draft_source"] == "prompt_lookup" and stats["gated"]
    assert plain["stats"]["mode"] == "ar" and "draft_source" not in plain["stats"]
    assert default["tokens"] == plain["tokens"] and default["text"] == plain["text"]


@pytest.mark.parametrize("accuracy", ["4", "1"])
def test_default_run_drafts_only_where_a_verify_pass_reproduces_plain_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], accuracy: str
) -> None:
    """MatMulNBits at accuracy 4 computes a T=k pass differently from k T=1 passes, so auto decodes
    plainly there (tokens of `--mode ar`, exactly); at accuracy 1 it drafts, gated."""
    model = make_tiny_model(tmp_path / "model", "gqa_untied", layers=2, seed=3)
    out = tmp_path / "bundle"
    build = ["build", str(model), "-o", str(out), "--max-len", "64", "--quantize", "int4", "--quant-accuracy", accuracy]
    assert main(build) == 0
    capsys.readouterr()
    prompt = "the sea the sea the sea the sea the sea"
    default, plain = run_json(capsys, out, prompt), run_json(capsys, out, prompt, "--mode", "ar")
    assert default["stats"]["mode"] == ("ar" if accuracy == "4" else "spec"), default["stats"]
    if accuracy == "4":
        assert default["tokens"] == plain["tokens"]


def test_unmeasured_verify_costs_grow_with_the_draft_length() -> None:
    costs = [default_verify_cost(k) for k in range(1, 9)]
    assert costs == sorted(costs) and len(set(costs)) == len(costs) and costs[0] > 1.0


def test_verify_costs_price_the_choice() -> None:
    """The same acceptance priced with cheap and with dear verify passes: dear passes choose
    shorter drafts (or none); the choice reads the ratios, not the latencies' own T > 1 passes."""
    measured = {
        "prompt_lookup_tokens_per_round": {"1": 1.6, "2": 2.0, "4": 2.6, "8": 3.0},
        "prompt_lookup_hit_rate": {"1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0},
    }
    latencies = {"decode_ms": {t: 10.0 for t in range(1, 10)}}  # flat: a cost model would say T is free

    def costs(per_t: float) -> VerifyCosts:
        return VerifyCosts("decode_full", 64, 3, {t: 10.0 * (1 + per_t * (t - 1)) for t in range(1, 10)})

    cheap = choose_measured(measured, priced_with(latencies, costs(0.02)), None)["best"]
    dear = choose_measured(measured, priced_with(latencies, costs(0.35)), None)
    assert cheap["draft_len"] == 8
    assert dear["best"]["draft_len"] < 8 and dear["best"]["expected_speedup"] < cheap["expected_speedup"]
    assert costs(0.35).costs()["4"] == pytest.approx(2.4)


def test_measure_verify_costs_on_a_built_bundle(tiny_bundle: Path) -> None:
    measured = measure_verify_costs(tiny_bundle, max_k=3, repeats=3)
    assert sorted(measured.pass_ms) == [1, 2, 3, 4] and all(ms > 0 for ms in measured.pass_ms.values())
    assert set(measured.costs()) == {"1", "2", "3"} and measured.engine == "decode_full"
    assert VerifyCosts.from_json(json.loads(json.dumps(measured.to_json()))) == measured


@pytest.fixture(scope="module")
def calibrated_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verifycost")
    model = make_tiny_model(root / "model", "gqa_untied", layers=4, seed=5)
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CALIB))
    out = root / "bundle"
    build = ["build", str(model), "-o", str(out), "--max-len", "128", "--speculate", "auto", "--calib", str(calib)]
    assert main(build) == 0
    assert (out / "manifest.json").exists()
    return out


def test_auto_build_records_verify_costs_and_the_choice_reads_them(calibrated_bundle: Path) -> None:
    speculation = json.loads((calibrated_bundle / "calibration.json").read_text())["speculation"]
    recorded = recorded_verify_costs(speculation)
    assert recorded is not None and recorded.engine == "decode_full"
    assert sorted(recorded.pass_ms) == list(range(1, MAX_VERIFY_DRAFTS + 2))
    assert speculation["verify_cost"]["cost"] == recorded.costs() and recorded.repeats >= 3
    step = float(speculation["latencies_as_run"]["decode_ms"]["1"])
    hit_rate = speculation["prompt_lookup_hit_rate"]
    lookups = [c for c in speculation["measured_choice"]["candidates"] if c["source"] == "prompt_lookup"]
    assert lookups
    for candidate in lookups:  # each lookup round priced at the measured T=k+1 / T=1 ratio
        k = candidate["draft_len"]
        hits = hit_rate.get(str(k), 1.0)
        expected = hits * round(step * recorded.cost(k), 3) + (1 - hits) * step
        assert candidate["round_ms"] == pytest.approx(expected, abs=2e-3), candidate
