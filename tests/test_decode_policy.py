"""The decoding policy chosen at prefill (runtimes/decode_policy.py): an edit prompt (a fenced code
block the answer rewrites) decodes two rows with prompt-lookup speculation, a chat prompt one
plain row; `--mode ar` decodes with the same rows, so its tokens equal the default run's; a
caller's or bundle's fixed rows win. The real-model case (Qwen2.5-Coder-0.5B) is in
tests/test_qwen_coder.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_export.commands.cli import main
from adaptive_export.runtimes.decode_policy import MIN_CODE_CHARS, code_chars, prompt_policy

CODE = "def total(items):\n    x = 0\n    for i in items:\n        x += i.price\n    return x  # sum\n"
EDIT = f"Fix:\n```\n{CODE}```"  # short: the tiny bundle's tokenizer spends a token per character or two
CHAT = "Explain in two sentences what a hash map is."


def test_a_fenced_block_of_code_makes_an_edit_prompt() -> None:
    assert code_chars(EDIT) == len(CODE.strip()) >= MIN_CODE_CHARS
    assert prompt_policy(EDIT).rows == 2 and prompt_policy(EDIT).name == "lookup"
    assert prompt_policy(CHAT).rows == 1 and prompt_policy(CHAT).name == "plain"
    assert prompt_policy("```\nx = 1\n```").name == "plain"  # too short to be worth two rows
    assert prompt_policy(f"Fix:\n```\n{CODE}").name == "lookup"  # an unclosed fence runs to the end


def run_json(capsys: pytest.CaptureFixture[str], bundle: Path, prompt: str, *flags: str) -> dict:
    assert main(["run", str(bundle), "-p", prompt, "--raw", "--max-new-tokens", "8", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_run_speculates_on_an_edit_prompt_and_decodes_plainly_on_chat(
    capsys: pytest.CaptureFixture[str], tiny_bundle: Path
) -> None:
    edit, edit_ar = (run_json(capsys, tiny_bundle, EDIT, *m) for m in ((), ("--mode", "ar")))
    assert (edit["stats"]["policy"], edit["stats"]["decode_rows"], edit["stats"]["mode"]) == ("lookup", 2, "spec")
    assert edit["stats"]["draft_source"] == "prompt_lookup", edit["stats"]
    assert (edit_ar["stats"]["decode_rows"], edit_ar["stats"]["policy"]) == (2, "lookup")
    assert edit["tokens"] == edit_ar["tokens"]
    chat, chat_ar = (run_json(capsys, tiny_bundle, CHAT, *m) for m in ((), ("--mode", "ar")))
    assert (chat["stats"]["policy"], chat["stats"]["decode_rows"]) == ("plain", 1)
    assert chat["tokens"] == chat_ar["tokens"]


def test_fixed_rows_win_over_the_prompt(capsys: pytest.CaptureFixture[str], tiny_bundle: Path) -> None:
    one = run_json(capsys, tiny_bundle, EDIT, "--decode-rows", "1")
    assert (one["stats"]["policy"], one["stats"]["decode_rows"]) == ("fixed", 1)
    spec = run_json(capsys, tiny_bundle, EDIT, "--mode", "spec", "--draft", "prompt_lookup")
    assert spec["stats"]["policy"] == "fixed"
