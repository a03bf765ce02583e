"""Prompt files: JSONL prompt sets (calibration, `check --prompts`) and one-prompt text files (`run --prompt-file`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError

JSONL_FIX = 'write one JSON object per line, e.g. {"prompt": "..."}'


def read_prompts(path: str) -> list[str]:
    """JSONL with a 'prompt' field per non-empty line."""
    try:
        lines = (
            limits.read_regular(Path(path), "prompt file", limits.MAX_PROMPT_FILE_BYTES).decode("utf-8").splitlines()
        )
    except UnicodeDecodeError:
        raise UsageError(f"prompt file {path!r} is not UTF-8 text", "save it as UTF-8 JSONL") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"{path}:{number} is not JSON", JSONL_FIX) from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise UsageError(f"{path}:{number} lacks a non-empty string 'prompt' field", JSONL_FIX)
        prompts.append(record["prompt"])
    if not prompts:
        raise UsageError(f"prompt file {path!r} holds no prompts", 'add lines like {"prompt": "..."}')
    return prompts


def hf_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A prompt as the HF tokenizer encodes it for generation: inside the chat template (with
    the generation prompt) where the tokenizer has one, else raw text with its special tokens
    (a base model's BOS). The runtime's TextCodec encodes the same ids from the bundle."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
    else:
        ids = tokenizer(prompt, add_special_tokens=True)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def read_prompt_file(path: str) -> str:
    """A regular UTF-8 file of at most MAX_PROMPT_FILE_BYTES (FIFOs and devices such as /dev/zero are refused)."""
    try:
        return limits.read_regular(Path(path), "prompt file", limits.MAX_PROMPT_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"prompt file {path!r} is not valid UTF-8", "save it as UTF-8") from None
