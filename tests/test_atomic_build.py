"""Builds are atomic: interrupted or failing builds leave the old bundle intact and no partial one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptive_export.runtimes import load_bundle

ROOT = Path(__file__).parents[1]
# Every wait here is on a synchronisation point (a file the build writes, its exit), never on a
# timer: on a shared, loaded machine a build's steps take any time, and pytest-timeout (600 s per
# test) is what bounds a hang.


def start_build(model: Path, out: Path, *extra: str, preexec=None, hold: str | None = None) -> subprocess.Popen[str]:
    """A build into `out` with another --max-len than the old bundle (so a build that
    completed would change its manifest). With `hold`, the build waits before its commit
    while that file exists (exporter/bundle_writer._hold_before_commit), so a signal sent
    while the file exists always lands before the point of no return."""
    env = dict(os.environ, ADAPTIVE_EXPORT_HOLD_BEFORE_COMMIT=hold or "")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adaptive_export.commands.cli",
            "build",
            str(model),
            "-o",
            str(out),
            "--force",
            "--max-len",
            "96",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
        env=env,
    )


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    """Block until the build has written `path` (it must still be running meanwhile)."""
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)


def wait_for_export(out: Path, proc: subprocess.Popen[str]) -> None:
    """Block until the build has started writing ONNX files into its staging directory."""
    while not list(out.parent.glob(f".{out.name}.partial-*/onnx/*.onnx")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)


@pytest.fixture()
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Builds a test starts; any still running when it ends (a failed or timed-out wait) are killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture()
def old_bundle(tiny_bundle: Path, tmp_path: Path) -> tuple[Path, str]:
    target = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, target)
    return target, (target / "manifest.json").read_text()


@pytest.mark.parametrize(
    "sig,when", [(signal.SIGTERM, "export"), (signal.SIGINT, "export"), (signal.SIGINT, "swallowed")]
)
def test_interrupted_build_keeps_old_bundle_and_leaves_nothing(
    sig: int,
    when: str,
    tiny_model_dir: Path,
    old_bundle: tuple[Path, str],
    tmp_path: Path,
    children: list[subprocess.Popen[str]],
) -> None:
    """export: the signal lands while ONNX files are being written; swallowed: it lands
    when the bundle is complete, in code that swallows KeyboardInterrupt (as a library
    catching broad exceptions would). The hold file keeps the build from committing
    until the build has recorded the signal (hold.interrupted), so neither case depends
    on timing or on how loaded the machine is."""
    target, manifest = old_bundle
    hold = tmp_path / "hold"
    hold.touch()
    proc = start_build(tiny_model_dir, target, hold=("swallow:" if when == "swallowed" else "") + str(hold))
    children.append(proc)
    if when == "export":
        wait_for_export(target, proc)
    else:
        wait_for(tmp_path / "hold.reached", proc)
    proc.send_signal(sig)
    acknowledged = tmp_path / "hold.interrupted"
    while not acknowledged.exists() and proc.poll() is None:  # the handler has run (or the build ended)
        time.sleep(0.02)
    hold.unlink()  # a build that swallowed the interrupt goes on to its commit, which must refuse
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: interrupted")
    assert (target / "manifest.json").read_text() == manifest
    load_bundle(target)  # still valid, checksums and all
    assert not list(target.parent.glob(f".{target.name}.*")), "a partial staging directory was left behind"


def test_the_error_line_is_not_appended_to_a_live_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """A bar redraws its line without a newline, and an interrupted loop's bar closes only when its
    frame is freed, after the error line: the test above once read `export ONNX: 50%|...error: interrupted`."""
    from tqdm import tqdm

    from adaptive_export.commands import cli

    bar = tqdm(total=2, desc="export ONNX", unit="graph", mininterval=0)  # on stderr, as the build's bars
    bar.update(1)
    assert cli._report_interrupt() == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: interrupted"), err


def test_the_error_line_starts_a_line_after_a_bar_whose_close_was_interrupted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal can land inside a bar's close(), after its text and before its newline (the bar is
    then no longer live): CI once read `export ONNX: 100%|...| 2/2 [...]error: interrupted`."""
    import sys

    from adaptive_export.commands import cli

    monkeypatch.setattr(sys, "stderr", cli._LineTrackingStderr(sys.stderr))
    sys.stderr.write("\rexport ONNX: 100%|##########| 2/2 [00:02<00:00,  1.01s/graph]")  # what close() drew
    assert cli._report_interrupt() == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: interrupted"), err
    assert err.endswith("]\nerror: interrupted. Fix: run the command again (no partial bundle was left)\n"), err


def test_killed_build_keeps_old_bundle_and_next_build_cleans_up(
    tiny_model_dir: Path, old_bundle: tuple[Path, str], tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    target, manifest = old_bundle
    hold = tmp_path / "hold"
    hold.touch()  # the build cannot finish before the kill
    proc = start_build(tiny_model_dir, target, hold=str(hold))
    children.append(proc)
    wait_for_export(target, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert (target / "manifest.json").read_text() == manifest
    load_bundle(target)
    stale = list(target.parent.glob(f".{target.name}.partial-*"))
    assert stale, "expected the killed build's hidden staging directory"
    from adaptive_export.exporter.bundle_writer import remove_stale_partials

    assert remove_stale_partials(target) == stale
    assert not list(target.parent.glob(f".{target.name}.partial-*"))


def _limit_file_size() -> None:
    """Simulate a full disk: files may not grow past 64 KiB (EFBIG instead of ENOSPC)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_disk_full_during_build_is_a_clear_error(
    tiny_model_dir: Path, old_bundle: tuple[Path, str], children: list[subprocess.Popen[str]]
) -> None:
    target, manifest = old_bundle
    proc = start_build(tiny_model_dir, target, preexec=_limit_file_size)
    children.append(proc)
    _, err = proc.communicate()
    assert proc.returncode == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: writing the bundle failed") and "free disk space" in line, err
    assert "Traceback" not in err
    assert (target / "manifest.json").read_text() == manifest
    assert not list(target.parent.glob(f".{target.name}.partial-*"))
