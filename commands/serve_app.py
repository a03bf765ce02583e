"""The HTTP side of `serve` (Starlette): OpenAI's routes, each request turned into a job for the
generation worker, answered as one JSON body or as server-sent events. Errors always leave in
OpenAI's error shape; a client that goes away cancels its job (at most one more token)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from adaptive_export.commands import serve_api as api
from adaptive_export.commands.serve_guard import ConnectionLimits, EventLog, accept_error_handler
from adaptive_export.commands.serve_origin import BrowserPolicy, refusal
from adaptive_export.commands.serve_worker import (
    Done,
    Failed,
    GenerationWorker,
    Job,
    JobSpec,
    Piece,
    PromptLimit,
    prompt_too_long,
)
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.sampling import SamplingParams

log = logging.getLogger("adaptive-export")


@dataclass(frozen=True)
class Wire:
    """How one endpoint writes its answers: chat messages or plain text completions."""

    prefix: str
    chunk_object: str
    response: Callable[[api.ResponseIds, api.Completion], dict[str, Any]]
    piece: Callable[[api.ResponseIds, str], dict[str, Any]]
    end: Callable[[api.ResponseIds, str], dict[str, Any]]
    opening: Callable[[api.ResponseIds], dict[str, Any]] | None = None


CHAT = Wire(
    "chatcmpl",
    "chat.completion.chunk",
    api.chat_response,
    lambda ids, text: api.chat_chunk(ids, {"content": text}),
    lambda ids, finish: api.chat_chunk(ids, {}, finish),
    lambda ids: api.chat_chunk(ids, {"role": "assistant", "content": ""}),
)
COMPLETION = Wire(
    "cmpl",
    "text_completion",
    api.completion_response,
    api.completion_chunk,
    lambda ids, finish: api.completion_chunk(ids, "", finish),
)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kinds = {404: "not_found_error", 429: "rate_limit_error"}
    kind = kinds.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = {429: "queue_full"}.get(status)
    # after a 408 the rest of the body may still be on its way: the connection cannot be reused
    headers = {"connection": "close"} if status == 408 else None
    return JSONResponse(api.error_body(message, kind, param, code), status_code=status, headers=headers)


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def job_spec(body: api.ChatRequest | api.CompletionRequest, prompt: str, raw: bool, limit: PromptLimit) -> JobSpec:
    """The worker's job for a parsed request; the prompt's own problems are refused here, on the event
    loop and before tokenizing, each naming its request field."""
    field = "prompt" if raw else "messages"
    check_prompt(prompt, field, limit)
    try:
        sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed)
    except UsageError as exc:
        raise api.BadRequest(f"{exc.problem}; {exc.fix}") from None
    budget = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    return JobSpec(prompt, raw, body.token_budget(), sampling, body.stop_strings(), field, budget)


def check_prompt(prompt: str, field: str, limit: PromptLimit) -> None:
    """Empty, not valid Unicode, or longer in bytes than the context could hold in tokens: 400 naming the field."""
    if not prompt.strip():
        raise api.BadRequest(f"{field}: the prompt is empty; send some text", field)
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError:
        raise api.BadRequest(f"{field}: the prompt holds a lone surrogate, which is not valid Unicode", field) from None
    if size > limit.max_bytes:
        raise api.BadRequest(prompt_too_long(field, prompt, limit), field)


class BrowserGuard:
    """ASGI middleware: a request a web page could forge (foreign Host or Origin, a body that is not JSON)
    is refused before routing (commands/serve_origin.py says which and why)."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
            refused = refusal(scope["method"], headers, self.policy, scope.get("server"))
            if refused is not None:
                await error(refused.status, refused.message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client closed its connection before its request's body had arrived: nobody to answer."""


async def read_body(request: Request, timeout: float) -> bytes:
    """The body, refused past MAX_BODY_BYTES (a prompt longer than any bundle's context fits well within).
    The rest of an oversized body is read and dropped, so the client, still sending, gets the 413.
    A body still incomplete after `timeout` seconds gets 408 (a slow client holds no connection for
    ever); a client that leaves mid-body is ClientGone, one log line rather than a traceback."""
    received = [0]
    try:
        body = await asyncio.wait_for(_receive_body(request, received), timeout)
    except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
        raise api.BadRequest(f"the request body did not arrive within {timeout:g} s", status=408) from None
    except ClientDisconnect:
        raise ClientGone(f"{received[0]} bytes into the body") from None
    if received[0] > api.MAX_BODY_BYTES:
        raise api.BadRequest(f"the body exceeds {api.MAX_BODY_BYTES} bytes", status=413)
    return body


async def _receive_body(request: Request, received: list[int]) -> bytes:
    """The body's first MAX_BODY_BYTES; received[0] counts every byte that came."""
    body = bytearray()
    async for chunk in request.stream():
        received[0] += len(chunk)
        if received[0] <= api.MAX_BODY_BYTES:
            body += chunk
    return bytes(body)


async def watch_disconnect(receive: Receive, job: Job) -> None:
    """Cancel the job when the client goes away (read after the body: only http.disconnect comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    job.cancel()


class Endpoints:
    """The routes of one served model."""

    def __init__(self, worker: GenerationWorker, model: str, read_timeout: float) -> None:
        self.worker, self.model, self.created = worker, model, int(time.time())
        self.read_timeout = read_timeout

    async def models(self, request: Request) -> Response:
        return JSONResponse(api.models_response(self.model, self.created))

    async def chat(self, request: Request) -> Response:
        body = api.parse_body(api.ChatRequest, await read_body(request, self.read_timeout))
        spec = job_spec(body, body.user_prompt(), False, self.worker.prompt_limit)
        return await self._answer(request, body, spec, CHAT)

    async def completions(self, request: Request) -> Response:
        body = api.parse_body(api.CompletionRequest, await read_body(request, self.read_timeout))
        spec = job_spec(body, body.prompt, True, self.worker.prompt_limit)
        return await self._answer(request, body, spec, COMPLETION)

    async def _answer(
        self, request: Request, body: api.ChatRequest | api.CompletionRequest, spec: JobSpec, wire: Wire
    ) -> Response:
        job = self.worker.new_job(spec)
        if not self.worker.submit(job):
            return error(429, "the server's queue is full; retry later")
        watcher = asyncio.ensure_future(watch_disconnect(request.receive, job))
        try:
            first = await job.events.get()  # Started, or Failed before any text
        except BaseException:
            job.cancel()
            watcher.cancel()
            raise
        if isinstance(first, Failed):
            watcher.cancel()
            return error(first.status, first.message, first.param)
        ids = api.ResponseIds.new(wire.prefix, self.model)
        if body.stream:
            return StreamingResponse(self._stream(job, ids, wire, watcher), media_type="text/event-stream")
        try:
            return await self._collect(job, ids, wire)
        finally:
            job.cancel()  # a no-op once the job has ended
            watcher.cancel()

    async def _collect(self, job: Job, ids: api.ResponseIds, wire: Wire) -> Response:
        while True:
            event = await job.events.get()
            if isinstance(event, Done):
                return JSONResponse(wire.response(ids, event.completion))
            if isinstance(event, Failed):
                return error(event.status, event.message, event.param)

    async def _stream(
        self, job: Job, ids: api.ResponseIds, wire: Wire, watcher: asyncio.Future[None]
    ) -> AsyncIterator[str]:
        """The events of one streamed answer; leaving early (the client left) cancels the job."""
        try:
            if wire.opening is not None:
                yield sse(wire.opening(ids))
            while True:
                event = await job.events.get()
                if isinstance(event, Piece):
                    yield sse(wire.piece(ids, event.text))
                    continue
                if isinstance(event, Done):
                    yield sse(wire.end(ids, event.completion.finish_reason))
                    yield sse(api.final_chunk(ids, wire.chunk_object, event.completion))
                elif isinstance(event, Failed):
                    yield sse(api.error_body(event.message, "server_error"))
                yield sse("[DONE]")
                return
        finally:
            job.cancel()
            watcher.cancel()


async def _bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, api.BadRequest)
    return error(exc.status, exc.message, exc.param)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")


def _client_gone(events: EventLog) -> Callable[[Request, Exception], Any]:
    async def handle(request: Request, exc: Exception) -> Response:
        events.note("gone", f"a client closed its connection {exc} of {request.method} {request.url.path}")
        return Response(status_code=499)  # nobody reads it; uvicorn drops it

    return handle


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unexpected %s on %s: %s", type(exc).__name__, request.url.path, exc)
    return error(500, "internal server error; see the server's log")


def create_app(
    worker: GenerationWorker,
    model: str,
    limits: ConnectionLimits | None = None,
    events: EventLog | None = None,
    policy: BrowserPolicy | None = None,
) -> Starlette:
    """The ASGI app; the worker starts and stops with it. Browsers: only the allowed origins get CORS
    headers (and preflight answers); everything else a page could send is refused by BrowserGuard."""
    limits, events, policy = limits or ConnectionLimits(), events or EventLog(), policy or BrowserPolicy()
    endpoints = Endpoints(worker, model, limits.read_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_exception_handler(accept_error_handler(events))
        worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    routes = [
        Route("/v1/models", endpoints.models, methods=["GET"]),
        Route("/v1/chat/completions", endpoints.chat, methods=["POST"]),
        Route("/v1/completions", endpoints.completions, methods=["POST"]),
    ]
    handlers = {
        api.BadRequest: _bad_request,
        ClientGone: _client_gone(events),
        HTTPException: _http_error,
        Exception: _unexpected,
    }
    middleware = [Middleware(BrowserGuard, policy=policy)]
    if policy.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(policy.allowed_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            )
        )
    app = Starlette(
        routes=routes,
        exception_handlers=handlers,  # type: ignore[arg-type]
        lifespan=lifespan,
        middleware=middleware,
    )
    app.state.worker = worker
    return app
