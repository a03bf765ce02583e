"""FiRST routers on the real SmolLM2: `build --routers train` with the defaults gives the full
model plus skip configurations above the quality floor, every engine passes `check`,
`--config full` equals the plain bundle and `run` reports the configuration it chose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_export.commands.cli import main
from adaptive_export.runtimes import Generator
from tests.conftest import build_smollm2, cli, needs_smollm2

# routers trained on the real model, then every configuration's check: minutes on 2 cores
pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(1800)]
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_smollm2(
        tmp_path_factory, "smol_routed", "--max-len", "256", "--routers", "train", "--quantize", "none"
    )


def test_routed_build_has_skip_configurations_and_passes_check(routed: Path, tmp_path: Path) -> None:
    manifest = json.loads((routed / "manifest.json").read_text())
    calibration = json.loads((routed / "calibration.json").read_text())
    skipping = [c for c in manifest["configs"] if c["id"] != "full"]
    assert len(skipping) >= 2, calibration["configs"]
    quality = calibration["configs"]["quality"]
    measured = {tuple(row["kept"]): row["agreement"] for row in quality["measured"]}
    assert all(measured[tuple(c["kept"])] >= quality["min_agreement"] for c in skipping)
    total = sum(f["bytes"] for f in manifest["files"].values())
    assert total <= 1.05 * manifest["backends"]["onnx"]["weight_bytes"]
    report = tmp_path / "r.json"
    prompt_file = str(ROOT / "samples" / "eval_prompts.jsonl")
    proc = cli(
        "check",
        str(routed),
        "--model",
        "smollm2",
        "--report",
        str(report),
        "--prompts",
        prompt_file,
        "--new-tokens",
        "16",
    )
    assert report.is_file(), proc.stderr[-4000:]
    data = json.loads(report.read_text())
    assert proc.returncode == 0, [r for r in data["results"] if not r["passed"]]
    checked = {r["engine"] for r in data["results"]}
    assert {f"decode_{c['id']}" for c in manifest["configs"]} <= checked


def test_config_full_equals_plain_bundle_and_auto_reports_its_choice(
    routed: Path, smol_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "What is the capital of France?"
    with_routers, plain = Generator(routed), Generator(smol_bundle)
    assert (
        with_routers.generate(prompt, mode="ar", max_new_tokens=24, config="full").tokens
        == plain.generate(prompt, mode="ar", max_new_tokens=24).tokens
    )
    assert main(["run", str(routed), "-p", prompt, "--max-new-tokens", "8", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    config = next(
        c for c in json.loads((routed / "manifest.json").read_text())["configs"] if c["id"] == stats["config"]
    )
    assert stats["kept_layers"] == config["kept"] and stats["skipped_layers"] == 30 - len(config["kept"])
