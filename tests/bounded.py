"""Run the CLI in a child process under a wall-clock and address-space bound.

A hostile case that regresses must fail its own test, not hang or kill the suite, so every case
that could loop, allocate or block runs here: the child gets RLIMIT_AS (about 1.5 GB) before it
starts, is killed at its deadline, and the result carries its exit code, output, wall time and
peak RSS. The child also reports (on stderr, as `AUDIT: ...`):
- a Python-level open of a file whose name holds the sentinel marker (an audit hook);
- any 8-byte window of the sentinel's bytes inside an engine's outputs (logits, scores, hidden
  states), seen by wrapping the onnx backend's run calls (the real backend runs);
and the parent checks the sentinel's access time, which moves on any read, C-level ones included
(ext4's relatime updates it when it is not newer than the mtime, so the test sets it older).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
LIMIT_S = 10.0  # the case itself
STARTUP_S = 8.0  # a fresh interpreter's imports on a loaded 2-core machine
ADDRESS_SPACE_BYTES = 3 << 29  # 1.5 GiB
SENTINEL_TEXT = b"SENTINEL-7f3a9c-do-not-read"

_RUNNER = r"""
import atexit, os, sys
marker, sentinel_bytes = sys.argv[1], sys.argv[2].encode()
# VmHWM, not ru_maxrss: Linux carries the forking parent's high-water mark into ru_maxrss
# across exec, so a child of a large pytest process would report the parent's size
atexit.register(lambda: open(os.environ["RSS_FILE"], "w").write(
    next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))))
def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)) and marker in str(args[0]):
        sys.stderr.write("AUDIT: the sentinel outside the bundle was opened\n")
sys.addaudithook(hook)
# what the console script does first (argv[0] here is '-c'): record SIGINT/SIGTERM from now on
from adaptive_export.commands import defer_signals
defer_signals()
WINDOWS = {sentinel_bytes[i:i + 8] for i in range(len(sentinel_bytes) - 7)}
def scan(values):
    for value in values:
        data = getattr(value, "tobytes", lambda: b"")()
        if any(window in data for window in WINDOWS):
            sys.stderr.write("AUDIT: sentinel bytes reached an engine's outputs\n")
from adaptive_export.runtimes.backends import onnxruntime_backend as ob
plain_run, plain_named = ob.OnnxRuntimeBackend.run, ob.OnnxRuntimeBackend.run_named
def run(self, *args):
    outputs = plain_run(self, *args)
    scan([outputs.logits, outputs.router_scores, outputs.exit_hidden])
    return outputs
def run_named(self, *args):
    outputs = plain_named(self, *args)
    scan(outputs.values())
    return outputs
ob.OnnxRuntimeBackend.run, ob.OnnxRuntimeBackend.run_named = run, run_named
from adaptive_export.commands.cli import main
sys.argv = ["adaptive-export", *sys.argv[3:]]
sys.exit(main())
"""


@dataclass(frozen=True)
class Outcome:
    """What a bounded child did."""

    rc: int
    out: str
    err: str
    seconds: float
    peak_rss_mb: float


def _limit_address_space(nbytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (nbytes, resource.getrlimit(resource.RLIMIT_AS)[1]))


def start_cli(argv: list[str], marker: str = "no-sentinel-marker", rss_file: Path | None = None) -> subprocess.Popen:
    """The CLI in a child with RLIMIT_AS set before exec; the caller waits with `finish`."""
    rss_file = rss_file or Path(os.environ.get("TMPDIR", "/tmp")) / f"rss-{os.getpid()}-{time.monotonic_ns()}.txt"
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", str(ROOT)), RSS_FILE=str(rss_file))
    env.pop("ADAPTIVE_EXPORT_TRACEBACK", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, marker, SENTINEL_TEXT.decode(), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: _limit_address_space(ADDRESS_SPACE_BYTES),
    )
    proc.rss_file = rss_file  # type: ignore[attr-defined]
    return proc


def finish(
    proc: subprocess.Popen, started: float, timeout_s: float = LIMIT_S, deadline: float | None = None
) -> Outcome:
    """Wait for the child until its deadline (default: start + timeout_s + STARTUP_S), then kill it and fail."""
    deadline = deadline if deadline is not None else started + timeout_s + STARTUP_S
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"the child ran past its deadline ({deadline - started:.1f} s): a hang") from None
    seconds = time.monotonic() - started
    rss_file: Path = proc.rss_file  # type: ignore[attr-defined]
    peak_mb = int(rss_file.read_text()) / 1024 if rss_file.exists() else 0.0
    rss_file.unlink(missing_ok=True)
    return Outcome(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), seconds, peak_mb)


def run_cli_bounded(argv: list[str], marker: str = "no-sentinel-marker", timeout_s: float = LIMIT_S) -> Outcome:
    """Start the CLI in a bounded child and wait for it."""
    started = time.monotonic()
    return finish(start_cli(argv, marker), started, timeout_s)


def assert_one_error_line(outcome: Outcome, *fragments: str, rc: int = 2, progress: bool = False) -> None:
    """The exit code, exactly one `error: ... Fix: ...` line on stderr, no traceback, no audit report."""
    err = outcome.err
    assert outcome.rc == rc, err
    assert "AUDIT" not in err, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    if progress:
        lines = [line for line in lines if "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix:" in lines[0], err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def plant_sentinel(path: Path, size: int = 0) -> Path:
    """Sentinel bytes at `path`, with an access time older than its mtime so that any read moves it."""
    path.write_bytes((SENTINEL_TEXT * (size // len(SENTINEL_TEXT) + 1))[: max(size, len(SENTINEL_TEXT))])
    mtime = path.stat().st_mtime
    os.utime(path, (mtime - 86400 * 2, mtime))
    return path


def sentinel_was_read(path: Path) -> bool:
    """True when the sentinel's bytes were read since `plant_sentinel` (by Python or C code)."""
    info = path.stat()
    return info.st_atime >= info.st_mtime - 86400


def sentinel_in_tokens(tokens: list[int]) -> bool:
    """The sentinel's byte values as a run of 4 or more consecutive token ids."""
    values = list(SENTINEL_TEXT)
    windows = {tuple(values[i : i + 4]) for i in range(len(values) - 3)}
    return any(tuple(tokens[i : i + 4]) in windows for i in range(len(tokens) - 3))
