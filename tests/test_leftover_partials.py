"""Leftovers of other builds and places that cannot hold a bundle (docs/hardening.md, "Staging
directories of killed and live builds", "Outputs that cannot hold a bundle").

A build's staging dir `.NAME.partial-*` holds a marker whose flock its build holds while it runs:
the next build removes the partial of a killed build (even when its pid now names another live
process), refuses in one line (exit 2) while a live build writes one, and never deletes a
directory that merely matches the name. `-o` under /proc, /sys or on a read-only filesystem is
refused in one line before any loading.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_export.exporter.bundle_writer import remove_stale_partials
from tests.bounded import assert_one_error_line, run_cli_bounded
from tests.test_atomic_build import start_build, wait_for


@pytest.fixture()
def old_bundle(tiny_bundle: Path, tmp_path: Path) -> Path:
    target = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, target)
    return target


def killed_build_partial(model: Path, target: Path, tmp_path: Path) -> Path:
    """The staging dir of a build SIGKILLed when complete but uncommitted."""
    hold = tmp_path / "hold"
    hold.touch()
    proc = start_build(model, target, hold=str(hold))
    wait_for(tmp_path / "hold.reached", proc)
    proc.kill()
    proc.communicate(timeout=60)
    hold.unlink()
    (stale,) = target.parent.glob(f".{target.name}.partial-*")
    return stale


def test_a_killed_builds_partial_is_removed_even_when_its_pid_is_reused(
    tiny_model_dir: Path, old_bundle: Path, tmp_path: Path
) -> None:
    """The pid in a partial's name says nothing once the pid is reused (containers reuse small
    pids at once): here it names this live test process, and the partial must still go."""
    stale = killed_build_partial(tiny_model_dir, old_bundle, tmp_path)
    reused = stale.with_name(f".{old_bundle.name}.partial-{os.getpid()}-reused")
    stale.rename(reused)
    proc = start_build(tiny_model_dir, old_bundle)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert not list(old_bundle.parent.glob(f".{old_bundle.name}.*")), "the killed build's partial was left"


def test_a_live_builds_partial_is_refused_in_one_line_and_left_alone(
    tiny_model_dir: Path, old_bundle: Path, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    first = start_build(tiny_model_dir, old_bundle, hold=str(hold))
    try:
        wait_for(tmp_path / "hold.reached", first)
        (live,) = old_bundle.parent.glob(f".{old_bundle.name}.partial-*")
        second = start_build(tiny_model_dir, old_bundle)
        _, err = second.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert second.returncode == 2, err
        assert len(lines) == 1 and lines[0].startswith("error: another build") and "Fix:" in lines[0], err
        assert live.is_dir(), "the live build's staging directory was touched"
    finally:
        hold.unlink()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert not list(old_bundle.parent.glob(f".{old_bundle.name}.*"))


def dead_pid() -> int:
    """A pid no process has now."""
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


@pytest.mark.parametrize("kind", ["no marker", "foreign marker", "symlink"])
def test_what_this_tool_did_not_make_is_never_deleted(tmp_path: Path, kind: str) -> None:
    """A directory named like a partial of a dead pid, but without this tool's marker (or a link to
    one) is someone else's: it stays, with everything in it."""
    target = tmp_path / "bundle"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep me")
    lookalike = tmp_path / f".bundle.partial-{dead_pid()}-abcd1234"
    if kind == "symlink":
        lookalike.symlink_to(mine, target_is_directory=True)
    else:
        shutil.copytree(mine, lookalike)
        if kind == "foreign marker":
            (lookalike / ".adaptive-export-partial").write_text('{"tool": "someone else"}')
    assert remove_stale_partials(target) == []
    assert (lookalike / "keep.txt").read_text() == "keep me"
    assert (mine / "keep.txt").read_text() == "keep me"


@pytest.mark.parametrize("out", ["/proc/bundle", "/sys/bundle"])
def test_an_output_that_cannot_hold_a_bundle_is_one_line(tiny_model_dir: Path, out: str) -> None:
    if not Path(out).parent.is_dir():
        pytest.skip(f"{Path(out).parent} is not mounted here")
    outcome = run_cli_bounded(["build", str(tiny_model_dir), "-o", out, "--max-len", "96"])
    assert_one_error_line(outcome, "cannot hold a bundle")


def unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not unshare_works(), reason="unprivileged mount namespaces (unshare -rm) are not available")
def test_an_output_on_a_read_only_filesystem_is_one_line_before_loading(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The build runs with the output's parent bind-mounted read-only (os.access still says yes to
    root there); nothing is left in it."""
    place = tmp_path / "ro"
    place.mkdir()
    script = f'mount --bind "{place}" "{place}" && mount -o remount,bind,ro "{place}" && exec "$@"'
    wrap = ["unshare", "-rm", "sh", "-c", script, "sh"]
    command = [*wrap, sys.executable, "-m", "adaptive_export.commands.cli"]
    command += ["build", str(tiny_model_dir), "-o", str(place / "bundle"), "--max-len", "96"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "cannot hold a bundle" in lines[0] and "Fix:" in lines[0], proc.stderr
    assert list(place.iterdir()) == []


def test_a_leftover_old_bundle_of_the_same_pid_does_not_break_the_commit(
    tiny_model_dir: Path, old_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A build killed during its commit leaves the old bundle renamed aside; a container starts the
    next build at the same pid. The commit renamed the old bundle to the fixed `.NAME.old-PID`,
    onto that leftover: `unexpected OSError: Directory not empty`. In-process, so the pid is known."""
    from adaptive_export.commands.cli import main

    leftover = old_bundle.parent / f".{old_bundle.name}.old-{os.getpid()}"
    leftover.mkdir()
    (leftover / "manifest.json").write_text("left by a killed commit")
    rc = main(["build", str(tiny_model_dir), "-o", str(old_bundle), "--force", "--max-len", "96"])
    assert rc == 0, capsys.readouterr().err
    assert (leftover / "manifest.json").read_text() == "left by a killed commit"
