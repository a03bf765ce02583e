"""The draft-source registry: names that no longer mean a source are refused with a pointer
to the new name, on the command line and in a bundle's manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bad_bundles import corrupt_copy, edit_manifest, expect_usage_error


def test_run_draft_ppd_names_prompt_tokens(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = expect_usage_error(["run", str(tiny_bundle), "-p", "hi", "--mode", "spec", "--draft", "ppd"], capsys)
    assert "prompt_tokens" in err, err


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(speculation={"source": "ppd", "auto_enabled": False}),
        lambda m: m.update(speculation={"source": None, "ppd": {"draft_len": 2}}),
    ],
    ids=["source", "section"],
)
def test_bundle_with_the_old_prompt_tokens_name_says_rebuild(
    edit: object, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = corrupt_copy(tiny_bundle, tmp_path, edit_manifest(edit))  # type: ignore[arg-type]
    expect_usage_error(["run", str(copy), "-p", "hi"], capsys, "'ppd'", "'prompt_tokens'", "rebuild the bundle")
