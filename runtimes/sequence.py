"""The state of the one sequence being generated (docs/architecture.md sections 4 and 6)."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry


@dataclass
class SequenceState:
    """Mutable state of one sequence: the arena, the chosen configuration, emitted tokens.

    `pending` is the newest token: emitted, not yet in the cache (its KV is written by the
    next step or verify pass, which takes it as its first input)."""

    arena: KVArena
    config: ConfigEntry
    prompt_ids: list[int]
    tokens: list[int]
    pending: int
