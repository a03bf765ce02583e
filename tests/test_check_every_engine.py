"""check compares every engine the bundle holds with the one the model's build makes
(exporter/check_structure.py): an engine no rebuild makes fails unless `--allow-unrebuilt`
names it, the configurations must name the rebuild's engines, and the manifest's `quantize` word
chooses what is rebuilt, never whether. Each attack re-signs the bundle's checksums
(tests/test_hardening.py's `resign`) and runs `check` in a bounded child."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import build_tiny, needs_smollm2
from tests.test_check_structure import branch_on_token, no_rotation_past
from tests.test_hardening import engine_file, resign
from tests.test_lean_build import CLI, run_measured

pytestmark = pytest.mark.timeout(1800)
GiB = 1 << 30


def check_report(bundle: Path, model: str, tmp_path: Path, *flags: str) -> tuple[int, dict[str, Any], float, int]:
    """`check BUNDLE --model MODEL` in a child: exit code, JSON report, seconds, peak RSS."""
    report = tmp_path / "report.json"
    started = time.monotonic()
    proc, peak = run_measured(CLI, "check", str(bundle), "--model", model, "--report", str(report), *flags)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(report.read_text()), time.monotonic() - started, peak


def structure(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["engine"]: r for r in report["results"] if r["check"] == "structure"}


def tampered(bundle: Path, tmp_path: Path, edit: Callable[[Path, dict[str, Any]], None]) -> Path:
    """A copy of `bundle` with `edit(copy, manifest)` applied and the checksums re-signed."""
    copy = tmp_path / "tampered"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(copy, manifest)
    resign(copy, manifest)
    return copy


def extra_decode_engine(root: Path, manifest: dict[str, Any]) -> None:
    """The issue's decode_x: decode_full's entry copied under a new name with an engine file of its
    own (the real engine plus a branch on one token id), named by the full configuration."""
    import onnx

    source = root / engine_file(root, "decode_full")
    model = onnx.load(str(source), load_external_data=False)
    branch_on_token(model)
    (root / "onnx" / "decode_x.onnx").write_bytes(model.SerializeToString())
    manifest["graphs"]["decode_x"] = dict(manifest["graphs"]["decode_full"])
    onnx_graphs = manifest["backends"]["onnx"]["graphs"]
    onnx_graphs["decode_x"] = {**onnx_graphs["decode_full"], "file": "onnx/decode_x.onnx"}
    manifest["files"]["onnx/decode_x.onnx"] = {"sha256": "", "bytes": 0}
    next(c for c in manifest["configs"] if c["id"] == "full")["engines"]["decode"] = "decode_x"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import tiny6_model

    return tiny6_model(tmp_path_factory)


@pytest.mark.parametrize(
    "flags",
    [("--max-len", "96"), ("--max-len", "96", "--onnx-flavour", "portable"), ("--max-len", "96", "--quantize", "int8")],
    ids=["fused", "portable", "int8"],
)
def test_every_engine_of_an_untampered_bundle_is_compared_and_equal(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """A model directory (no .gguf) and a re-quantized bundle are rebuilt too: no engine is left to behaviour."""
    bundle = build_tiny(tmp_path_factory, *flags)
    code, report, _, _ = check_report(bundle, str(tiny_model), tmp_path)
    rows = structure(report)
    graphs = json.loads((bundle / "manifest.json").read_text())["graphs"]
    assert code == 0 and set(rows) == {*graphs, "configs"}, rows
    assert all(r["passed"] and r["executed"] for r in rows.values()), rows


def test_an_engine_no_rebuild_makes_fails_naming_it_unless_allowed(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tmp_path: Path
) -> None:
    """Passed before ("no plain build makes decode_x: checked by behaviour"), on a tiny bundle."""
    bad = tampered(build_tiny(tmp_path_factory, "--max-len", "96"), tmp_path, extra_decode_engine)
    code, report, _, _ = check_report(bad, str(tiny_model), tmp_path)
    rows = structure(report)
    assert code == 1 and not rows["decode_x"]["passed"], rows
    assert "--allow-unrebuilt decode_x" in rows["decode_x"]["detail"]
    assert not rows["configs"]["passed"] and "'full'" in rows["configs"]["detail"], rows["configs"]
    _, allowed, _, _ = check_report(bad, str(tiny_model), tmp_path, "--allow-unrebuilt", "decode_x")
    row = structure(allowed)["decode_x"]
    assert row["passed"] and not row["executed"] and "behaviour only" in row["detail"], row


def test_a_relabelled_quantize_word_rebuilds_what_it_says_and_fails(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tmp_path: Path
) -> None:
    """A float bundle whose manifest says `quantize: int8`: the rebuild re-quantizes, the engines differ."""

    def relabel(root: Path, manifest: dict[str, Any]) -> None:
        manifest["backends"]["onnx"]["quantize"] = "int8"

    bad = tampered(build_tiny(tmp_path_factory, "--max-len", "96"), tmp_path, relabel)
    code, report, _, _ = check_report(bad, str(tiny_model), tmp_path)
    failing = [name for name, r in structure(report).items() if not r["passed"]]
    assert code == 1 and {"prefill", "decode_full"} <= set(failing), structure(report)


def test_allow_unrebuilt_naming_no_graph_is_a_usage_error(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> None:
    bundle = build_tiny(tmp_path_factory, "--max-len", "96")
    proc, _ = run_measured(CLI, "check", str(bundle), "--model", str(tiny_model), "--allow-unrebuilt", "decode_nothing")
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --allow-unrebuilt names 'decode_nothing'") and "Fix:" in lines[0], lines


@needs_smollm2
@pytest.mark.slow
def test_the_issues_decode_x_fails_on_smollm2(smol_default_bundle: Path, tmp_path: Path) -> None:
    """The issue's attack on the default SmolLM2 bundle ("Berlin" answered "Moscow"): exit 1, decode_x named."""
    bad = tampered(smol_default_bundle, tmp_path, extra_decode_engine)
    code, report, seconds, peak = check_report(bad, "smollm2", tmp_path)
    rows = structure(report)
    assert code == 1 and not rows["decode_x"]["passed"] and not rows["configs"]["passed"], rows
    assert rows["decode_full"]["passed"] and rows["prefill"]["passed"], rows
    assert seconds < 600 and peak < 4 * GiB, (seconds, peak)


@needs_smollm2
@pytest.mark.slow
def test_the_issues_int4_relabel_with_the_rotary_tamper_fails_on_smollm2(
    smol_default_bundle: Path, tmp_path: Path
) -> None:
    """The default (GGUF-exact, 4-bit) bundle relabelled `quantize: int4`, rotary tables stopped at 128:
    passed before with every structure row gone; now the int4 rebuild differs from its engines."""

    def relabel(root: Path, manifest: dict[str, Any]) -> None:
        manifest["backends"]["onnx"]["quantize"] = "int4"
        (root / "manifest.json").write_text(json.dumps(manifest))
        no_rotation_past(root, 128)  # re-signs the file it reads back
        manifest.update(json.loads((root / "manifest.json").read_text()))

    bad = tampered(smol_default_bundle, tmp_path, relabel)
    code, report, seconds, peak = check_report(bad, "smollm2", tmp_path)
    failing = {name for name, r in structure(report).items() if not r["passed"]}
    assert code == 1 and {"prefill", "decode_full"} <= failing, structure(report)
    assert seconds < 900 and peak < 6 * GiB, (seconds, peak)
