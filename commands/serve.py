"""`serve`: one bundle behind an OpenAI-compatible HTTP API (docs/serve.md), torch-free.

The bundle is loaded once; generation runs on one worker thread (commands/serve_worker.py),
the HTTP side is Starlette on uvicorn (commands/serve_app.py), both from the `serve` extra."""

from __future__ import annotations

import logging
import os
import sys

from adaptive_export.commands import EXIT_INTERRUPTED, EXIT_OK
from adaptive_export.commands.options import ServeOptions
from adaptive_export.commands.run import load_generator
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.generate import Mode

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_QUEUE = 1024


def check_serve_extra() -> None:
    """One line instead of an ImportError when the `serve` extra is missing."""
    import importlib.util

    missing = [name for name in ("starlette", "uvicorn", "pydantic") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"serve needs {', '.join(missing)}", "run `pip install 'adaptive-export[serve]'`")


def model_name(bundle_dir: str) -> str:
    """The id /v1/models reports: the bundle directory's name."""
    return os.path.basename(os.path.normpath(os.path.abspath(bundle_dir))) or "bundle"


def exposure_warning(host: str) -> str | None:
    """The one line printed when the server listens beyond this machine (it has no authentication)."""
    if host in LOOPBACK:
        return None
    return f"warning: serving on {host}: anyone who can reach this port can use the model (no authentication)"


def check_options(options: ServeOptions) -> None:
    if not 1 <= options.queue <= MAX_QUEUE:
        raise UsageError(f"--queue {options.queue} is outside 1..{MAX_QUEUE}", "pass a queue bound such as 8")
    if not 1 <= options.port <= 65535:
        raise UsageError(f"--port {options.port} is not a TCP port", "pass a port in 1..65535")
    Mode.parse(options.run.mode)


def cmd_serve(options: ServeOptions) -> int:
    check_options(options)
    check_serve_extra()
    import uvicorn

    from adaptive_export.commands.serve_app import create_app
    from adaptive_export.commands.serve_worker import DecodingSettings, GenerationWorker

    warning = exposure_warning(options.host)
    if warning:
        print(warning, file=sys.stderr)
    run = options.run
    generator = load_generator(run)
    if run.config != "auto":
        generator.bundle.config(run.config)  # an unknown id fails now, not on every request
    settings = DecodingSettings(run.config, run.mode, run.draft, run.draft_len, options.max_tokens)
    worker = GenerationWorker(generator, settings, options.queue)
    app = create_app(worker, model_name(run.bundle))
    logging.getLogger("adaptive-export").warning(
        "serving %s on http://%s:%d/v1", model_name(run.bundle), options.host, options.port
    )
    try:  # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again
        uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning")).run()
    except KeyboardInterrupt:
        print("stopped: interrupted (requests in progress were finished first)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK
