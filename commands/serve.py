"""`serve`: one bundle behind an OpenAI-compatible HTTP API (docs/serve.md), torch-free.

The bundle is loaded once; generation runs on one worker thread (commands/serve_worker.py),
the HTTP side is Starlette on uvicorn (commands/serve_app.py), both from the `serve` extra."""

from __future__ import annotations

import logging
import os
import resource
import socket
import sys
from typing import TYPE_CHECKING, Any

from adaptive_export.commands import EXIT_INTERRUPTED, EXIT_OK
from adaptive_export.commands.options import ServeOptions
from adaptive_export.commands.run import load_generator
from adaptive_export.runtimes.errors import UsageError

if TYPE_CHECKING:  # the serve extra is imported only once `serve` runs (the CLI imports this module)
    from adaptive_export.commands.serve_guard import ConnectionLimits, EventLog

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_QUEUE = 1024
MAX_CONNECTIONS = 10000
MAX_READ_TIMEOUT_S = 3600.0
FD_RESERVE = 64  # descriptors beside the connections: engines, tokenizer, pipes, the listening socket


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
    if not 1 <= options.max_connections <= MAX_CONNECTIONS:
        raise UsageError(
            f"--max-connections {options.max_connections} is outside 1..{MAX_CONNECTIONS}", "pass a cap such as 100"
        )
    if not 0 < options.read_timeout <= MAX_READ_TIMEOUT_S:
        raise UsageError(
            f"--read-timeout {options.read_timeout:g} is outside (0, {MAX_READ_TIMEOUT_S:g}] seconds",
            "pass a number of seconds such as 10",
        )
    from adaptive_export.commands.serve_origin import check_origin_rules

    for origin in options.allow_origins:
        problem = check_origin_rules(origin)
        if problem:
            raise UsageError(problem, "pass an origin as a browser sends it, such as http://localhost:3000")


def ensure_descriptors(max_connections: int) -> None:
    """Raise the soft open-file limit to hold every allowed connection plus the process's own files:
    a process out of descriptors cannot accept, and asyncio retries every accept in a loop."""
    needed = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise UsageError(
                f"--max-connections {max_connections} needs {needed} open files, over this process's limit of {hard}",
                f"pass --max-connections {max(1, hard - FD_RESERVE)} or less, or raise `ulimit -n`",
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that an address in use is one line (exit 2), not uvicorn's
    log and exit 1; listening before the `serving` line, so a client that reads it can connect."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"--host {host!r} is not an address to listen on ({exc})", "pass 127.0.0.1") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections wait in the backlog from here until uvicorn accepts them
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host} port {port}: {exc.strerror}", "pass another --port") from None
    return sock


def uvicorn_config(app: Any, limits: ConnectionLimits, events: EventLog) -> Any:
    """uvicorn as `serve` runs it (the tests run the same): the guarded h11 protocol, no websockets,
    its own log at warning level."""
    import uvicorn

    from adaptive_export.commands.serve_guard import protocol_class

    return uvicorn.Config(app, http=protocol_class(limits, events), ws="none", log_level="warning")


def cmd_serve(options: ServeOptions) -> int:
    check_options(options)
    check_serve_extra()
    import uvicorn

    from adaptive_export.commands.serve_app import create_app
    from adaptive_export.commands.serve_guard import ConnectionLimits, EventLog
    from adaptive_export.commands.serve_origin import BrowserPolicy
    from adaptive_export.commands.serve_worker import GenerationWorker

    warning = exposure_warning(options.host)
    if warning:
        print(warning, file=sys.stderr)
    ensure_descriptors(options.max_connections)
    run = options.run
    generator = load_generator(run)
    if run.decoding.config != "auto":
        generator.bundle.config(run.decoding.config)  # an unknown id fails now, not on every request
    worker = GenerationWorker(generator, run.decoding, options.queue, options.max_tokens)
    limits, events = ConnectionLimits(options.max_connections, options.read_timeout), EventLog()
    policy = BrowserPolicy(options.host, options.allow_origins)
    app = create_app(worker, model_name(run.bundle), limits, events, policy)
    sock = bind(options.host, options.port)
    logging.getLogger("adaptive-export").warning(
        "serving %s on http://%s:%d/v1", model_name(run.bundle), options.host, options.port
    )
    try:  # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again
        uvicorn.Server(uvicorn_config(app, limits, events)).run(sockets=[sock])
    except KeyboardInterrupt:
        print("stopped: interrupted (requests in progress were finished first)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK
