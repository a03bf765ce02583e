"""`check`: every engine of every backend against PyTorch (exporter/check.py), as a CI gate."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

from adaptive_export.commands import EXIT_MISMATCH, EXIT_OK
from adaptive_export.commands.options import CheckOptions
from adaptive_export.loading.prompts import read_prompts
from adaptive_export.loading.warning_filters import third_party_warnings_hidden
from adaptive_export.runtimes.errors import UsageError

MAX_TOLERANCE = 100.0  # `check --tolerance`: a larger factor would no longer gate anything


def ensure_check_fits(model: str | None, bundle: str) -> None:
    """check's fp32 reference and the bundle's engines must fit in memory: refused before the
    reference loads, not killed while it does."""
    from adaptive_export.exporter.check_structure import rebuild_streams
    from adaptive_export.loading.memory_plan import build_need, check_need, engine_file_bytes, ensure_fits
    from adaptive_export.loading.model import model_fields
    from adaptive_export.loading.model_checks import SIZING_KEYS
    from adaptive_export.runtimes.bundle import load_bundle

    if model is None:
        return  # check itself says the reference is required
    fields = model_fields(model)
    if all(fields.get(key) is not None for key in SIZING_KEYS):
        loaded = load_bundle(bundle)
        rebuild = build_need(fields, "stream" if rebuild_streams(loaded, model) else "full")
        rebuild = replace(rebuild, what="check's rebuild of the engines from --model")
        ensure_fits(max(check_need(fields, engine_file_bytes(loaded.manifest)), rebuild, key=lambda n: n.peak_bytes))


def cmd_check(options: CheckOptions) -> int:
    from adaptive_export.exporter.check import run_check, write_report
    from adaptive_export.runtimes.backends.onnxruntime_backend import available_provider

    if not (
        math.isfinite(options.tolerance) and 0 < options.tolerance <= MAX_TOLERANCE
    ):  # inf or nan would turn the gate off
        raise UsageError(
            f"--tolerance {options.tolerance} must be a finite factor in (0, {MAX_TOLERANCE:g}]",
            "pass a factor such as 1 or 2",
        )
    available_provider(options.provider)  # before the reference model loads (minutes for a large one)
    ensure_check_fits(options.model, options.bundle)
    prompts = read_prompts(options.prompts) if options.prompts else None
    for option, value in (("--report", options.report), ("--junit", options.junit)):  # fail before minutes of checking
        if value:
            parent = Path(value).parent
            if not parent.is_dir() or not os.access(parent, os.W_OK) or Path(value).is_dir():
                raise UsageError(
                    f"{option} {value!r} cannot be written "
                    "(its directory does not exist or is not writable, or it is a directory)",
                    f"pass {option} a file path in a writable directory",
                )
    with third_party_warnings_hidden():  # a CI log shows check's rows, not the libraries' deprecations
        report = run_check(
            options.bundle,
            options.model,
            prompts,
            options.new_tokens,
            options.tolerance,
            expect_precision=options.expect_precision,
            provider=options.provider,
            allow_unrebuilt=options.allow_unrebuilt,
        )
    try:
        write_report(report, options.report, options.junit)
    except OSError as exc:
        raise UsageError(
            f"cannot write the check report: {exc.strerror or exc}", "pass --report/--junit paths you can write to"
        ) from None
    for r in report.results:
        status = "PASS" if r.passed and r.executed else "SKIP" if not r.executed else "FAIL"
        numeric = r.max_abs is not None and r.tolerance is not None and r.check == "parity"
        shown = f" max|diff| {r.max_abs:.2e} (tol {r.tolerance:.1e})" if numeric else ""
        detail = r.detail if status != "PASS" or not numeric or r.check.startswith("quality") else ""
        print(f"{status:4} {r.backend:8} {r.engine:24} {r.check:40}{shown} {detail}".rstrip())
    failed = sum(not r.passed for r in report.results)
    print(f"{len(report.results) - failed} passed, {failed} failed")
    return EXIT_OK if report.passed else EXIT_MISMATCH
