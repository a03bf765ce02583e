"""One import name: `pip install .` puts exactly one top-level package, `adaptive_export`, into
site-packages (the repository's folders are mapped under it), and the data files the tools read
at run time travel with it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OLD_NAMES = {"graphs", "loading", "exporter", "calibration", "runtimes", "commands"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        str(ROOT),
    ]
    had_build_dir = (ROOT / "build").exists()
    subprocess.run(command, check=True, capture_output=True, cwd=out)
    if not had_build_dir:  # setuptools builds in the source tree; leave it as it was
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    (path,) = out.glob("adaptive_export-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_installs_one_top_level_package(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    packages = {top for top in tops if not top.endswith(".dist-info")}
    assert packages == {"adaptive_export"}
    subpackages = {name.split("/")[1] for name in wheel.namelist() if name.startswith("adaptive_export/")}
    assert OLD_NAMES <= subpackages
    assert not any(name.split("/")[0] in OLD_NAMES for name in wheel.namelist())


def test_entry_point_names_the_one_package(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    assert "adaptive-export = adaptive_export.commands.cli:main" in wheel.read(entry_points).decode()


def test_builtin_calibration_prompts_ship_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    assert "adaptive_export/samples/calib_prompts.jsonl" in wheel.namelist()
