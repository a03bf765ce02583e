"""The manifest's `prompt_rows` section, typed: the rows and decoder each kind of prompt decodes
with, as `build` measured them (calibration/prompt_rows.py), and the counts and machine behind the
choice, which let `run` make it again on another machine (runtimes/rows_recheck.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_export.runtimes.machine import MAX_NAME, MachineId
from adaptive_export.runtimes.manifest_fields import JsonObject, extras, is_int, need, ordered
from adaptive_export.runtimes.rows_choice import KindCounts

PROMPT_KINDS = ("edit", "chat")  # runtimes/decode_policy.py `prompt_kind`
ROW_CHOICES = (1, 2)  # one-row plain steps, or two-row passes that speculate exactly
TWO_ROW_DECODERS = ("growing", "floor")  # the default's lookup growing its drafts, or ar's floor rounds
MAX_ROWS = 64  # widest pass a count may name
MAX_COUNT = 10_000_000


@dataclass(frozen=True)
class PromptRows:
    """Rows of every decode pass per prompt kind, and for two rows which decoder ("growing" where
    not recorded); a kind the build did not measure keeps the runtime's fixed rule. `counts` and
    `machine`: the build's pass counts and where it timed them (None in older bundles); `extra`:
    the rest of what it measured, for tools."""

    rows: Mapping[str, int]
    decoders: Mapping[str, str] = field(default_factory=dict)
    counts: Mapping[str, KindCounts] | None = None
    machine: MachineId | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def of(self, kind: str) -> int | None:
        return self.rows.get(kind)

    def decoder_of(self, kind: str) -> str:
        """ "plain", "floor" or "growing" for a measured kind."""
        if self.rows.get(kind) == 1:
            return "plain"
        return self.decoders.get(kind, "growing")

    @classmethod
    def from_json(cls, obj: Any) -> PromptRows | None:
        if obj is None:
            return None
        need(isinstance(obj, dict), "key 'prompt_rows' has the wrong type")
        rows = {kind: obj[kind] for kind in PROMPT_KINDS if kind in obj}
        for kind, value in rows.items():
            need(is_int(value) and value in ROW_CHOICES, f"prompt_rows.{kind} must be 1 or 2")
        decoders = obj.get("decoders", {})
        need(isinstance(decoders, dict), "prompt_rows.decoders must be an object")
        for kind, value in decoders.items():
            need(kind in rows and rows[kind] == 2, f"prompt_rows.decoders names {str(kind)[:40]!r}, no two-row kind")
            need(value in TWO_ROW_DECODERS, f"prompt_rows.decoders.{kind} must be one of {', '.join(TWO_ROW_DECODERS)}")
        measured = obj.get("measured", {})
        need(isinstance(measured, dict), "prompt_rows.measured must be an object")
        counts = _counts(measured) if "passes" in measured else None
        machine = _machine(measured["machine"]) if "machine" in measured else None
        return cls(rows, dict(decoders), counts, machine, extras(obj, (*PROMPT_KINDS, "decoders")))

    def to_json(self) -> JsonObject:
        decoders = {"decoders": dict(self.decoders)} if self.decoders else {}
        return ordered({**self.rows, **decoders, **self.extra}, PROMPT_KINDS)


def _passes(obj: Any, where: str) -> dict[int, int]:
    need(isinstance(obj, dict) and len(obj) <= MAX_ROWS, f"{where} must be an object of rows -> passes")
    passes = {}
    for rows, count in obj.items():
        need(
            isinstance(rows, str) and rows.isdigit() and 1 <= int(rows) <= MAX_ROWS,
            f"{where} names rows {str(rows)[:20]!r}",
        )
        need(is_int(count) and 0 <= count <= MAX_COUNT, f"{where}.{rows} must be a count")
        passes[int(rows)] = count
    return passes


def _counts(measured: Mapping[str, Any]) -> dict[str, KindCounts]:
    """measured.passes[kind] = {growing: {rows: n}, floor: {rows: n}}, with tokens and prompts per kind."""
    passes, tokens, prompts = measured["passes"], measured.get("tokens", {}), measured.get("prompts", {})
    floor_tokens = measured.get("floor_tokens", {})
    for key, value in (("passes", passes), ("tokens", tokens), ("prompts", prompts), ("floor_tokens", floor_tokens)):
        need(isinstance(value, dict), f"prompt_rows.measured.{key} must be an object")
    counts = {}
    for kind, entry in passes.items():
        need(kind in PROMPT_KINDS and isinstance(entry, dict), f"prompt_rows.measured.passes names {str(kind)[:40]!r}")
        need(
            is_int(tokens.get(kind)) and 0 <= tokens[kind] <= MAX_COUNT,
            f"prompt_rows.measured.tokens.{kind} must be a count",
        )
        need(
            is_int(prompts.get(kind)) and 0 <= prompts[kind] <= MAX_COUNT,
            f"prompt_rows.measured.prompts.{kind} must be a count",
        )
        where = f"prompt_rows.measured.passes.{kind}"
        growing = _passes(entry.get("growing"), f"{where}.growing")
        floor = _passes(entry.get("floor", {}), f"{where}.floor")
        own = floor_tokens.get(kind, 0) if floor else 0
        need(is_int(own) and 0 <= own <= MAX_COUNT, f"prompt_rows.measured.floor_tokens.{kind} must be a count")
        counts[kind] = KindCounts(kind, prompts[kind], tokens[kind], growing, floor, own)
    return counts


def _machine(obj: Any) -> MachineId:
    need(isinstance(obj, dict), "prompt_rows.measured.machine must be an object")
    cpu, flags, cpus, threads = obj.get("cpu"), obj.get("flags"), obj.get("cpus"), obj.get("threads")
    need(isinstance(cpu, str) and len(cpu) <= MAX_NAME, "prompt_rows.measured.machine.cpu must be a short string")
    need(isinstance(flags, str) and len(flags) <= 400, "prompt_rows.measured.machine.flags must be a short string")
    need(is_int(cpus) and 1 <= cpus <= 4096, "prompt_rows.measured.machine.cpus must be a CPU count")
    need(is_int(threads) and 1 <= threads <= 4096, "prompt_rows.measured.machine.threads must be a thread count")
    return MachineId(cpu, flags, cpus, threads)
