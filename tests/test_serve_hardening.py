"""`serve` against hostile or careless clients (docs/hardening.md, "serve"): half-sent requests,
connection floods, clients that leave mid-body. The real server (uvicorn, in a thread of this
process, as tests/test_serve.py runs it) on a loopback port, spoken to over real sockets; every
loop here is bounded in count and time, and all traffic goes to 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# through test_serve, whose imports skip (or fail in CI) where the serve extra is missing
from tests.test_serve import BrowserPolicy, ConnectionLimits, Served, chat, serving, wait_for

HALF_SENT = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"


class Captured(logging.Handler):
    """Every record the server's loggers (ours, uvicorn's, asyncio's) emit, formatted with tracebacks."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(logging.Formatter("%(name)s %(message)s").format(record))

    def text(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def captured_logs() -> Iterator[Captured]:
    handler = Captured()
    loggers = [logging.getLogger(name) for name in ("adaptive-export", "uvicorn", "uvicorn.error", "asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def connect(served: Served) -> socket.socket:
    host, port = served.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_server(sock: socket.socket, by: float) -> bool:
    """Read until the server closes (True) or the monotonic deadline `by` passes (False)."""
    while (left := by - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


@pytest.fixture(scope="module")
def guarded(tiny_bundle: Path) -> Iterator[Served]:
    with serving(tiny_bundle, queue=4, limits=ConnectionLimits(max_connections=20, read_timeout=1.0)) as server:
        yield server


def test_half_sent_requests_are_closed_and_a_real_request_is_served(guarded: Served) -> None:
    """50 connections that never finish their headers, over a cap of 20: the oldest idle ones are closed
    to make room, a real request is answered meanwhile, the rest close within --read-timeout, and the
    log stays a few lines."""
    count, timeout = 50, 1.0
    with captured_logs() as logs:
        opened = time.monotonic()
        sockets = [connect(guarded) for _ in range(count)]
        try:
            for sock in sockets:
                sock.sendall(HALF_SENT)
            answer = chat(guarded, max_tokens=4)  # a new connection over the cap: an idle one makes room
            assert answer.choices[0].finish_reason in {"stop", "length"}
            deadline = opened + timeout + 5.0  # the bound, plus a loaded 2-core machine's scheduling
            assert all(closed_by_server(sock, deadline) for sock in sockets)
        finally:
            for sock in sockets:
                sock.close()
    assert "Traceback" not in logs.text()
    assert len(logs.lines) <= 6 and len(logs.text()) < 2000, logs.text()
    assert any("--max-connections" in line for line in logs.lines)
    assert any("--read-timeout" in line for line in logs.lines)


def test_a_slow_body_gets_408_and_is_closed(guarded: Served) -> None:
    """Headers complete, the body stalls: 408 in OpenAI's shape after --read-timeout, then the close."""
    with connect(guarded) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny", '
        )
        sock.settimeout(10)
        started, answer = time.monotonic(), b""
        while chunk := sock.recv(65536):
            answer += chunk
        assert time.monotonic() - started < 6
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b'"invalid_request_error"' in answer and b"did not arrive within 1 s" in answer


def test_a_client_leaving_mid_body_is_one_line(guarded: Served) -> None:
    """A client that closes before its body is complete: one log line, no traceback, and the server
    answers the next request."""
    with captured_logs() as logs:
        with connect(guarded) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 5000\r\n\r\n" + b'{"model": "tiny", "messages": ['
            )
            time.sleep(0.2)  # the app is reading the body
        wait_for(lambda: bool(logs.lines), seconds=10)
        time.sleep(0.2)  # anything logged after the first line
    assert len(logs.lines) == 1 and "Traceback" not in logs.text(), logs.text()
    assert "closed its connection" in logs.lines[0]
    assert chat(guarded, max_tokens=2).choices[0].finish_reason


def post(served: Served, route: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """One POST over a fresh connection: the status and the JSON answer."""
    host, port = served.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", f"/v1/{route}", body, {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def test_a_megabyte_prompt_is_refused_before_tokenizing(guarded: Served) -> None:
    """3 MB of prompt cannot fit 128 tokens: refused by its byte length, without the tokenizer (which
    took seconds and hundreds of MB on such a prompt), naming the field."""
    body = json.dumps({"model": "tiny", "prompt": "lorem ipsum " * 250_000}).encode()
    limit = guarded.worker.prompt_limit
    assert limit.max_len == 128 and limit.max_bytes < 1 << 20
    started = time.monotonic()
    status, answer = post(guarded, "completions", body)
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert "3000000 bytes" in answer["error"]["message"] and f"{limit.max_bytes} bytes" in answer["error"]["message"]
    assert time.monotonic() - started < 3


def test_a_prompt_just_under_the_byte_bound_is_tokenized_and_refused_by_tokens(guarded: Served) -> None:
    """Under the byte bound the tokens decide, still naming the field (the bound only ever refuses early)."""
    limit = guarded.worker.prompt_limit
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "a b " * (limit.max_bytes // 8)}]})
    status, answer = post(guarded, "chat/completions", body.encode())
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert "tokens and fills the bundle's context (max_len 128)" in answer["error"]["message"]


CHAT_FIELDS = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 100000}, "max_tokens"),
        (
            "chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000},
            "max_completion_tokens",
        ),
        ("completions", {"model": "tiny", "prompt": "   "}, "prompt"),
        ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": " "}]}, "messages"),
        ("completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ("completions", {"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("completions", {"model": "tiny", "prompt": "hi", "stop": "x" * 1025}, "stop"),
        ("chat/completions", {**CHAT_FIELDS, "stop": ["\n", "y" * 1025]}, "stop"),
    ],
)
def test_errors_name_the_request_field_not_the_cli_option(
    guarded: Served, route: str, body: dict[str, Any], param: str
) -> None:
    """OpenAI's `param` names the field at fault, and the message speaks of request fields: no CLI flags."""
    status, answer = post(guarded, route, json.dumps(body).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    message = answer["error"]["message"]
    assert message.startswith(param) or f" {param}" in message, message
    assert "--" not in message and "-p TEXT" not in message, message
    assert "64 stop strings" not in message, message  # the runtime's own bounds are not serve's


CHAT_BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.mark.parametrize(
    "headers, status, words",
    [
        ({"Content-Type": "text/plain"}, 415, "not JSON"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "not JSON"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "not JSON"),
        ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403, "--allow-origin"),
        ({"Origin": "http://evil.example"}, 403, "--allow-origin"),
        ({"Origin": "null"}, 403, "--allow-origin"),
        ({"Host": "evil.example"}, 403, "DNS rebinding"),
        ({"Host": "rebind.evil.example:{port}", "Origin": "http://rebind.evil.example:{port}"}, 403, "Host"),
        ({"Host": "127.0.0.1:1"}, 403, "Host"),
    ],
)
def test_what_a_web_page_could_send_is_refused(
    guarded: Served, headers: dict[str, str], status: int, words: str
) -> None:
    """A page's "simple" request (text/plain, a form: no CORS preflight), a foreign Origin, and DNS rebinding
    (a foreign Host naming this port): each refused in OpenAI's error shape before it reaches the model."""
    port = guarded.url.rsplit(":", 1)[1]
    headers = {name: value.replace("{port}", port) for name, value in headers.items()}
    got, answer = post(guarded, "chat/completions", CHAT_BODY, headers)
    assert got == status, answer
    assert answer["error"]["type"] == "invalid_request_error" and words in answer["error"]["message"], answer


def test_the_server_own_names_and_origin_are_served(guarded: Served) -> None:
    port = guarded.url.rsplit(":", 1)[1]
    for headers in (
        {"Host": f"localhost:{port}"},
        {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}"},
        {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
        {"Content-Type": "application/json; charset=utf-8"},
    ):
        got, answer = post(guarded, "chat/completions", CHAT_BODY, headers)
        assert got == 200, (headers, answer)


def test_allow_origin_lets_that_page_in_with_cors(tiny_bundle: Path) -> None:
    """--allow-origin: that origin's requests are served with CORS headers and its preflight answered;
    any other origin is still refused."""
    policy = BrowserPolicy(allowed_origins=("http://app.example:3000",))
    with serving(tiny_bundle, queue=2, policy=policy) as served:
        host, port = served.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        preflight = {
            "Origin": "http://app.example:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        }
        connection.request("OPTIONS", "/v1/chat/completions", headers=preflight)
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        assert response.getheader("access-control-allow-origin") == "http://app.example:3000"
        connection.close()
        got, answer = post(served, "chat/completions", CHAT_BODY, {"Origin": "http://app.example:3000"})
        assert got == 200, answer
        got, answer = post(served, "chat/completions", CHAT_BODY, {"Origin": "http://other.example:3000"})
        assert got == 403, answer
