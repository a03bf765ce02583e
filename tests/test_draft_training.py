"""Trained draft exit on a tiny random model: training runs under accelerate and beats the raw
exit on held-out positions; the head file round-trips and hostile ones are refused; a bundle
built with --draft-head drafts over the trimmed vocabulary losslessly; a high stop threshold
ends every round after its first draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from adaptive_export.calibration.draft_data import training_text
from adaptive_export.calibration.draft_length import Costs, choose_length, simulate
from adaptive_export.calibration.draft_training import DraftHeadFit, TrainSettings, train_draft_heads
from adaptive_export.commands.cli import main
from adaptive_export.graphs.adaptive import DraftHead
from adaptive_export.loading.artifacts import draft_head_bytes, load_draft_head
from adaptive_export.loading.model import load_model
from adaptive_export.runtimes import Generator, load_bundle
from tests.conftest import tiny6_model
from tests.test_speculative import PROMPTS, assert_same_or_tie

EXIT = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, DraftHeadFit]:
    model = tiny6_model(tmp_path_factory)
    loaded = load_model(str(model))
    text = training_text(loaded, requests=5, answer_tokens=24, docstrings=60, seed=0, progress=False)
    fit = train_draft_heads(
        loaded, text, [EXIT], sizes=(96, 192), settings=TrainSettings(epochs=4, max_seconds=120, progress=False)
    )
    return model, text, fit


def test_text_holds_out_whole_documents(trained: tuple[Path, Any, DraftHeadFit]) -> None:
    _, text, fit = trained
    summary = text.summary()
    for split in ("train", "held_out"):
        assert summary[split]["self"]["documents"] >= 1 and summary[split]["stdlib"]["documents"] >= 1, summary
    assert not {doc.ids for doc in text.train} & {doc.ids for doc in text.held_out}
    assert fit.report["positions"]["held_out_greedy"] > 0


def test_training_beats_the_untrained_exit_on_held_out_positions(trained: tuple[Path, Any, DraftHeadFit]) -> None:
    _, _, fit = trained
    row = fit.report["per_exit"][str(EXIT)]
    kept = row["kept"]
    trained_agreement = row["forms"][kept["form"]]["held_out_agreement"]["192"]
    assert trained_agreement >= row["untrained_agreement"]["192"] + 0.1, row
    assert trained_agreement >= row["untrained_agreement"]["full_vocabulary"] + 0.1, row
    for form in ("lowrank", "gated"):
        assert row["forms"][form]["params"] <= fit.report["layer_params"], row
        assert row["forms"][form]["steps"] > 0 and set(row["forms"][form]["train_minutes"]) == {"wall", "cpu"}
    head = fit.heads[EXIT]
    assert head.ids.numel() == kept["vocab"] and bool((head.ids[1:] > head.ids[:-1]).all())


def test_head_file_round_trips(trained: tuple[Path, Any, DraftHeadFit], tmp_path: Path) -> None:
    model, _, fit = trained
    head = fit.heads[EXIT]
    path = tmp_path / "head.safetensors"
    path.write_bytes(draft_head_bytes(head))
    loaded = load_draft_head(path, 64, 1e-6, 6, 300)
    assert (loaded.exit_layer, loaded.form, loaded.draft_len) == (EXIT, head.form, head.draft_len)
    assert loaded.stop_below == pytest.approx(head.stop_below)
    assert torch.equal(loaded.ids, head.ids)
    for (name, a), (_, b) in zip(head.block.named_parameters(), loaded.block.named_parameters()):
        torch.testing.assert_close(a.half().float(), b, msg=name)


def head_file(head: DraftHead, tmp_path: Path, name: str, **changes: Any) -> Path:
    fields = {**head.__dict__, **changes}
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(draft_head_bytes(DraftHead(**fields)))
    return path


def build(model: Path, out: Path, head: Path, speculate: str = f"{EXIT}:4") -> Path:
    args = ["build", str(model), "-o", str(out), "--max-len", "128", "--speculate", speculate]
    assert main([*args, "--draft-head", str(head)]) == 0
    return out


@pytest.fixture(scope="module")
def head_bundles(
    trained: tuple[Path, Any, DraftHeadFit], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The trained head with no stop threshold, and with one so high that every round stops after one draft."""
    model, _, fit = trained
    root = tmp_path_factory.mktemp("head_bundles")
    fixed = build(model, root / "fixed", head_file(fit.heads[EXIT], root, "fixed", stop_below=0.0))
    stopping = build(model, root / "stopping", head_file(fit.heads[EXIT], root, "stopping", stop_below=0.999))
    return fixed, stopping


