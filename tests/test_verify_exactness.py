"""`run --mode auto` drafts only where the bundle's verify pass was measured to reproduce plain
steps (issue #24 item 1): `build --speculate auto` compares one T=k+1 pass of the decode engine
with k+1 T=1 passes (calibration/verify_exactness.py) and records it in the manifest; without
that measurement auto keeps the accuracy-level rule (tests/test_auto_default.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_export.calibration.verify_exactness import measure_verify_exactness
from adaptive_export.commands.cli import main
from adaptive_export.runtimes.manifest_speculation import EXACT_RELATIVE_DIFF, VerifyExactness
from tests.conftest import make_tiny_model

PROMPT = "the sea the sea the sea the sea the sea"
CALIB = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is the capital of France? Paris is the capital of France.",
    "the sea the sea the sea the sea",
]
# hidden 256 x 4 layers: enough int8-quantized activations per pass that a reordered last bit tips a
# rounding in most verify windows (at hidden 64 x 2 layers it rarely does: such a bundle can measure exact)
WIDE = {"layers": 4, "hidden": 256, "seed": 3}
BUILDS = {
    "accuracy4": ["--quantize", "int4", "--quant-accuracy", "4"],
    "accuracy1": ["--quantize", "int4", "--quant-accuracy", "1"],
    "fp32": [],
}


def run_json(capsys: pytest.CaptureFixture[str], bundle: Path, *flags: str) -> dict:
    assert main(["run", str(bundle), "-p", PROMPT, "--raw", "--max-new-tokens", "24", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "model", "gqa_untied", **WIDE)


@pytest.fixture(scope="module", params=sorted(BUILDS))
def calibrated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, wide_model: Path) -> Path:
    root = tmp_path_factory.mktemp(f"exact_{request.param}")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CALIB))
    out = root / "bundle"
    flags = ["--max-len", "96", "--speculate", "auto", "--calib", str(calib), *BUILDS[request.param]]
    assert main(["build", str(wide_model), "-o", str(out), *flags]) == 0
    return out


def test_auto_drafts_only_where_the_verify_pass_was_measured_exact(
    calibrated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    manifest = json.loads((calibrated / "manifest.json").read_text())
    quantize = manifest["backends"]["onnx"]["quantize"]
    accuracy = manifest["backends"]["onnx"].get("quant_options", {}).get("accuracy_level")
    recorded = manifest["speculation"]["verify_exactness"]
    measured = VerifyExactness.from_json(recorded)
    assert json.loads((calibrated / "calibration.json").read_text())["speculation"]["verify_exactness"] == recorded
    default, plain = run_json(capsys, calibrated), run_json(capsys, calibrated, "--mode", "ar")
    if quantize == "int4" and accuracy == 4:  # int8 activations: a T=9 pass is not 9 T=1 passes
        assert not measured.exact, recorded
        # unless calibration found that two-row steps are exact and speculating on them pays
        # (tests/test_two_row_decoding.py): then every mode decodes two rows at least
        two_rows = manifest["speculation"].get("min_decode_rows", 1) == 2
        assert default["stats"]["mode"] == ("spec" if two_rows else "ar"), default["stats"]
    else:  # float reordering only: far below the bound
        assert measured.exact and measured.top1_flips == 0
        assert measured.max_logit_diff < 0.3 * EXACT_RELATIVE_DIFF * measured.logit_scale, recorded
        assert default["stats"]["mode"] == "spec", default["stats"]
    assert default["tokens"] == plain["tokens"]


def test_measurement_of_a_plain_bundle(tiny_bundle: Path) -> None:
    """fp32 engines verify exactly, and the measurement round-trips through the manifest type."""
    first = measure_verify_exactness(tiny_bundle, max_k=3, prompts=2)
    assert first.exact and first.top1_flips == 0 and first.worst_flip_margin == 0.0 and first.logit_scale > 0
    assert VerifyExactness.from_json(json.loads(json.dumps(first.to_json()))) == first
