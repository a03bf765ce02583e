"""Save the tokenizer as tokenizer.json and flatten the chat template for a Jinja-free runtime.

The runtime depends only on `tokenizers`, so the chat template is rendered here once
around a sentinel message and stored as the text before and after the user's prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptive_export.runtimes.tokenizer_policy import TokenizerRules, check_tokenizer_json, tokenizers_guard

_SENTINEL = "\x00ADAPTIVE_EXPORT_PROMPT\x00"
_PROBE_TEXT = "Hello, world! 123"  # encoded once: a tokenizer that panics on plain text is refused here
_MODEL_FIX = "use a model whose tokenizer stays within the bounds in runtimes/limits.py (docs/hardening.md)"


def save_tokenizer(tokenizer: Any, path: Path, vocab_size: int) -> None:
    """Write tokenizer.json only if the runtime would load it: the same rules
    (runtimes/tokenizer_policy.py), then the same `tokenizers` load, a panic being bad input."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise ValueError("the model's tokenizer has no fast (tokenizers) backend to save as tokenizer.json")
    from tokenizers import Tokenizer

    with tokenizers_guard("serializing the model's tokenizer", _MODEL_FIX):
        text = backend.to_str(pretty=True)  # what backend.save wrote
    data = text.encode("utf-8")
    check_tokenizer_json(data, TokenizerRules(vocab_size, _MODEL_FIX))
    with tokenizers_guard("loading the model's tokenizer.json as the runtime will", _MODEL_FIX):
        Tokenizer.from_str(text).encode(_PROBE_TEXT)
    path.write_bytes(data)


def chat_format(tokenizer: Any) -> dict[str, str] | None:
    """{prefix, suffix} around a single user message, with the generation prompt; None if no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
    )
    prefix, _, suffix = rendered.partition(_SENTINEL)
    return {"prefix": prefix, "suffix": suffix}


def special_tokens(tokenizer: Any, hf_model: Any) -> dict[str, Any]:
    """EOS ids from the generation config and the tokenizer; whether a BOS must be prepended."""
    eos: list[int] = []
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and token not in eos:
                eos.append(token)
    with tokenizers_guard("encoding a probe", _MODEL_FIX):
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    prepended = probe[: len(probe) - len(bare)] if probe[-len(bare) :] == bare else []
    return {"eos_token_ids": eos, "prefix_token_ids": prepended}
