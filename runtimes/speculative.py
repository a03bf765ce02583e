"""Self-speculative decoding on the shared KV arena (DESIGN.md sections 2 and 4)."""
from __future__ import annotations

from typing import Any

from runtimes.bundle import Bundle


def speculation_available(bundle: Bundle, config: dict[str, Any]) -> bool:
    """True when the configuration has draft and verify engines."""
    engines = config.get("engines", {})
    return "draft" in engines and "verify" in engines
