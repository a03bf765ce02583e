"""SIGINT/SIGTERM at start-up (commands/__init__.py, commands/cli.py): a signal that lands while
the command is still importing (numpy, onnx, torch...) or parsing ends in exit 130 and one
`error: interrupted` line, never a traceback, a silent death or an abort inside an import.

The delays count from the end of the interpreter's own start-up (measured here as the time
`python -c "import adaptive_export"` takes): before that no code of the project has run, so no
program can handle a signal there (Python's default handler prints a KeyboardInterrupt traceback)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DELAYS_S = (0.05, 0.1, 0.2, 0.4)
REPEATS = 2


def interpreter_start_s() -> float:
    """The slowest of three runs of the interpreter up to the project's import name (site, the
    installed package's finder): no code of the project runs before that."""
    times = []
    for _ in range(3):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", "import adaptive_export"], check=True)
        times.append(time.monotonic() - start)
    return max(times)


@pytest.fixture(scope="module")
def offset_s() -> float:
    return interpreter_start_s()


def command_line(*args: str) -> list[str]:
    """The console script next to this interpreter (what users run), else the module (-m)."""
    script = Path(sys.executable).parent / "adaptive-export"
    if script.is_file():
        return [str(script), *args]
    return ["-m", "adaptive_export.commands.cli", *args]


def handlers_installed(err: str) -> bool:
    """Whether the child finished importing adaptive_export.commands (which installs the handlers
    first thing): `-X importtime` reports each module when its import completes, its name indented
    by its nesting (the console script imports it under adaptive_export.commands.cli)."""
    return any(
        line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == "adaptive_export.commands"
        for line in err.splitlines()
    )


def interrupt_at(args: list[str], delay: float, sig: int) -> tuple[bool, int, str]:
    """(whether the child was still running when signalled, exit code, stderr without the import
    times). A signal a loaded machine delivered before the handlers existed is retried (at most
    5 times): no program can handle a signal before its own code runs."""
    for _ in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay)
        alive = proc.poll() is None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        if handlers_installed(err):
            break
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    return alive, proc.returncode, "\n".join(lines) + "\n"


def assert_interrupted(alive: bool, code: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert alive, "the command ended before the signal: this case tests nothing"
    assert code == 130, (code, err)
    assert err.strip().splitlines() == [
        "error: interrupted. Fix: run the command again (no partial bundle was left)"
    ], err


@pytest.mark.parametrize("delay", DELAYS_S)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_build_interrupted_at_start_up(
    tiny_model_dir: Path, tmp_path: Path, offset_s: float, delay: float, sig: int
) -> None:
    for attempt in range(REPEATS):
        out = tmp_path / f"out{attempt}"
        assert_interrupted(
            *interrupt_at(command_line("build", str(tiny_model_dir), "-o", str(out)), offset_s + delay, sig)
        )
        assert not out.exists() and not list(tmp_path.glob(f".out{attempt}.*"))


@pytest.mark.parametrize("delay", DELAYS_S)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run_interrupted_at_start_up(tiny_bundle: Path, offset_s: float, delay: float, sig: int) -> None:
    """The tiny bundle's run takes about 0.3 s: at the later delays it may have finished, or decided its
    outcome, before the signal (then it succeeded); any other outcome must be the interrupt."""
    for _ in range(REPEATS):
        _, code, err = interrupt_at(command_line("run", str(tiny_bundle), "-p", "hello"), offset_s + delay, sig)
        if code != 0:
            assert_interrupted(True, code, err)
        assert "Traceback" not in err, err


@pytest.mark.parametrize("delay", DELAYS_S)
def test_help_interrupted_at_start_up(offset_s: float, delay: float) -> None:
    """`--help` may finish before the later delays; then it must simply have succeeded."""
    for _ in range(REPEATS):
        alive, code, err = interrupt_at(command_line("--help"), offset_s + delay, signal.SIGINT)
        assert "Traceback" not in err, err
        if alive:
            assert code in (0, 130), (code, err)
            assert code == 0 or err.strip().splitlines() == [
                "error: interrupted. Fix: run the command again (no partial bundle was left)"
            ], err
        else:
            assert code == 0, err
