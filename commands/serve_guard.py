"""What `serve` does about clients that hold connections without finishing a request (slowloris),
that send requests without reading the answers (slow readers), and about floods of connections:
uvicorn alone waits forever for a half-sent request or for a send buffer to drain, and accepts
until the process runs out of file descriptors, so this module bounds all three at the protocol
level and logs each such event in one rate-limited line (never a traceback)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("adaptive-export")


@dataclass(frozen=True)
class ConnectionLimits:
    """`serve --max-connections/--read-timeout`: connections open at once, and the seconds a client
    has to send a request's headers and then, separately, its body."""

    max_connections: int = 100
    read_timeout: float = 10.0


class EventLog:
    """One log line per kind of event per `interval` seconds; the lines skipped meanwhile are counted
    in the next one. A flood of hostile connections must not turn into a flood of log output."""

    def __init__(self, interval: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self._last: dict[str, tuple[float, int]] = {}

    def note(self, kind: str, line: str) -> None:
        now = self.clock()
        last, skipped = self._last.get(kind, (-math.inf, 0))
        if now - last < self.interval:
            self._last[kind] = (last, skipped + 1)
            return
        suffix = f" (and {skipped} more since the last such line)" if skipped else ""
        log.warning("%s%s", line, suffix)
        self._last[kind] = (now, 0)


def raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's error shape, written before any request was read
    (h11 cannot send a response then), closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body.encode("utf-8")


def protocol_class(limits: ConnectionLimits, events: EventLog) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on request headers and a cap on open connections."""

    class GuardedProtocol(H11Protocol):
        """Over the cap, the connection that has waited longest without sending a whole request's
        headers (a half-sent request or an idle keep-alive) is closed to make room; when every open
        connection is busy with a request, the newcomer gets 503. Headers must arrive within
        `read_timeout` of the connection or of the request's first byte (the body's own deadline is
        the app's, commands/serve_app.py read_body, which can still answer 408)."""

        opened: float = 0.0
        deadline: asyncio.TimerHandle | None = None
        stalled: float | None = None  # when the send buffer filled (answers not being read), until it drains
        write_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)  # type: ignore[arg-type]
            self.opened = time.monotonic()
            if len(self.connections) > limits.max_connections and not self._make_room():
                events.note(
                    "busy",
                    f"refused a connection with 503: all {limits.max_connections} connections (--max-connections) "
                    "are busy with requests",
                )
                self.transport.write(raw_error(503, "Service Unavailable", "too many connections; retry later"))
                self.transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.awaiting_headers():
                if self.deadline is None:  # the first bytes of a request on a kept-alive connection
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._unstall()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            """The transport's buffer passed its high-water mark: the client is not reading. It has
            `read_timeout` to drain it (the write deadline), or the connection is dropped."""
            super().pause_writing()
            if self.stalled is None:
                self.stalled = time.monotonic()
                self.write_deadline = self.loop.call_later(limits.read_timeout, self._write_timed_out)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._unstall()

        def _unstall(self) -> None:
            self.stalled = None
            if self.write_deadline is not None:
                self.write_deadline.cancel()
                self.write_deadline = None

        def _write_timed_out(self) -> None:
            self.write_deadline = None
            if self.stalled is None or self.transport.is_closing():
                return
            events.note(
                "unread",
                f"closed a connection from {_peer(self)}: its answers went unread for {limits.read_timeout:g} s "
                "(--read-timeout)",
            )
            self._drop()

        def _drop(self) -> None:
            """Close without flushing: the buffer is what the client will not read."""
            self._disarm()
            self._unstall()
            self.transport.abort()

        def awaiting_headers(self) -> bool:
            """No request in progress: nothing sent yet, part of a request's headers, or kept alive."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _make_room(self) -> bool:
            """Close the idle connection open longest, else the one whose answers have gone unread
            longest (a client that pipelines requests and never reads keeps its connection busy)."""
            others = [c for c in self.connections if c is not self and isinstance(c, GuardedProtocol)]
            others = [c for c in others if not c.transport.is_closing()]
            idle = [c for c in others if c.awaiting_headers()]
            if idle:
                oldest = min(idle, key=lambda c: c.opened)
                events.note(
                    "evicted",
                    f"closed an idle connection from {_peer(oldest)}: over --max-connections "
                    f"{limits.max_connections}, the one waiting longest without a request made room",
                )
                oldest._close(partial_request=False)
                return True
            unread = [c for c in others if c.stalled is not None]
            if not unread:
                return False
            stalest = min(unread, key=lambda c: c.stalled or 0.0)
            events.note(
                "evicted-unread",
                f"closed a connection from {_peer(stalest)}: over --max-connections {limits.max_connections}, "
                "the one whose answers went unread longest made room",
            )
            stalest._drop()
            return True

        def _arm(self) -> None:
            self._disarm()
            self.deadline = self.loop.call_later(limits.read_timeout, self._headers_timed_out)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _headers_timed_out(self) -> None:
            self.deadline = None
            if not self.awaiting_headers() or self.transport.is_closing():
                return
            events.note(
                "slow",
                f"closed a connection from {_peer(self)}: no complete request headers within "
                f"{limits.read_timeout:g} s (--read-timeout)",
            )
            self._close(partial_request=bool(self.conn.trailing_data[0]))

        def _close(self, partial_request: bool) -> None:
            """Close at once; a client that began a request is told why (408) first."""
            self._disarm()
            if partial_request:
                message = f"the request headers did not arrive within {limits.read_timeout:g} s"
                self.transport.write(raw_error(408, "Request Timeout", message))
            self.transport.close()

    return GuardedProtocol


def _peer(protocol: H11Protocol) -> str:
    client: Any = protocol.client
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"


def accept_error_handler(events: EventLog) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """The event loop's handler: asyncio reports `accept()` failing (out of file descriptors) with a
    traceback each time it retries; one rate-limited line says what happened and what to change."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "accept" in str(context.get("message", "")):
            events.note(
                "accept",
                f"cannot accept connections: {context.get('exception')} (lower --max-connections or raise `ulimit -n`)",
            )
            return
        loop.default_exception_handler(context)

    return handle
