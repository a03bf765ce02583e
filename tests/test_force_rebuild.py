"""`build --force` deletes only the old bundle's own listed files and never crosses a filesystem
boundary (exporter/old_bundle.py): a symlink, a bind mount, another device or an unlisted file
inside the old bundle makes the build refuse (exit 2, one line) before any work, and what it
points at survives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_export.exporter.old_bundle import crosses_filesystem, plan_removal, remove_planned

ROOT = Path(__file__).parents[1]
LIMIT_S = 60


def build_in_child(model: Path, out: Path, *, wrap: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "adaptive_export.commands.cli", "build", str(model), "-o", str(out), "--force"]
    command += ["--max-len", "96"]
    return subprocess.run((wrap or []) + command, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)


def assert_refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: --force will not replace") and "Fix:" in lines[0], lines
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture()
def old_bundle(tiny_bundle: Path, tmp_path: Path) -> Path:
    target = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, target)
    return target


def make_victim(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "sentinel.txt").write_text("keep me")
    return path


def test_symlink_inside_the_old_bundle_is_refused_and_its_target_survives(
    tiny_model_dir: Path, old_bundle: Path, tmp_path: Path
) -> None:
    victim = make_victim(tmp_path / "victim")
    (old_bundle / "onnx" / "link").symlink_to(victim, target_is_directory=True)
    manifest = (old_bundle / "manifest.json").read_text()
    assert_refused(build_in_child(tiny_model_dir, old_bundle), "symbolic link")
    assert (victim / "sentinel.txt").read_text() == "keep me"
    assert (old_bundle / "manifest.json").read_text() == manifest
    assert not list(tmp_path.glob(".bundle.*"))


def test_unlisted_file_in_the_old_bundle_is_refused_and_survives(tiny_model_dir: Path, old_bundle: Path) -> None:
    (old_bundle / "onnx" / "notes.txt").write_text("mine")
    assert_refused(build_in_child(tiny_model_dir, old_bundle), "notes.txt", "not one of the bundle's listed files")
    assert (old_bundle / "onnx" / "notes.txt").read_text() == "mine"


def test_bad_paths_in_the_old_manifest_are_refused(tiny_model_dir: Path, old_bundle: Path) -> None:
    data = json.loads((old_bundle / "manifest.json").read_text())
    data["files"]["../victim"] = {"sha256": "0" * 64, "bytes": 1}
    (old_bundle / "manifest.json").write_text(json.dumps(data))
    assert_refused(build_in_child(tiny_model_dir, old_bundle), "canonical relative path")


def test_st_dev_comparison_on_two_real_filesystems(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.lstat(shm).st_dev == os.lstat(tmp_path).st_dev:
        pytest.skip("no second filesystem at /dev/shm")
    assert crosses_filesystem(shm, os.lstat(tmp_path).st_dev)
    assert not crosses_filesystem(tmp_path, os.lstat(tmp_path).st_dev)
    assert crosses_filesystem(shm, os.lstat(shm).st_dev)  # /dev/shm is a mount point itself


def unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not unshare_works(), reason="unprivileged mount namespaces (unshare -rm) are not available")
@pytest.mark.parametrize("where", ["onnx", "extra"])
def test_bind_mount_inside_the_old_bundle_is_refused_and_the_model_survives(
    tiny_model_dir: Path, old_bundle: Path, tmp_path: Path, where: str
) -> None:
    """The attack: the model directory bind-mounted inside the old bundle (same filesystem, so
    st_dev is equal and os.path.ismount is False), over a listed directory or a new one."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    before = sorted(p.name for p in model.iterdir())
    (old_bundle / where).mkdir(exist_ok=True)
    script = f'mount --bind "{model}" "{old_bundle / where}" && exec "$@"'
    proc = build_in_child(model, old_bundle, wrap=["unshare", "-rm", "sh", "-c", script, "sh"])
    assert_refused(proc, "mount point")
    assert sorted(p.name for p in model.iterdir()) == before


def test_removal_deletes_only_listed_files(old_bundle: Path, tmp_path: Path) -> None:
    """A file that appears after the check survives, and so does the directory holding it."""
    plan = plan_removal(old_bundle)
    (old_bundle / "onnx" / "late.txt").write_text("arrived after the plan")
    aside = tmp_path / "aside"
    os.rename(old_bundle, aside)
    remove_planned(aside, plan)
    assert sorted(p.relative_to(aside).as_posix() for p in aside.rglob("*")) == ["onnx", "onnx/late.txt"]


def test_force_replaces_a_clean_previous_bundle(tiny_model_dir: Path, old_bundle: Path) -> None:
    proc = build_in_child(tiny_model_dir, old_bundle)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((old_bundle / "manifest.json").read_text())["max_len"] == 96
    assert not list(old_bundle.parent.glob(".bundle.*"))
