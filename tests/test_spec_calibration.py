"""`--speculate auto`: acceptance simulated in PyTorch x engine latencies measured on the
staged bundle decide the draft source, k, and whether `--mode auto` speculates."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibration.latency import MIN_SPEEDUP, choose_measured
from calibration.draft_sources import simulate_rounds
from commands.cli import main
from runtimes import Generator
from tests.conftest import make_tiny_model

CALIB = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "What is the capital of France?",
         "Repeat: the sea and the sky and the stars", "Write a short poem about the sea"]


def _measured(lookup_tokens: float, hit_rate: float, early_tokens: float) -> dict:
    return {"prompt_lookup_tokens_per_round": {"2": lookup_tokens}, "prompt_lookup_hit_rate": {"2": hit_rate},
            "early_exit_tokens_per_round": {"6:2": early_tokens}}


def test_choice_uses_measured_latencies() -> None:
    latencies = {"decode_ms": {1: 10.0, 2: 11.0, 3: 12.0}, "draft_ms": 4.0, "verify_ms": {1: 6.0, 2: 7.0}}
    # lookup: 2.4 tokens per round at 12 ms = 2.0x; early exit: 1.5 tokens per (2 x 4 + 7) ms = 1.0x
    choice = choose_measured(_measured(2.4, 1.0, 1.5), latencies, exit_layer=6)
    assert choice["best"]["source"] == "prompt_lookup" and choice["best"]["expected_speedup"] == pytest.approx(2.0)
    assert choice["by_source"]["early_exit"]["expected_speedup"] == pytest.approx(1.0)
    assert choice["auto_enabled"]
    # the same acceptance is worthless when verifying 3 tokens costs 3 plain steps
    slow = {**latencies, "decode_ms": {1: 10.0, 2: 20.0, 3: 30.0}}
    choice = choose_measured(_measured(2.4, 1.0, 1.5), slow, exit_layer=6)
    assert choice["best"]["expected_speedup"] < MIN_SPEEDUP and not choice["auto_enabled"]
    # misses (no n-gram found) cost one plain step and produce one token
    choice = choose_measured(_measured(1.2, 0.2, 1.0), latencies, exit_layer=None)
    assert choice["best"]["round_ms"] == pytest.approx(0.2 * 12.0 + 0.8 * 10.0)


def test_simulation_counts_the_bonus_token() -> None:
    truth = list(range(10))
    perfect = lambda i, k: truth[i + 1 : i + 1 + k]  # noqa: E731
    assert simulate_rounds(perfect, truth, 2)["tokens_per_round"] == pytest.approx(9 / 5)  # 2 per round
    assert simulate_rounds(perfect, truth, 2, bonus=True)["tokens_per_round"] == pytest.approx(3.0)  # 2 + bonus


@pytest.fixture(scope="module")
def auto_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("specauto")
    model = make_tiny_model(root / "model", "gqa_untied", layers=6, seed=3)
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CALIB))
    assert main(["build", str(model), "-o", str(root / "bundle"), "--max-len", "128", "--speculate", "auto", "--calib", str(calib)]) == 0
    return root / "bundle"


def test_auto_build_records_latencies_and_choice(auto_bundle: Path) -> None:
    manifest = json.loads((auto_bundle / "manifest.json").read_text())
    calibration = json.loads((auto_bundle / "calibration.json").read_text())["speculation"]
    spec = manifest["speculation"]
    assert "measured engine latencies" in spec["chosen_by"]
    latencies = calibration["latencies"]
    assert all(float(v) > 0 for v in latencies["decode_ms"].values()) and len(latencies["decode_ms"]) >= 5
    assert latencies["draft_ms"] > 0 and all(float(v) > 0 for v in latencies["verify_ms"].values())
    best = calibration["measured_choice"]["best"]
    assert spec["source"] == best["source"] and spec[best["source"]]["draft_len"] == best["draft_len"]
    assert spec["auto_enabled"] == (best["expected_speedup"] > MIN_SPEEDUP)


def test_mode_auto_follows_the_calibrated_choice(auto_bundle: Path) -> None:
    generator = Generator(auto_bundle)
    spec = generator.bundle.manifest["speculation"]
    assert set(spec["prompt_lookup"]["verify_cost"]) >= {"1", "2", "4"} and set(spec["prompt_lookup"]["verify_cost_prepacked"]) >= {"1", "2", "4"}
    ids = generator.codec.encode(CALIB[0], raw=True)
    plain = generator.generate(ids, max_new_tokens=20)
    auto = generator.generate(ids, max_new_tokens=20, mode="auto")
    used = auto.stats.speculation
    if spec["auto_enabled"]:
        # the calibrated source; lookup and precision drafts stay gated (they fall back to plain steps)
        assert used["draft_source"] == spec["source"] and used["gated"] == (spec["source"] in ("prompt_lookup", "precision"))
        assert used["draft_len"] == spec[spec["source"]]["draft_len"]
    else:
        assert used["draft_source"] == "prompt_lookup" and used["gated"]
    assert auto.tokens == plain.tokens


def test_gated_lookup_stops_drafting_when_drafts_do_not_pay(auto_bundle: Path) -> None:
    """With an (artificially) expensive verify pass, gated lookup drafts rarely; with a free
    one it drafts every round it finds an n-gram. Output is plain decoding's either way."""
    from runtimes.speculative import PROBE_EVERY

    generator = Generator(auto_bundle)
    spec = generator.bundle.manifest["speculation"]
    spec["auto_enabled"] = False
    ids = generator.codec.encode("the sea the sea the sea and the sky the sea", raw=True)
    plain = generator.generate(ids, max_new_tokens=48).tokens
    runs = {}
    for cost in (100.0, 1.0):
        # the runtime reads the cost measured the way its decode engine runs (prepacked by default)
        for key in ("verify_cost", "verify_cost_prepacked"):
            spec["prompt_lookup"][key] = {str(k): cost for k in range(1, 10)}
        result = generator.generate(ids, max_new_tokens=48, mode="auto")
        assert result.tokens == plain
        runs[cost] = result.stats.speculation
    assert runs[1.0]["rounds_without_drafting"] == 0 and runs[1.0]["drafted"] > 0
    expensive = runs[100.0]
    assert expensive["rounds_without_drafting"] > 0
    # after the first drafted round shows drafts do not pay, only probes draft
    assert expensive["rounds"] - expensive["rounds_without_drafting"] <= 3 + expensive["rounds"] // PROBE_EVERY
    assert expensive["drafted"] * 3 <= runs[1.0]["drafted"], (expensive, runs[1.0])
