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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_CODE_CHARS = 80  # a fenced block this long is what an edit answer reproduces (~20+ tokens)
FENCED = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class DecodePolicy:
    """Rows of every decode pass of one request, and why: "lookup" (an edit prompt: two rows,
    prompt-lookup speculation under auto), "plain" (one row) or "fixed" (the caller's or the
    bundle's rows, which the prompt does not change)."""

    rows: int
    name: str


def code_chars(prompt: str) -> int:
    """Characters of the longest fenced code block in the prompt (an unclosed fence runs to the end)."""
    return max((len(block.strip()) for block in FENCED.findall(prompt)), default=0)


def prompt_policy(prompt: str, guessing: bool = False) -> DecodePolicy:
    """The policy a prompt gets when neither the caller nor the bundle fixes the rows. `guessing`:
    the bundle's decode graph guesses the next token itself (an EAGLE head, runtimes/drafting/eagle.py),
    so every floor round of two rows drafts: two rows for every prompt ("head" where no code block
    would be copied)."""
    if code_chars(prompt) >= MIN_CODE_CHARS:
        return DecodePolicy(2, "lookup")
    return DecodePolicy(2, "head") if guessing else DecodePolicy(1, "plain")
