"""The bundle's tokenizer against the reference model's own: `check` gates the text a user sees too.

Engine parity runs on token ids, so a tokenizer.json whose decoder rewrites text, a vocabulary
with two ids swapped, or a chat prefix carrying a hidden system prompt would pass every engine
check while `run` prints what the bundle's author chose. Each is compared here with what the
reference model's tokenizer does (docs/hardening.md, "check as a CI gate").
"""

from __future__ import annotations

import json
from typing import Any

from adaptive_export.exporter.tokenizer_export import chat_format, special_tokens
from adaptive_export.runtimes.manifest import ChatFormat
from adaptive_export.runtimes.text import TextCodec
from adaptive_export.runtimes.tokenizer_policy import tokenizers_guard

# a fixed set: Latin with accents, Greek, Cyrillic, CJK, Hangul, right-to-left scripts, code,
# digits and numbers, emoji (skin tone, flag, ZWJ family), and runs of spaces, tabs and newlines
TOKENIZER_TEXTS = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris.",
    "Größenwahn, naïve café, déjà vu; ¿Dónde está? Ελληνικά και русский текст.",
    "日本語のテキストと中文文本，한국어 문장도 있습니다。",
    "مرحبا بالعالم — שלום עולם",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\tif x != 0: {'a': [1, 2]}",
    "3.14159 2026-11-25 1234567890 0x1F +42 -7 1e-9 100,000.50",
    "emoji 🙂👍🏽🇫🇷 👨\u200d👩\u200d👧 ✨",
    "  leading and trailing  \t\t tabs   \n\n\n  newlines\r\n  end   ",
)
# tokenizer.json sections that decide ids and text (padding and truncation the runtime does not use)
_SECTIONS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")
_FIX = "rebuild the bundle from the reference model"


def _shown(value: Any, limit: int = 60) -> str:
    """A bounded, escaped rendering for a report line (bundle text is never printed raw)."""
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_problems(bundle_tokenizer: Any, reference_tokenizer: Any) -> list[str]:
    ours, theirs = json.loads(bundle_tokenizer.to_str()), json.loads(reference_tokenizer.to_str())
    differing = [s for s in _SECTIONS if ours.get(s) != theirs.get(s)]
    return [f"tokenizer.json's {', '.join(differing)}: not the reference tokenizer's"] if differing else []


def _text_problems(codec: TextCodec, reference_tokenizer: Any) -> list[str]:
    """Encode and decode of TOKENIZER_TEXTS by both tokenizers (no special tokens added)."""
    problems = []
    for text in TOKENIZER_TEXTS:
        expected = reference_tokenizer.encode(text, add_special_tokens=False).ids
        actual = codec.tokenizer.encode(text, add_special_tokens=False).ids
        if actual != expected:
            at = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
            problems.append(f"encoding {_shown(text, 30)} differs from the reference at token {at}")
        decoded, reference_text = codec.decode(expected), reference_tokenizer.decode(expected, skip_special_tokens=True)
        if decoded != reference_text:
            at = next((i for i, (a, b) in enumerate(zip(decoded, reference_text)) if a != b), len(decoded))
            start = max(0, at - 8)  # the difference with a little context before it
            problems.append(
                f"decoding {_shown(text, 30)} gives {_shown(decoded[start : at + 24])} at character {at}, "
                f"the reference {_shown(reference_text[start : at + 24])}"
            )
    return problems


def _special_problems(codec: TextCodec, reference: Any, hf_model: Any) -> list[str]:
    """bos/eos/pad ids and strings, and the ids the manifest adds (EOS set, BOS prefix)."""
    problems = []
    for name in ("bos", "eos", "pad"):
        token, token_id = getattr(reference, f"{name}_token", None), getattr(reference, f"{name}_token_id", None)
        if not isinstance(token, str) or not isinstance(token_id, int):
            continue
        ours_id, ours_token = codec.tokenizer.token_to_id(token), codec.tokenizer.id_to_token(token_id)
        if ours_id != token_id or ours_token != token:
            problems.append(
                f"{name} token: the reference's is {_shown(token)} = {token_id}, the bundle maps "
                f"{_shown(token)} to {ours_id} and {token_id} to {_shown(ours_token)}"
            )
    expected = special_tokens(reference, hf_model)
    for key, ours in (("eos_token_ids", codec.eos_ids), ("prefix_token_ids", codec.prefix_ids)):
        if sorted(ours) != sorted(expected[key]):
            problems.append(f"the manifest's {key} {sorted(ours)[:8]} are not the reference's {expected[key][:8]}")
    return problems


def _chat_problems(chat: ChatFormat | None, reference: Any) -> list[str]:
    """The chat template rendered by the reference's tokenizer against the stored prefix/suffix."""
    expected = chat_format(reference)
    if expected is None and chat is None:
        return []
    if expected is None or chat is None:
        return [f"the bundle {'has' if chat else 'lacks'} a chat format, the reference's tokenizer does not"]
    return [
        f"the stored chat {part} {_shown(ours)} is not the reference template's {_shown(theirs)}"
        for part, ours, theirs in (
            ("prefix", chat.prefix, expected["prefix"]),
            ("suffix", chat.suffix, expected["suffix"]),
        )
        if ours != theirs
    ]


def tokenizer_problems(codec: TextCodec, reference: Any, hf_model: Any) -> list[str]:
    """Every way the bundle's tokenizer differs from the reference model's (empty: identical)."""
    backend = getattr(reference, "backend_tokenizer", None)
    if backend is None:
        return ["the reference model's tokenizer has no fast (tokenizers) backend to compare with"]
    with tokenizers_guard("comparing the bundle's tokenizer with the reference's", _FIX):
        return (
            _json_problems(codec.tokenizer, backend)
            + _text_problems(codec, backend)
            + _special_problems(codec, reference, hf_model)
            + _chat_problems(codec.chat, reference)
        )
