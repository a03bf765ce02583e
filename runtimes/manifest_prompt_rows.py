"""The manifest's `prompt_rows` section, typed: the rows each kind of prompt decodes on, as `build`
measured them (calibration/prompt_rows.py), and the measurements behind the choice for tools."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_export.runtimes.manifest_fields import JsonObject, extras, is_int, need, ordered

PROMPT_KINDS = ("edit", "chat")  # runtimes/decode_policy.py `prompt_kind`
ROW_CHOICES = (1, 2)  # one-row plain steps, or two-row passes that speculate exactly


@dataclass(frozen=True)
class PromptRows:
    """Rows of every decode pass per prompt kind; a kind the build did not measure keeps the
    runtime's fixed rule. `extra`: what the build measured (pass costs, cost per token), for tools."""

    rows: Mapping[str, int]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def of(self, kind: str) -> int | None:
        return self.rows.get(kind)

    @classmethod
    def from_json(cls, obj: Any) -> PromptRows | None:
        if obj is None:
            return None
        need(isinstance(obj, dict), "key 'prompt_rows' has the wrong type")
        rows = {kind: obj[kind] for kind in PROMPT_KINDS if kind in obj}
        for kind, value in rows.items():
            need(is_int(value) and value in ROW_CHOICES, f"prompt_rows.{kind} must be 1 or 2")
        return cls(rows, extras(obj, PROMPT_KINDS))

    def to_json(self) -> JsonObject:
        return ordered({**self.rows, **self.extra}, PROMPT_KINDS)
