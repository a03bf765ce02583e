"""VocabTrim: a precision draft whose LM head scores only the ids in draft_vocab.bin. Drafts
map back to real token ids, speculation stays lossless (greedy and sampling), `check` covers
the trimmed engine, and a hostile ids file or manifest entry is a clear error."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.calibration.draft_vocab import ranked_ids
from adaptive_export.commands.cli import main
from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.bundle import load_bundle
from adaptive_export.runtimes.errors import UsageError
from tests.conftest import assert_sampling_matches_plain, make_tiny_model
from tests.test_speculative import PROMPTS, assert_same_or_tie

ROOT = Path(__file__).parents[1]
SIZE = 96  # of the tiny tokenizer's ~300 tokens


@pytest.fixture(scope="module")
def trimmed_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vocabtrim")
    model = make_tiny_model(root / "model", "gqa_untied", layers=4, seed=3)
    assert (
        main(
            [
                "build",
                str(model),
                "-o",
                str(root / "bundle"),
                "--max-len",
                "128",
                "--draft-precision",
                "int8",
                "--draft-vocab",
                str(SIZE),
                "--calib",
                str(ROOT / "samples" / "eval_prompts.jsonl"),
            ]
        )
        == 0
    )
    return root / "bundle"


def test_ranking_keeps_specials_then_frequency_then_low_ids() -> None:
    order = ranked_ids([2, 999], Counter({7: 3, 5: 3, 9: 1}), Counter({9: 5, 4: 1}), vocab=12)
    assert order[:6] == [2, 5, 7, 9, 4, 0]  # 999 is outside the vocabulary; ties go to the lower id
    assert sorted(order) == list(range(12))


def test_bundle_ships_ids_and_a_trimmed_engine(trimmed_bundle: Path) -> None:
    manifest = json.loads((trimmed_bundle / "manifest.json").read_text())
    assert manifest["draft_vocab"] == {"file": "draft_vocab.bin", "size": SIZE}
    assert (
        manifest["graphs"]["pdraft_full_int8"]["draft_vocab"] == SIZE
        and manifest["graphs"]["decode_full"]["draft_vocab"] == 0
    )
    report = json.loads((trimmed_bundle / "calibration.json").read_text())["draft_vocab"]
    assert report["size"] == SIZE and 0.5 <= report["coverage_held_out"] <= 1.0
    ids = np.fromfile(trimmed_bundle / "draft_vocab.bin", dtype="<i4")
    assert ids.size == SIZE and np.all(np.diff(ids) > 0)
    generator = Generator(trimmed_bundle)
    prompt = generator.codec.encode("The quick brown fox", raw=True)
    generator.backend.run("prefill", np.asarray([prompt]), generator.arena, 0)
    out = generator.backend.run("pdraft_full_int8", np.asarray([[prompt[-1]]]), generator.arena, len(prompt))
    assert out.logits.shape == (1, 1, SIZE)  # the draft step pays a head of SIZE rows, not the vocabulary


@pytest.mark.parametrize("k", [1, 4])
def test_trimmed_precision_draft_is_lossless_and_accepted(trimmed_bundle: Path, k: int) -> None:
    """Lossless on raw prompts the vocabulary was not chosen on; on the calibration prompts (whose
    continuations it covers) the trimmed int8 draft is accepted about as often as a full one, which
    fails if drafts were not mapped back from head rows to token ids."""
    from adaptive_export.loading.prompts import read_prompts

    generator = Generator(trimmed_bundle)
    for prompt in PROMPTS:
        prompt_ids = generator.codec.encode(prompt, raw=True)
        ar = generator.generate(prompt_ids, mode="ar", max_new_tokens=24).tokens
        spec = generator.generate(prompt_ids, max_new_tokens=24, mode="spec", draft="precision", draft_len=k).tokens
        assert_same_or_tie(generator, prompt_ids, ar, spec)
    drafted = accepted = 0
    for prompt in read_prompts(str(ROOT / "samples" / "eval_prompts.jsonl")):
        prompt_ids = generator.codec.encode(prompt)
        ar = generator.generate(prompt_ids, mode="ar", max_new_tokens=24).tokens
        spec = generator.generate(prompt_ids, max_new_tokens=24, mode="spec", draft="precision", draft_len=k)
        assert_same_or_tie(generator, prompt_ids, ar, spec.tokens)
        drafted += spec.stats.speculation["drafted"]
        accepted += spec.stats.speculation["accepted"]
    assert accepted / drafted >= 0.8, (accepted, drafted)


def test_trimmed_draft_sampling_matches_plain_sampling(trimmed_bundle: Path) -> None:
    """The rejection rule with q over the reduced vocabulary keeps the full model's distribution."""
    generator = Generator(trimmed_bundle)
    assert_sampling_matches_plain(generator, "The quick brown fox", 8, 600, mode="spec", draft="precision", draft_len=2)


