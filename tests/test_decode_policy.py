"""The decoding policy chosen at prefill (runtimes/decode_policy.py): an edit prompt (a fenced code
block the answer rewrites) decodes two rows with prompt-lookup speculation, a chat prompt one
plain row; `--mode ar` decodes with the same rows, so its tokens equal the default run's; a
caller's or bundle's fixed rows win. `build` measures the rows per kind of prompt on the built
engines (calibration/prompt_rows.py, manifest `prompt_rows`), and the runtime follows them over the
rule. The real-model case (Qwen2.5-Coder-0.5B) is in tests/test_qwen_coder.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_export.calibration.prompt_rows import TWO_ROWS_PAY
from adaptive_export.commands.cli import main
from adaptive_export.runtimes.decode_policy import MIN_CODE_CHARS, code_chars, prompt_policy
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import PromptRows

CODE = "def total(items):\n    x = 0\n    for i in items:\n        x += i.price\n    return x  # sum\n"
EDIT = f"Fix:\n```\n{CODE}```"  # short: the tiny bundle's tokenizer spends a token per character or two
CHAT = "Explain in two sentences what a hash map is."


def test_a_fenced_block_of_code_makes_an_edit_prompt() -> None:
    assert code_chars(EDIT) == len(CODE.strip()) >= MIN_CODE_CHARS
    assert prompt_policy(EDIT).rows == 2 and prompt_policy(EDIT).name == "lookup"
    assert prompt_policy(CHAT).rows == 1 and prompt_policy(CHAT).name == "plain"
    assert prompt_policy("```\nx = 1\n```").name == "plain"  # too short to be worth two rows
    assert prompt_policy(f"Fix:\n```\n{CODE}").name == "lookup"  # an unclosed fence runs to the end


def test_measured_rows_decide_over_the_rule() -> None:
    measured = PromptRows({"edit": 1, "chat": 2})
    assert prompt_policy(EDIT, measured=measured) == prompt_policy(EDIT, measured=measured)  # deterministic
    edit, chat = prompt_policy(EDIT, measured=measured), prompt_policy(CHAT, measured=measured)
    assert (edit.rows, edit.name, edit.kind, edit.calibrated) == (1, "plain", "edit", True)
    assert (chat.rows, chat.name, chat.kind, chat.calibrated) == (2, "lookup", "chat", True)
    assert prompt_policy(CHAT, guessing=True, measured=measured).name == "head"
    only_edit = prompt_policy(CHAT, measured=PromptRows({"edit": 2}))  # a kind not measured: the rule
    assert (only_edit.rows, only_edit.calibrated) == (1, False)


@pytest.mark.parametrize("value", [0, 3, -1, "2", 2.0, True, None, [2]])
def test_a_hostile_prompt_rows_value_is_refused(value: object) -> None:
    with pytest.raises(UsageError, match="prompt_rows.chat must be 1 or 2"):
        PromptRows.from_json({"edit": 2, "chat": value})
    with pytest.raises(UsageError, match="'prompt_rows' has the wrong type"):
        PromptRows.from_json([2, 1])


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


def test_build_measures_the_rows_and_the_default_run_follows_them(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The default build prices two-row decoding per kind on its own engines; each kind's run
    takes the recorded rows, and `--mode ar` the same rows, so their tokens agree."""
    bundle = tmp_path / "measured"
    assert main(["build", str(tiny_model_dir), "-o", str(bundle), "--max-len", "512"]) == 0
    assert "decode rows per prompt kind: edit" in capsys.readouterr().out
    section = json.loads((bundle / "manifest.json").read_text())["prompt_rows"]
    measured = section["measured"]
    assert measured["prompts"] == {"edit": 4, "chat": 4} and set(measured["pass_cost"]) == {"1", "2", "3", "4"}
    for kind, prompt in (("edit", EDIT), ("chat", CHAT)):
        growing, floor = measured["cost_per_token"][kind], measured["floor_cost_per_token"][kind]
        assert section[kind] == (2 if min(growing, floor) <= TWO_ROWS_PAY else 1)
        if section[kind] == 2:
            assert section["decoders"][kind] == ("growing" if growing <= floor else "floor")
        default, ar = (run_json(capsys, bundle, prompt, *m) for m in ((), ("--mode", "ar")))
        stats = default["stats"]
        assert (stats["prompt_kind"], stats["policy_calibrated"], stats["decode_rows"]) == (kind, True, section[kind])
        assert ar["stats"]["decode_rows"] == section[kind] and default["tokens"] == ar["tokens"]
        if section[kind] == 2:
            assert sum(stats["passes_by_rows"].values()) == stats["rounds"] >= 1
    rule = tmp_path / "rule"
    assert main(["build", str(tiny_model_dir), "-o", str(rule), "--max-len", "256", "--prompt-rows", "rule"]) == 0
    assert "prompt_rows" not in json.loads((rule / "manifest.json").read_text())
