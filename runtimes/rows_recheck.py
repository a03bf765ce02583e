"""The build's decoding choice, made again where the bundle runs on another machine.

`build` chose each prompt kind's decoder from greedy pass counts and its own machine's pass costs
(runtimes/rows_choice.py). A bundle copied to another CPU keeps the counts (they are the model's)
but not the costs: a two-row pass that cost 1.05 one-row passes where it was built can cost 1.3
here, and the default would then decode slower than `--mode ar`. So where the manifest's machine
is not this one, the first request times the decode engine's passes at the widths the counts name
(about 20 passes; runtimes/pass_costs.py), chooses again, and keeps the timings in the user's
cache keyed by the bundle's files and this machine, so later runs read them instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from adaptive_export.runtimes.backends.base import Backend
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.drafting.prompt_lookup import GROWING_MOST
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.machine import MachineId, this_machine
from adaptive_export.runtimes.manifest_prompt_rows import MAX_ROWS, PromptRows
from adaptive_export.runtimes.pass_costs import VerifyCosts, time_passes
from adaptive_export.runtimes.rows_choice import choose
from adaptive_export.runtimes.user_cache import user_cache_dir

REPEATS = 3  # passes per width, interleaved; the median is kept
MAX_CACHE_BYTES = 16_384
FROM_BUILD, MEASURED_HERE, CACHED_HERE = "build", "this machine", "this machine, cached"


@dataclass(frozen=True)
class RowsOnThisMachine:
    """The prompt rows a Generator decodes with, and where their pass costs were measured."""

    rows: PromptRows | None
    measured_on: str  # FROM_BUILD, MEASURED_HERE, CACHED_HERE; "" where nothing was measured


def rows_here(bundle: Bundle, backend: Backend, arena: KVArena, threads: int) -> RowsOnThisMachine:
    """The manifest's choice where it was made on this machine (or cannot be made again: an older
    bundle without counts); else the choice this machine's pass costs make."""
    measured = bundle.manifest.prompt_rows
    if measured is None or not measured.rows:
        return RowsOnThisMachine(measured, "")
    here = this_machine(threads)
    if measured.counts is None or measured.machine is None or measured.machine == here:
        return RowsOnThisMachine(measured, FROM_BUILD)
    cache = _cache_file(bundle, here)
    costs = _read_cache(cache)
    if costs is not None:
        return RowsOnThisMachine(rechosen(measured, costs), CACHED_HERE)
    widths = {rows for counts in measured.counts.values() for rows in (*counts.growing, *counts.floor)}
    widest = min(GROWING_MOST + 1, bundle.max_len // 4)  # what build times; wider counts are extrapolated
    costs = time_passes(backend, arena, bundle, {w for w in widths if w <= widest} | {1, 2}, REPEATS)
    _write_cache(cache, costs)
    return RowsOnThisMachine(rechosen(measured, costs), MEASURED_HERE)


def rechosen(measured: PromptRows, costs: VerifyCosts) -> PromptRows:
    """Each counted kind's decoder chosen with these pass costs."""
    assert measured.counts is not None
    choices = {kind: choose(counts, costs.of_rows) for kind, counts in measured.counts.items()}
    rows = {**measured.rows, **{kind: c.rows for kind, c in choices.items()}}
    decoders = {kind: c.decoder for kind, c in choices.items() if c.rows == 2}
    return replace(measured, rows=rows, decoders=decoders)


def _cache_file(bundle: Bundle, here: MachineId) -> Path:
    """One file per (bundle files, machine): a rebuilt bundle or another CPU is timed afresh."""
    files = {path: entry.sha256 for path, entry in sorted(bundle.manifest.files.items())}
    key = json.dumps({"files": files, "machine": here.to_json()}, sort_keys=True)
    return user_cache_dir() / "pass-costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _read_cache(path: Path) -> VerifyCosts | None:
    """The cached timings, or None where there are none or they are not what this module writes
    (the cache is the user's own, but a damaged file is timed afresh, never trusted)."""
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(MAX_CACHE_BYTES + 1)[:MAX_CACHE_BYTES])
        costs = VerifyCosts.from_json(data)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    widths_ok = all(1 <= t <= MAX_ROWS for t in costs.pass_ms) and 1 in costs.pass_ms
    values_ok = all(math.isfinite(ms) and ms > 0 for ms in costs.pass_ms.values())
    return costs if widths_ok and values_ok else None


def _write_cache(path: Path, costs: VerifyCosts) -> None:
    """Written whole or not at all; a cache that cannot be written costs the next run a re-timing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(costs.to_json(), handle)
        os.replace(staged, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(staged)
