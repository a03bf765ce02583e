"""The `adaptive-export` command line (build, check, run, inspect, bench), above everything else.

`commands` parses arguments into the typed options of commands/options.py and orchestrates
the layers below it: `exporter` (graphs -> engines -> bundle), `calibration` (what is worth
an engine) and `runtimes` (running a bundle). It is the only package that may import all of
them; `run`, `inspect` and `bench` import only the runtime, so they work without torch.

When this process is the `adaptive-export` command, importing this package is the first
project code that runs, so SIGINT and SIGTERM are taken over here, before any heavy import:
until commands/cli.py's main() decides, a signal is only recorded (an interrupt raised inside
a C extension's import can abort the interpreter), and main() reports it as exit 130.

A Python handler runs only between bytecodes, so a signal that lands while an engine runs
(C++, seconds or more) would wait for the run to end. The signals therefore also wake a pipe
(`signal.set_wakeup_fd`, written by the C-level handler at once), whose read end the engines'
watchdog (runtimes/backends/run_guard.py) watches: it ends every live run, so Ctrl-C during
`session.run` exits 130 within a second.
"""

from __future__ import annotations

import _signal  # the C module: `signal` imports enum first, which widens the window before the handlers exist
import os
import sys


class Signals:
    """SIGINT/SIGTERM seen by this process since the command started (set by the CLI's handlers)."""

    requested = False
    wakeup_read: int | None = None  # the signal wakeup pipe's read end (see wake_on_signals)


def record_signal(signum: int, frame: object) -> None:
    """The start-up handler: remember the request, raise nothing (commands/cli.py acts on it)."""
    Signals.requested = True


def defer_signals() -> None:
    """Record SIGINT/SIGTERM instead of acting on them (main thread only; elsewhere a no-op)."""
    try:
        _signal.signal(_signal.SIGINT, record_signal)
        _signal.signal(_signal.SIGTERM, record_signal)
    except ValueError:  # not the main thread
        return
    wake_on_signals()


def wake_on_signals() -> int | None:
    """A pipe the C-level signal handler writes to even while the main thread is inside C++ code;
    returns its read end (None where signals cannot be set: not the main thread)."""
    if Signals.wakeup_read is None:
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            _signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            os.close(read)
            os.close(write)
            return None
        Signals.wakeup_read = read
    return Signals.wakeup_read


def route_signals_to_engine_runs() -> None:
    """Let SIGINT/SIGTERM end an engine run in flight (called once the command's imports are done)."""
    if Signals.wakeup_read is not None:
        from adaptive_export.runtimes.backends.run_guard import watch_signals

        watch_signals(Signals.wakeup_read)


def is_command_process() -> bool:
    """True when this interpreter runs the command: the console script, or `python -m` locating
    one of this package's modules (Python sets argv[0] to '-m' while it does)."""
    argv0 = (getattr(sys, "argv", None) or [""])[0]
    return argv0 == "-m" or argv0.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".exe") == COMMAND_NAME


COMMAND_NAME = "adaptive-export"
if is_command_process():
    defer_signals()

# exit codes: success; `check` found a mismatch; bad usage or input (one `error: ... Fix: ...` line)
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # SIGINT and SIGTERM alike (128 + SIGINT), after one `error: interrupted` line