def test_bundle_drafts_over_the_trimmed_vocabulary(
    trained: tuple[Path, Any, DraftHeadFit], head_bundles: tuple[Path, Path]
) -> None:
    head = trained[2].heads[EXIT]
    bundle = load_bundle(head_bundles[0])
    draft = next(g for g in bundle.manifest.graphs.values() if g.kind == "draft")
    assert draft.draft_vocab == head.ids.numel() and draft.exit_adapter and draft.exit_layer == EXIT
    assert list(bundle.draft_vocab_ids) == head.ids.tolist()
    speculation = bundle.manifest.speculation.to_json()
    assert speculation["draft_stop_below"] == 0.0 and speculation["draft_head"]["form"] == head.form


@pytest.mark.parametrize("which", [0, 1])
def test_trimmed_early_exit_draft_is_lossless(head_bundles: tuple[Path, Path], which: int) -> None:
    generator = Generator(head_bundles[which])
    accepted = 0
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt, raw=True)
        ar = generator.generate(ids, mode="ar", max_new_tokens=30).tokens
        result = generator.generate(ids, max_new_tokens=30, mode="spec", draft="early_exit", draft_len=4)
        assert result.stats.speculation["draft_source"] == "early_exit"
        accepted += result.stats.speculation["accepted"]
        assert_same_or_tie(generator, ids, ar, result.tokens)
    assert accepted > 0  # a draft that never names the verifier's token would be trivially lossless


def test_high_threshold_stops_drafting_after_one_draft(head_bundles: tuple[Path, Path]) -> None:
    per_round = []
    for bundle in head_bundles:
        generator = Generator(bundle)
        ids = generator.codec.encode("Write a short poem about the sea", raw=True)
        stats = generator.generate(ids, max_new_tokens=30, mode="spec", draft="early_exit", draft_len=4).stats
        per_round.append(stats.speculation["drafted"] / stats.speculation["rounds"])
    assert per_round[1] == 1.0 and per_round[0] > 2.0, per_round


def test_length_calibration_prefers_stopping_when_late_drafts_miss() -> None:
    """Confident drafts are right, doubtful ones wrong: the threshold that stops at doubt wins."""
    correct: list[bool] = []
    confidence: list[float] = []
    for run in [1, 4, 2, 5, 3, 1, 2, 4] * 5:  # runs of confident right drafts, each ended by a doubtful wrong one
        correct += [True] * run + [False]
        confidence += [0.9] * run + [0.2]
    segment = (correct, confidence)
    assert simulate([segment], 4, 0.999).drafted == simulate([segment], 4, 0.999).rounds
    choice = choose_length([segment], Costs(draft=1.0, verify=5.0, plain=8.0))
    assert 0.2 < choice.stop_below <= 0.9 and choice.expected_speedup > choice.fixed_speedup
    assert choice.rounds.accepted == sum(correct)  # every right draft accepted, no round wasted past a doubt


def test_bad_head_files_are_refused(
    trained: tuple[Path, Any, DraftHeadFit], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    model, _, fit = trained
    head = fit.heads[EXIT]
    bad_ids = head_file(head, tmp_path, "bad_ids", ids=torch.tensor([5, 3, 4]))
    too_high = head_file(head, tmp_path, "too_high", stop_below=1.5)
    shapes = tmp_path / "shapes.safetensors"
    save_file({"3.norm_weight": torch.ones(5), "3.gate.weight": torch.zeros(4, 5), "ids": torch.arange(4)}, str(shapes))
    for path in (bad_ids, too_high, shapes, tmp_path / "missing.safetensors"):
        code = main(["build", str(model), "-o", str(tmp_path / "o"), "--speculate", "3:2", "--draft-head", str(path)])
        assert code == 2, path
        err = capsys.readouterr().err
        assert "Traceback" not in err and "draft head file" in err, err