def test_check_covers_the_trimmed_engine(trimmed_bundle: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    assert (
        main(
            [
                "check",
                str(trimmed_bundle),
                "--model",
                str(trimmed_bundle.parent / "model"),
                "--report",
                str(report),
                "--new-tokens",
                "12",
                "--prompts",
                str(ROOT / "samples" / "eval_prompts.jsonl"),
            ]
        )
        == 0
    )
    results = json.loads(report.read_text())["results"]
    assert any(r["engine"] == "pdraft_full_int8" and r["check"] == "parity" for r in results)
    assert any(r["engine"] == "pdraft_full_int8" and r["check"] == "quality[mean]" and r["passed"] for r in results)
    assert sum(r["engine"] == "spec:full:precision" and r["passed"] for r in results) == 10


def _rewrite(bundle: Path, tmp_path: Path, data: bytes) -> Path:
    """A copy whose draft_vocab.bin holds `data`, listed with a matching checksum (a hostile
    bundle is self-consistent: only the ids' own checks can refuse it)."""
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    (copy / "draft_vocab.bin").write_bytes(data)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["draft_vocab.bin"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("case", ["descending", "outside", "short"])
def test_hostile_ids_are_refused(trimmed_bundle: Path, tmp_path: Path, case: str) -> None:
    ids = np.fromfile(trimmed_bundle / "draft_vocab.bin", dtype="<i4")
    data = (
        {"descending": ids[::-1], "outside": np.append(ids[:-1], 10_000_000), "short": ids[:-1]}[case]
        .astype("<i4")
        .tobytes()
    )
    generator = Generator(_rewrite(trimmed_bundle, tmp_path, data))
    with pytest.raises(UsageError, match="draft vocabulary file 'draft_vocab.bin'"):
        generator.generate("The quick brown fox", max_new_tokens=4, mode="spec", draft="precision")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("draft_vocab"), "no 'draft_vocab' file"),
        (lambda m: m["draft_vocab"].update(size=SIZE + 1), "differs from the bundle's draft_vocab size"),
        (lambda m: m["graphs"]["decode_full"].update(draft_vocab=SIZE), "bad draft_vocab"),
        (lambda m: m["draft_vocab"].update(size=10**6), "size in 1.."),
    ],
)
def test_bad_draft_vocab_manifest_is_refused(trimmed_bundle: Path, tmp_path: Path, edit, message: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(trimmed_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match=message):
        load_bundle(copy)


def test_draft_vocab_needs_a_precision_draft(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path / "model", "gqa_untied", layers=2)
    assert main(["build", str(model), "-o", str(tmp_path / "b"), "--draft-vocab", "64"]) == 2
    assert "--draft-vocab 64 trims the precision draft's LM head" in capsys.readouterr().err
    assert (
        main(["build", str(model), "-o", str(tmp_path / "b"), "--draft-precision", "int8", "--draft-vocab", "100000"])
        == 2
    )
    assert "is not below this model's vocabulary" in capsys.readouterr().err
