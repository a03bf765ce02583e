"""`--speculate auto`: acceptance simulated in PyTorch x engine latencies measured on the
staged bundle decide the draft source, k, and whether `--mode auto` speculates."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from adaptive_export.calibration.draft_sources import simulate_rounds
from adaptive_export.calibration.latency import MIN_SPEEDUP, choose_measured
from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.manifest import Speculation
from tests.conftest import build_tiny

CALIB = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is the capital of France?",
    "Repeat: the sea and the sky and the stars",
    "Write a short poem about the sea",
]


def with_speculation(bundle: Bundle, speculation: dict) -> None:
    """Swap the loaded bundle's speculation section (the manifest is immutable: a new one)."""
    bundle.manifest = dataclasses.replace(bundle.manifest, speculation=Speculation.from_json(speculation))


def _measured(lookup_tokens: float, hit_rate: float, early_tokens: float) -> dict:
    return {
        "prompt_lookup_tokens_per_round": {"2": lookup_tokens},
        "prompt_lookup_hit_rate": {"2": hit_rate},
        "early_exit_tokens_per_round": {"6:2": early_tokens},
    }


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
    return build_tiny(tmp_path_factory, "--max-len", "128", "--speculate", "auto", calib=CALIB)


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
    spec = generator.bundle.manifest.speculation.to_json()
    assert set(spec["prompt_lookup"]["verify_cost"]) >= {"1", "2", "4"} and set(
        spec["prompt_lookup"]["verify_cost_prepacked"]
    ) >= {"1", "2", "4"}
    ids = generator.codec.encode(CALIB[0], raw=True)
    plain = generator.generate(ids, mode="ar", max_new_tokens=20)
    auto = generator.generate(ids, max_new_tokens=20, mode="auto")
    used = auto.stats.speculation
    if spec["auto_enabled"]:
        # the calibrated source; lookup and precision drafts stay gated (they fall back to plain steps)
        assert used["draft_source"] == spec["source"] and used["gated"] == (
            spec["source"] in ("prompt_lookup", "precision")
        )
        assert used["draft_len"] == spec[spec["source"]]["draft_len"]
    else:
        assert used["draft_source"] == "prompt_lookup" and used["gated"]
    assert auto.tokens == plain.tokens


