"""Strict checks of single JSON values, shared by the manifest types (runtimes/manifest.py).

Every failure is a UsageError naming the key, so a corrupt or foreign bundle never reaches
a backend (tests/test_fuzz.py holds this to: UsageError or valid, nothing else).
"""

from __future__ import annotations

import math
import posixpath
import unicodedata
from collections.abc import Mapping
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError

# Untyped JSON, kept only for runtimes/manifest_speculation.py until it moves to `dict[str, object]`
# like the other manifest types' to_json (a value that must be checked before use, never Any).
JsonObject = dict[str, Any]

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def fail(problem: str) -> UsageError:
    return UsageError(f"manifest.json is invalid: {problem}", "rebuild the bundle with `adaptive-export build`")


def need(cond: bool, problem: str) -> None:
    if not cond:
        raise fail(problem)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def is_name(value: Any) -> bool:
    """Graph names and configuration ids: short, printable ASCII, never a path."""
    return isinstance(value, str) and 0 < len(value) <= 128 and set(value) <= _NAME_CHARS and not value.startswith(".")


def need_object(parent: Mapping[str, Any], key: str, where: str) -> None:
    """parent[key] is present and a JSON object."""
    need(key in parent, f"missing key {where}{key!r}")
    need(isinstance(parent.get(key), dict), f"key {where}{key!r} has the wrong type")


def optional_str(obj: Mapping[str, Any], key: str, problem: str) -> str | None:
    value = obj.get(key)
    need(value is None or isinstance(value, str), problem)
    return value


def ordered(values: Mapping[str, object], order: tuple[str, ...]) -> dict[str, object]:
    """values with the keys of `order` first, in that order (the order they were read in)."""
    first = {key: values[key] for key in order if key in values}
    return {**first, **{key: value for key, value in values.items() if key not in first}}


def extras(obj: Mapping[str, Any], known: tuple[str, ...]) -> dict[str, object]:
    """The keys a type does not read, kept verbatim for tools (written back by to_json)."""
    return {key: value for key, value in obj.items() if key not in known}


def path_problem(path: Any) -> str | None:
    """Why a manifest path is unacceptable, or None. Paths are canonical relative POSIX paths
    of printable characters, so one file has exactly one spelling (no aliases such as
    'onnx/./weights.bin') and no name can hide control characters or lone surrogates."""
    if not isinstance(path, str) or not path:
        return "is not a non-empty string"
    if len(path) > limits.MAX_PATH_CHARS:
        return f"is longer than {limits.MAX_PATH_CHARS} characters"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate"
    if any(unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") for ch in path):
        return "holds a control or unassigned character"
    if "\\" in path or path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        return "is not a relative path (absolute paths and backslashes are refused)"
    parts = path.split("/")
    if ".." in parts:
        return "points outside the bundle ('..')"
    if posixpath.normpath(path) != path or any(part in ("", ".", "..") for part in parts):
        return "is not in canonical form (no '.', '..', '//' or trailing '/')"
    return None


def need_path(path: Any, where: str) -> None:
    problem = path_problem(path)
    need(problem is None, f"path {where} {problem}")
