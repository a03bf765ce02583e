"""Save the tokenizer as tokenizer.json and flatten the chat template for a Jinja-free runtime.

The runtime depends only on `tokenizers`, so the chat template is rendered here once
around a sentinel message and stored as the text before and after the user's prompt.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError
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


RENDER_TIMEOUT_S = 2.0  # a real template renders in milliseconds; a refusal costs this beyond start-up
RENDER_MEMORY_BYTES = 1 << 30  # what the rendering child may allocate beyond the build's own size
_CHATS: weakref.WeakKeyDictionary[Any, tuple[Any, dict[str, str]]] = weakref.WeakKeyDictionary()


def chat_format(tokenizer: Any) -> dict[str, str] | None:
    """{prefix, suffix} around a single user message, with the generation prompt; None if no template.

    The template comes with the model, so it may be hostile: it is rendered (by the tokenizer's
    own sandboxed Jinja) in a forked child bounded in time and memory, and a template that loops,
    fails or renders more than the runtime accepts is one UsageError. Rendered once per tokenizer."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    with contextlib.suppress(KeyError, TypeError):
        cached_template, chat = _CHATS[tokenizer]
        if cached_template == template:
            return chat
    rendered = _render_bounded(
        lambda: tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
    )
    prefix, _, suffix = rendered.partition(_SENTINEL)
    if len(prefix) + len(suffix) > limits.MAX_CHAT_AFFIX_CHARS:  # the runtime would refuse the bundle
        raise _template_error(f"renders more than {limits.MAX_CHAT_AFFIX_CHARS} characters around the message")
    chat = {"prefix": prefix, "suffix": suffix}
    with contextlib.suppress(TypeError):
        _CHATS[tokenizer] = (template, chat)
    return chat


def _template_error(problem: str) -> UsageError:
    return UsageError(
        f"the model's chat template {problem}",
        "fix or remove chat_template in the model's tokenizer_config.json (or the GGUF's tokenizer.chat_template)",
    )


def _render_bounded(render: Callable[[], str]) -> str:
    """render() in a forked child with a deadline and a memory cap; its text, or a UsageError."""
    if not hasattr(os, "fork"):  # no fork (Windows): the sandbox alone
        return render()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, send JSON, exit without running any of the parent's cleanup
        os.close(read_end)
        _child_render(render, write_end)
    os.close(write_end)
    try:
        payload = _read_until(read_end, time.monotonic() + RENDER_TIMEOUT_S, 8 * limits.MAX_CHAT_AFFIX_CHARS + 4096)
    finally:
        os.close(read_end)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if payload is None:
        raise _template_error(f"did not render within {RENDER_TIMEOUT_S:g} s or rendered too much (a loop?)")
    try:
        result = json.loads(payload)
    except ValueError:
        result = {"error": "its renderer died (out of memory?)"}
    if "text" not in result:
        raise _template_error(f"fails to render: {str(result.get('error'))[:200]}")
    return str(result["text"])


def _child_render(render: Callable[[], str], write_end: int) -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _cap_memory()
        payload = json.dumps({"text": render()})
    except BaseException as exc:  # whatever the template raised goes back as text
        payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"[:300]})
    try:
        with os.fdopen(write_end, "w", encoding="utf-8") as out:
            out.write(payload)
    finally:
        os._exit(0)


def _cap_memory() -> None:
    """Limit the child's address space to its current size plus RENDER_MEMORY_BYTES (Linux)."""
    try:
        import resource

        with open("/proc/self/status", encoding="ascii") as status:
            size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
        limit = size_kb * 1024 + RENDER_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (OSError, ValueError, StopIteration, ImportError):
        pass


def _read_until(fd: int, deadline: float, max_bytes: int) -> bytes | None:
    """Everything the child writes before it closes the pipe; None past the deadline or max_bytes."""
    chunks: list[bytes] = []
    total = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            return None


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