def test_gated_drafting_follows_the_round_times_it_measures(auto_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate times its own rounds on this machine, whatever the build measured: the build
    here claims that verifying drafts is free, but when a verify pass over drafts really costs
    40 ms more than a plain step, gated lookup stops drafting after the rounds that time it
    (probes aside); when plain steps are the slow ones, it drafts every round it finds an
    n-gram. Output is plain decoding's either way."""
    import time

    from adaptive_export.runtimes.drafting.prompt_lookup import PromptLookup
    from adaptive_export.runtimes.gate import PLAIN_EVERY, PROBE_EVERY

    generator = Generator(auto_bundle)
    spec = generator.bundle.manifest.speculation.to_json()
    spec["auto_enabled"] = False
    for key in ("verify_cost", "verify_cost_prepacked"):  # the build's (wrong) claim: drafting always pays
        spec["prompt_lookup"][key] = {str(k): 1.0 for k in range(1, 10)}
    with_speculation(generator.bundle, spec)
    ids = generator.codec.encode("the sea the sea the sea and the sky the sea", raw=True)
    plain = generator.generate(ids, mode="ar", max_new_tokens=48).tokens
    verify = PromptLookup.verify
    runs = {}
    for slow in ("drafting", "plain"):

        def slowed(self, pending, proposal, start, arena, slow=slow):  # noqa: ANN001, ANN202
            if bool(proposal.tokens) == (slow == "drafting"):
                time.sleep(0.04)
            return verify(self, pending, proposal, start, arena)

        monkeypatch.setattr(PromptLookup, "verify", slowed)
        result = generator.generate(ids, max_new_tokens=48, mode="auto")
        assert result.tokens == plain
        runs[slow] = result.stats.speculation
    cheap, expensive = runs["plain"], runs["drafting"]
    assert expensive["timed_draft_ms_per_token"] > expensive["timed_plain_ms"], expensive
    assert cheap["timed_draft_ms_per_token"] < cheap["timed_plain_ms"], cheap
    # expensive: plain rounds score lookup's proposals, 2 drafting rounds time a drafting round,
    # then drafting only on probes
    drafting_rounds = expensive["rounds"] - expensive["rounds_without_drafting"]
    assert drafting_rounds <= 4 + expensive["rounds"] // PROBE_EVERY, expensive
    # cheap: plain rounds only while the first lookup proposal is scored and plain decoding timed
    # (a warm-up round, then up to k rounds), then one per PLAIN_EVERY drafting rounds
    assert cheap["rounds_without_drafting"] <= 1 + cheap["draft_len"] + cheap["rounds"] // PLAIN_EVERY, cheap
    assert expensive["drafted"] * 3 <= cheap["drafted"], (expensive, cheap)


def test_gated_lookup_scores_proposals_on_plain_rounds(auto_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt lookup's proposals are free, so plain rounds score them: when every proposal
    would be rejected, gated lookup never pays for a drafting round (no probes either); when
    proposals are the very tokens plain decoding emits, it drafts."""
    from adaptive_export.runtimes.drafting import Proposal
    from adaptive_export.runtimes.drafting.prompt_lookup import PromptLookup

    generator = Generator(auto_bundle)
    spec = generator.bundle.manifest.speculation.to_json()
    spec["auto_enabled"] = False  # auto = gated prompt lookup
    for key in ("verify_cost", "verify_cost_prepacked"):  # a drafting round costs more than a plain step, as on any CPU
        spec["prompt_lookup"][key] = {str(k): 1.3 for k in range(1, 10)}
    with_speculation(generator.bundle, spec)
    ids = generator.codec.encode("the sea the sea the sea and the sky the sea", raw=True)
    plain = generator.generate(ids, mode="ar", max_new_tokens=40).tokens
    never = next(t for t in range(generator.bundle.model.vocab_size) if t not in plain)
    monkeypatch.setattr(PromptLookup, "propose", lambda self, pending, context, k, *rest: Proposal([never] * k))
    wrong = generator.generate(ids, max_new_tokens=40, mode="auto")
    assert wrong.tokens == plain and wrong.stats.speculation["drafted"] == 0, wrong.stats.speculation

    def oracle(self, pending, context, k, *rest):  # noqa: ANN001, ANN202
        done = len(context) - len(ids)
        return Proposal(plain[done : done + k])

    monkeypatch.setattr(PromptLookup, "propose", oracle)
    right = generator.generate(ids, max_new_tokens=40, mode="auto").stats.speculation
    assert right["acceptance"] == 1.0 and right["drafted"] >= right["draft_len"], right


def test_simulated_acceptance_matches_the_runtime(auto_bundle: Path) -> None:
    """Calibration's PyTorch simulation of prompt lookup (calibration.json) and the runtime's
    measured acceptance on the same prompts and token budget agree within 0.05 per draft
    length: a runtime that drafted or verified differently from what was calibrated (and so
    chose k on wrong numbers) fails here, even though it would stay lossless."""
    measured = json.loads((auto_bundle / "calibration.json").read_text())["speculation"]
    generator = Generator(auto_bundle)
    for k in (1, 2, 4):
        per_prompt = []
        for prompt in CALIB:
            result = generator.generate(
                generator.codec.encode(prompt),
                max_new_tokens=measured["new_tokens"],
                mode="spec",
                draft="prompt_lookup",
                draft_len=k,
            )
            if len(result.tokens) < 2:
                continue  # calibration skips these too
            used = result.stats.speculation
            per_prompt.append(used["accepted"] / max(used["drafted"], 1))
        simulated = measured["prompt_lookup_acceptance"][str(k)]
        assert abs(sum(per_prompt) / len(per_prompt) - simulated) <= 0.05, (k, per_prompt, simulated)
