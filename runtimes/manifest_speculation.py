"""The manifest's `speculation` section, typed: what calibration chose and measured per draft source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.draft_registry import DRAFT_SOURCES, RENAMED_SOURCES
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest_fields import JsonObject, extras, is_int, is_number, need, ordered

_SOURCE_KEYS = ("draft_len", "draft_cost", "verify_cost", "verify_cost_prepacked")
EXACTNESS_KEY = "verify_exactness"
MULTI_ROW_KEY = "multi_row_exactness"
MIN_ROWS_KEY = "min_decode_rows"
MAX_PLAIN_ROWS = 2  # plain passes of the token alone (1) or of the token and one guess (2)
# A verify pass is exact when one T=k+1 pass lands within this fraction of the largest |logit| of
# k+1 T=1 passes over the same tokens. Float reordering alone (fp32, MatMulNBits accuracy 1) stays
# at 1e-7..1e-6 of it; one int8 rounding that tips the other way at accuracy 4 moves it by 1e-3 and
# more (docs/speculation.md, "Why accuracy-4 verification differs"): 1e-4 sits between the two.
EXACT_RELATIVE_DIFF = 1e-4
_MAX_LOGIT = 1e6
_MAX_ROWS = 1_000_000  # verify rows compared


def _is_cost(value: Any) -> bool:
    return is_number(value) and 0 < value < 1e6


@dataclass(frozen=True)
class SourceSpeculation:
    """What calibration measured for one draft source: its draft length and its costs in T=1
    decode passes (a drafting step; a verify pass by draft length, as measured without and
    with ONNX Runtime's prepacked weights)."""

    draft_len: int | None = None
    draft_cost: float | None = None
    verify_cost: Mapping[str, float] | None = None
    verify_cost_prepacked: Mapping[str, float] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    def verify_costs(self, prepacked: bool) -> Mapping[str, float]:
        return (self.verify_cost_prepacked if prepacked else self.verify_cost) or {}

    @classmethod
    def from_json(cls, source: str, obj: Any) -> SourceSpeculation:
        need(isinstance(obj, dict), f"speculation.{source} must be an object")
        draft_len, draft_cost = obj.get("draft_len"), obj.get("draft_cost")
        need(
            draft_len is None or (is_int(draft_len) and 1 <= draft_len <= limits.MAX_DRAFT_LEN),
            f"speculation.{source}.draft_len must be an integer in 1..{limits.MAX_DRAFT_LEN}",
        )
        need(
            draft_cost is None or (is_number(draft_cost) and 0 < draft_cost < 1e6),
            f"speculation.{source}.draft_cost must be a positive number",
        )
        for key in ("verify_cost", "verify_cost_prepacked"):
            costs = obj.get(key)
            need(
                costs is None
                or (isinstance(costs, dict) and all(isinstance(k, str) and _is_cost(v) for k, v in costs.items())),
                f"speculation.{source}.{key} must map draft lengths to positive numbers",
            )  # fmt: skip
        return cls(
            draft_len, draft_cost, obj.get("verify_cost"), obj.get("verify_cost_prepacked"),
            extras(obj, _SOURCE_KEYS), tuple(obj),
        )  # fmt: skip

    def to_json(self) -> JsonObject:
        values = {key: getattr(self, key) for key in _SOURCE_KEYS if getattr(self, key) is not None}
        return ordered({**values, **self.extra}, self.key_order)


def _is_logit_gap(value: Any) -> bool:
    return is_number(value) and 0 <= value < _MAX_LOGIT


@dataclass(frozen=True)
class VerifyExactness:
    """Whether the decode engine's verify pass reproduces plain steps, measured at build time: the
    largest |logit| difference between one T=k+1 pass and k+1 plain passes over the same tokens, the
    largest |logit| of those passes (the scale), how many rows' argmax differed and the largest
    plain top-1 margin among them. `plain_rows`: the rows of each plain pass, 1 (the token alone) or
    2 (the token and one guess, whose row is not compared: runtimes/speculative.py's floor rounds).
    `run --mode auto` drafts only where the plain passes it runs are reproduced (`exact`)."""

    max_logit_diff: float
    logit_scale: float
    top1_flips: int
    worst_flip_margin: float
    plain_rows: int = 1

    @property
    def exact(self) -> bool:
        return self.max_logit_diff <= EXACT_RELATIVE_DIFF * self.logit_scale

    @classmethod
    def from_json(cls, obj: Any, where: str = f"speculation.{EXACTNESS_KEY}") -> VerifyExactness:
        need(isinstance(obj, dict), f"{where} must be an object")
        for key in ("max_logit_diff", "logit_scale", "worst_flip_margin"):
            need(_is_logit_gap(obj.get(key)), f"{where}.{key} must be a number in [0, {_MAX_LOGIT:g})")
        flips = obj.get("top1_flips")
        need(is_int(flips) and 0 <= flips <= _MAX_ROWS, f"{where}.top1_flips is out of range")
        need(isinstance(obj.get("exact"), bool), f"{where}.exact must be true or false")
        rows = obj.get("plain_rows", 1)
        need(is_int(rows) and 1 <= rows <= MAX_PLAIN_ROWS, f"{where}.plain_rows must be 1 or {MAX_PLAIN_ROWS}")
        measured = cls(
            float(obj["max_logit_diff"]), float(obj["logit_scale"]), flips, float(obj["worst_flip_margin"]), rows
        )
        need(
            obj["exact"] == measured.exact,
            f"{where}.exact contradicts its max_logit_diff (exact means at most {EXACT_RELATIVE_DIFF:g} x logit_scale)",
        )
        return measured

    def to_json(self) -> JsonObject:
        return {
            "max_logit_diff": self.max_logit_diff,
            "logit_scale": self.logit_scale,
            "top1_flips": self.top1_flips,
            "worst_flip_margin": self.worst_flip_margin,
            "exact": self.exact,
            **({"plain_rows": self.plain_rows} if self.plain_rows != 1 else {}),
        }


def _refuse_renamed_sources(obj: Mapping[str, Any]) -> None:
    """A bundle written before a source's rename names it the old way; its engines carry the
    old role name too, so reading it would mean a second name for everything: rebuild instead."""
    for old, new in RENAMED_SOURCES.items():
        if old in obj or obj.get("source") == old:
            raise UsageError(
                f"this bundle names draft source {old!r}, which is now {new!r}",
                "rebuild the bundle with this version of adaptive-export",
            )


@dataclass(frozen=True)
class Speculation:
    """The calibrated draft source, whether `run --mode auto` uses it, each source's measurements,
    whether the decode engine's verify pass reproduces T=1 steps (`verify_exactness`) and
    two-row steps (`multi_row_exactness`; None: not measured), and `min_decode_rows`: every decode
    pass of this bundle runs at least that many rows, so its plain steps are the computation its
    verify passes make (docs/speculation.md, "Exact speculation at accuracy 4"); other keys (exit
    layer, expected speedups, adapter) are kept for tools."""

    source: str | None = None
    auto_enabled: bool = False
    sources: Mapping[str, SourceSpeculation] = field(default_factory=dict)
    verify_exactness: VerifyExactness | None = None
    multi_row_exactness: VerifyExactness | None = None
    min_decode_rows: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    def of(self, source: str) -> SourceSpeculation:
        """A source's measurements (empty where calibration recorded none)."""
        return self.sources.get(source) or SourceSpeculation()

    @classmethod
    def from_json(cls, obj: Any) -> Speculation | None:
        if obj is None:
            return None
        need(isinstance(obj, dict), "key 'speculation' has the wrong type")
        _refuse_renamed_sources(obj)
        need(
            obj.get("source") is None or obj["source"] in DRAFT_SOURCES,
            "speculation.source is not a known draft source",
        )
        need(isinstance(obj.get("auto_enabled", False), bool), "speculation.auto_enabled must be true or false")
        sources = {
            name: SourceSpeculation.from_json(name, obj[name]) for name in DRAFT_SOURCES if obj.get(name) is not None
        }
        exactness = obj.get(EXACTNESS_KEY)
        measured = None if exactness is None else VerifyExactness.from_json(exactness)
        multi_row = _multi_row_exactness(obj)
        known = ("source", "auto_enabled", EXACTNESS_KEY, MULTI_ROW_KEY, MIN_ROWS_KEY, *sources)
        return cls(
            obj.get("source"), obj.get("auto_enabled", False), sources, measured, multi_row,
            obj.get(MIN_ROWS_KEY, 1), extras(obj, known), tuple(obj),
        )  # fmt: skip

    def to_json(self) -> JsonObject:
        values: JsonObject = {"source": self.source, "auto_enabled": self.auto_enabled}
        values.update({name: section.to_json() for name, section in self.sources.items()})
        if self.verify_exactness is not None:
            values[EXACTNESS_KEY] = self.verify_exactness.to_json()
        if self.multi_row_exactness is not None:
            values[MULTI_ROW_KEY] = self.multi_row_exactness.to_json()
        if self.min_decode_rows != 1:
            values[MIN_ROWS_KEY] = self.min_decode_rows
        return ordered({**values, **self.extra}, self.key_order)


def _multi_row_exactness(obj: Mapping[str, Any]) -> VerifyExactness | None:
    """The two-row measurement, and `min_decode_rows`, which may be 2 only where that measurement
    says a verify pass reproduces two-row steps (a bundle never promises what it did not measure)."""
    where = f"speculation.{MULTI_ROW_KEY}"
    found = obj.get(MULTI_ROW_KEY)
    measured = None if found is None else VerifyExactness.from_json(found, where)
    need(measured is None or measured.plain_rows == 2, f"{where}.plain_rows must be 2")
    rows = obj.get(MIN_ROWS_KEY, 1)
    need(is_int(rows) and 1 <= rows <= MAX_PLAIN_ROWS, f"speculation.{MIN_ROWS_KEY} must be 1 or {MAX_PLAIN_ROWS}")
    need(
        rows == 1 or (measured is not None and measured.exact),
        f"speculation.{MIN_ROWS_KEY} is 2 without an exact {MULTI_ROW_KEY} measurement",
    )
    return measured
