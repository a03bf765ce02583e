"""`check`'s memory estimate counts the bundle's engine files (each ONNX Runtime session prepacks
its own copy of the weights it reads), and a check that cannot fit is one line before any work."""

from __future__ import annotations

import json
from pathlib import Path

from adaptive_export.loading.memory_plan import CHECK_PER_ENGINE_BYTE, check_need, engine_file_bytes
from adaptive_export.loading.model import model_fields
from adaptive_export.runtimes import load_bundle
from tests.test_lean_build import CLI, run_measured


def per_file_bytes(bundle: Path) -> dict[str, int]:
    """Each engine file's initializer bytes, read from the manifest's JSON directly."""
    onnx = json.loads((bundle / "manifest.json").read_text())["backends"]["onnx"]
    return {
        engine["file"]: sum(onnx["tensors"][name]["bytes"] for name in engine["initializers"])
        for engine in onnx["graphs"].values()
    }


def test_each_engine_file_counts_once(tiny_bundle: Path, tiny_portable_bundle: Path, tiny_model_dir: Path) -> None:
    fused, portable = per_file_bytes(tiny_bundle), per_file_bytes(tiny_portable_bundle)
    assert len(fused) == 1 and len(portable) == 2  # portable: prefill and decode are two engines
    assert engine_file_bytes(load_bundle(tiny_bundle).manifest) == sum(fused.values())
    assert engine_file_bytes(load_bundle(tiny_portable_bundle).manifest) == sum(portable.values())
    fields = model_fields(str(tiny_model_dir))
    extra = sum(portable.values())
    assert check_need(fields, extra).peak_bytes - check_need(fields).peak_bytes == int(CHECK_PER_ENGINE_BYTE * extra)


def test_a_check_that_cannot_fit_is_one_line_before_any_work(tiny_bundle: Path, tiny_model_dir: Path) -> None:
    """Under a 1.5 GiB data limit the estimate (2 GiB and up) refuses, exit 2, one line."""
    proc, _ = run_measured(CLI, "check", str(tiny_bundle), "--model", str(tiny_model_dir), rlimit_data=int(1.5 * 2**30))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: check (the fp32 reference model and each engine"), lines
    assert "GiB are available" in lines[0] and "Fix: run check on a machine with more memory" in lines[0]
