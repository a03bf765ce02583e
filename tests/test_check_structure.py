"""check's structural gate (exporter/check_structure.py) on the real SmolLM2: engines that compute
something else only where the behavioural checks do not look are caught by comparing them with the
engines the model defines, and the report names the tensor or node. Each tamper below re-signs the
bundle's checksums, as an attacker would (tests/test_hardening.py's `resign`). That an untampered
default bundle's structure rows pass is asserted by tests/test_smollm2_native.py's default-build check."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import needs_smollm2
from tests.test_hardening import edit_engine, engine_file, resign
from tests.test_lean_build import CLI, run_measured

pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.timeout(1800)]
GiB = 1 << 30


@pytest.fixture(scope="module")
def plain_bundle(smol_default_bundle: Path) -> Path:
    return smol_default_bundle  # tests tamper copies of it (tampered_copy)


def tampered_copy(bundle: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "tampered"
    shutil.copytree(bundle, copy)
    return copy


def no_rotation_past(bundle: Path, position: int) -> None:
    """The issue's first attack: the rotary cos/sin rows from `position` on say "no rotation"."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    tensors = manifest["backends"]["onnx"]["tensors"]
    weights = np.memmap(bundle / "onnx" / "weights.bin", np.uint8, "r+")
    for name, value in (("rotary.cos_cache", 1.0), ("rotary.sin_cache", 0.0)):
        entry = tensors[name]
        table = weights[entry["offset"] : entry["offset"] + entry["bytes"]].view(np.float32).reshape(entry["shape"])
        table[position:] = value
    weights.flush()
    del weights
    resign(bundle)


def branch_on_token(model: onnx.ModelProto, token: int = 42) -> None:
    """The issue's second attack: logits += 100 * onehot when the input holds one token id (Equal on
    input_ids, a Cast, ReduceMax, a Mul and an Add), with ops the runtime allows."""
    graph = model.graph
    for node in graph.node:
        for index, name in enumerate(node.output):
            if name == "logits":
                node.output[index] = "logits_clean"
    graph.initializer.extend(
        [
            helper.make_tensor("evil_token", TensorProto.INT64, [], [token]),
            helper.make_tensor("evil_scale", TensorProto.FLOAT, [], [100.0]),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Equal", ["input_ids", "evil_token"], ["evil_hit"]),
            helper.make_node("Cast", ["evil_hit"], ["evil_hit_f"], to=TensorProto.FLOAT),
            helper.make_node("ReduceMax", ["evil_hit_f"], ["evil_any"], keepdims=0),
            helper.make_node("Mul", ["evil_any", "evil_scale"], ["evil_push"]),
            helper.make_node("Add", ["logits_clean", "evil_push"], ["logits"]),
        ]
    )


def check_in_child(bundle: Path, tmp_path: Path) -> tuple[int, dict, float, int]:
    report = tmp_path / "report.json"
    started = time.monotonic()
    proc, peak = run_measured(CLI, "check", str(bundle), "--model", "smollm2", "--report", str(report))
    seconds = time.monotonic() - started
    return proc.returncode, json.loads(report.read_text()) if report.exists() else {}, seconds, peak


def structure_results(report: dict) -> list[dict]:
    return [r for r in report["results"] if r["check"] == "structure"]


def test_rotary_tables_rewritten_past_the_sampled_positions_fail_naming_the_tensor(
    plain_bundle: Path, tmp_path: Path
) -> None:
    """Passed `check --model` before (exit 0, 10 passed): every behavioural check stays below 128."""
    bad = tampered_copy(plain_bundle, tmp_path)
    no_rotation_past(bad, 128)
    code, report, seconds, peak = check_in_child(bad, tmp_path)
    assert code == 1, report
    failing = [r for r in structure_results(report) if not r["passed"]]
    assert failing and all("'rotary.cos_cache'" in r["detail"] for r in failing), failing
    assert seconds < 600 and peak < 4 * GiB, (seconds, peak)


def test_an_engine_that_branches_on_one_token_fails_naming_the_node(plain_bundle: Path, tmp_path: Path) -> None:
    """Passed `check --expect-precision gguf` before: no sampled prompt holds token 42."""
    from adaptive_export.exporter.check_structure import engine_difference
    from adaptive_export.runtimes.bundle import load_bundle

    bad = tampered_copy(plain_bundle, tmp_path)
    edit_engine(bad, "decode_full", branch_on_token)
    resign(bad)
    file = engine_file(bad, "decode_full")
    difference = engine_difference(load_bundle(bad), file, load_bundle(plain_bundle), file)
    assert difference is not None and difference.startswith("node ") and "differs from the model's" in difference
    untampered = engine_difference(load_bundle(plain_bundle), file, load_bundle(plain_bundle), file)
    assert untampered is None  # the same comparison passes an engine equal to the model's
