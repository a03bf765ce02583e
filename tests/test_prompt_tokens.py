"""Prompt tokens (parallel prompt decoding): the chain simulation calibration prices them with, the masks that train
many groups in one pass, the portable flavour's embedding of them (engine parity and lossless
greedy through `check`), and a clear error for a foreign prompt-tokens file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptive_export.calibration.drafts.prompt_tokens import FrozenSequence, simulate_chain
from adaptive_export.commands.cli import main
from adaptive_export.runtimes.errors import UsageError
from tests.conftest import make_tiny_model

ROOT = Path(__file__).parents[1]


def test_chain_simulation_follows_the_runtime_rounds() -> None:
    # prompt [0, 1], continuation 10..15; guesses after position t are found[t]
    seq = FrozenSequence(ids=[0, 1, 10, 11, 12, 13, 14, 15], prompt_len=2, keys=[], values=[])
    found = {2: [12, 13], 3: [0, 0], 4: [14, 99], 5: [0, 0], 6: [15]}
    # round 1: pending 10 (pos 2), no drafts -> emits 11, guesses found[2] = [12, 13]
    # round 2: drafts 12, 13 both accepted + bonus 14 -> pending 14 at pos 6, drafts found[5]
    # round 3: drafts [0] (one token left) rejected -> emits 15; done
    result = simulate_chain(seq, found, k=2)
    assert result["tokens_per_round"] == pytest.approx(5 / 3)
    assert result["acceptance"] == pytest.approx(2 / 3)
    assert result["draft_round_share"] == pytest.approx(2 / 3)


def test_frame_at_equals_the_causal_frame(tmp_path: Path) -> None:
    from adaptive_export.graphs.layers import DecoderStack
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(make_tiny_model(tmp_path / "m", "gqa_untied", layers=2)))
    stack = DecoderStack(loaded.hf_model, loaded.spec, range(2))
    past, new = 3, 4
    query, keys = torch.arange(past, past + new), torch.arange(past + new)
    for (cos, sin, mask), (cos2, sin2, mask2) in zip(
        stack.frame(past, new), stack.frame_at(query, keys, keys[None, :] <= query[:, None])
    ):
        torch.testing.assert_close(cos, cos2)
        torch.testing.assert_close(sin, sin2)
        torch.testing.assert_close(mask, mask2)


def test_portable_bundle_embeds_prompt_tokens_and_checks(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "mha_tied", layers=4, seed=5)
    bundle = tmp_path / "bundle"
    assert (
        main(
            [
                "build",
                str(model),
                "-o",
                str(bundle),
                "--max-len",
                "96",
                "--onnx-flavour",
                "portable",
                "--prompt-tokens",
                "3",
                "--calib",
                str(ROOT / "samples" / "eval_prompts.jsonl"),
            ]
        )
        == 0
    )
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert (
        manifest["graphs"]["decode_full"]["prompt_tokens"] == 3 and manifest["graphs"]["prefill"]["prompt_tokens"] == 0
    )
    assert (bundle / "prompt_tokens.safetensors").stat().st_size < 64 * 3 * 4 + 256  # m x hidden floats and a header
    report = tmp_path / "report.json"
    assert main(["check", str(bundle), "--model", str(model), "--report", str(report), "--new-tokens", "12"]) == 0
    results = json.loads(report.read_text())["results"]
    assert any(r["check"] == "parity" and r["engine"] == "decode_full" and r["passed"] for r in results)
    assert [r for r in results if r["check"].startswith("greedy") and r["engine"].endswith(":prompt_tokens")], (
        "check ran no prompt-token speculation"
    )
    # a previous build's file is reused as is
    again = tmp_path / "again"
    assert (
        main(
            [
                "build",
                str(model),
                "-o",
                str(again),
                "--max-len",
                "96",
                "--prompt-tokens",
                str(bundle / "prompt_tokens.safetensors"),
                "--calib",
                str(ROOT / "samples" / "eval_prompts.jsonl"),
            ]
        )
        == 0
    )
    assert (again / "prompt_tokens.safetensors").read_bytes() == (bundle / "prompt_tokens.safetensors").read_bytes()


def test_foreign_prompt_tokens_file_is_a_clear_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from adaptive_export.calibration.drafts.prompt_tokens import TABLE
    from adaptive_export.loading.artifacts import load_draft_table

    path = tmp_path / "p.safetensors"
    save_file({"prompt_tokens": torch.zeros(3, 32)}, str(path))
    expected = r"prompt tokens file .* holds prompt_tokens of shape \(3, 32\), this model needs \(1..16, 64\)"
    with pytest.raises(UsageError, match=expected):
        load_draft_table(TABLE, path, 64)
