"""The decoding policy, chosen at prefill from the prompt (issue #37 item 1).

An answer that rewrites code given in the prompt (rename, fix, add types) copies long spans of it,
so prompt lookup drafts them and exact speculation over two-row passes pays: 0.55x plain TPOT
on Qwen2.5-Coder-0.5B's edit prompts (issue #37, Xeon), 0.86x on SmolLM2's rewrite prompts
(Zen 3). An open question copies nothing, and a two-row pass costs 1.1-1.3 one-row passes, so
there plain one-row steps win. The runtime picks per request, before the first decode step,
from the prompt alone (deterministic): two rows with prompt lookup where the prompt holds a
fenced code block of at least `MIN_CODE_CHARS`, else one row, or two where the bundle's decode
graph guesses the next token itself (an EAGLE head: every floor round then drafts its guess).
`--mode ar` decodes with the same rows, so the default run's tokens equal `--mode ar`'s for every
prompt.

Whether two rows pay for a kind of prompt depends on the CPU (what a T=2 pass costs against T=1:
1.05 on Zen 4 with AVX-512 VNNI, 1.16-1.27 on Zen 3) and on the model, so `build` measures it on the
built engines (calibration/prompt_rows.py) and records the rows per kind in the manifest's
`prompt_rows`; the rule above is what a bundle without that measurement gets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from adaptive_export.runtimes.manifest_prompt_rows import PromptRows

MIN_CODE_CHARS = 80  # a fenced block this long is what an edit answer reproduces (~20+ tokens)
FENCED = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class DecodePolicy:
    """Rows of every decode pass of one request, and why: "lookup" (two rows, prompt-lookup
    speculation under auto), "head" (two rows drafting the decode graph's own guess), "plain" (one
    row) or "fixed" (the caller's or the bundle's rows, which the prompt does not change); `kind`:
    the prompt's kind ("edit", "chat"; "" where the prompt was not read) and `calibrated`: whether
    the bundle's measured rows for that kind decided."""

    rows: int
    name: str
    kind: str = ""
    calibrated: bool = False
    measured_on: str = ""  # where the calibrated choice's pass costs were timed (runtimes/rows_recheck.py)

    def to_json(self) -> dict[str, Any]:
        """The policy as `run --json` and the server's stats report it."""
        return {
            "decode_rows": self.rows,
            "policy": self.name,
            "prompt_kind": self.kind,
            "policy_calibrated": self.calibrated,
            "policy_measured_on": self.measured_on,
        }


def code_chars(prompt: str) -> int:
    """Characters of the longest fenced code block in the prompt (an unclosed fence runs to the end)."""
    return max((len(block.strip()) for block in FENCED.findall(prompt)), default=0)


def prompt_kind(prompt: str) -> str:
    """ "edit" where the prompt holds code an answer would copy (a fenced block of MIN_CODE_CHARS), else "chat"."""
    return "edit" if code_chars(prompt) >= MIN_CODE_CHARS else "chat"


def prompt_policy(
    prompt: str, guessing: bool = False, measured: PromptRows | None = None, measured_on: str = ""
) -> DecodePolicy:
    """The policy a prompt gets when neither the caller nor the bundle fixes the rows: the rows and
    decoder `build` measured for the prompt's kind where it did (made again for this machine:
    runtimes/rows_recheck.py), else the fixed rule. `guessing`: the bundle's decode graph guesses
    the next token itself (an EAGLE head, runtimes/drafting/eagle.py), so every floor round of two
    rows drafts its guess ("head" where no code block would be copied). "floor": two rows where
    growing lookup measured no cheaper than `--mode ar`'s floor rounds, which the default then runs."""
    kind = prompt_kind(prompt)
    rows = measured.of(kind) if measured is not None else None
    calibrated = rows is not None
    where = measured_on if calibrated else ""
    if rows is None:
        rows = 2 if kind == "edit" or guessing else 1
    if rows == 1:
        return DecodePolicy(1, "plain", kind, calibrated, where)
    if measured is not None and calibrated and measured.decoder_of(kind) == "floor":
        return DecodePolicy(2, "floor", kind, calibrated, where)
    return DecodePolicy(2, "head" if guessing and kind == "chat" else "lookup", kind, calibrated, where)
