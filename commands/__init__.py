"""The `adaptive-export` command line (build, check, run, inspect, bench), above everything else.

`commands` parses arguments into the typed options of commands/options.py and orchestrates
the layers below it: `exporter` (graphs -> engines -> bundle), `calibration` (what is worth
an engine) and `runtimes` (running a bundle). It is the only package that may import all of
them; `run`, `inspect` and `bench` import only the runtime, so they work without torch.

When this process is the `adaptive-export` command, importing this package is the first
project code that runs, so SIGINT and SIGTERM are taken over here, before any heavy import:
until commands/cli.py's main() decides, a signal is only recorded (an interrupt raised inside
a C extension's import can abort the interpreter), and main() reports it as exit 130.
"""

from __future__ import annotations

import _signal  # the C module: `signal` imports enum first, which widens the window before the handlers exist
import sys


class Signals:
    """SIGINT/SIGTERM seen by this process since the command started (set by the CLI's handlers)."""

    requested = False


def record_signal(signum: int, frame: object) -> None:
    """The start-up handler: remember the request, raise nothing (commands/cli.py acts on it)."""
    Signals.requested = True


def defer_signals() -> None:
    """Record SIGINT/SIGTERM instead of acting on them (main thread only; elsewhere a no-op)."""
    try:
        _signal.signal(_signal.SIGINT, record_signal)
        _signal.signal(_signal.SIGTERM, record_signal)
    except ValueError:  # not the main thread
        pass


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
