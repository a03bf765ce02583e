"""The OpenAI wire format `serve` speaks: request bodies (pydantic, unknown fields refused) and the
JSON of responses, stream chunks and errors. Knows nothing of the runtime: commands/serve.py maps
these onto a Generator."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaptive_export.runtimes.limits import MAX_STOP_CHARS  # each stop string's length, the runtime's bound

MAX_STOP = 4  # OpenAI's own bound on stop sequences
MAX_BODY_BYTES = 4 << 20  # a request body; far more text than any bundle's context holds


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # usage is always in the last chunk; accepted for clients that ask


class _Body(BaseModel):
    """Fields every generation endpoint takes; an unknown field is a 400, never silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)  # greedy unless asked, like `run`
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # not OpenAI's; llama-server and vLLM take it too
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one sequence at a time: the runtime holds one KV arena
    user: str | None = Field(default=None, max_length=256)  # accepted and ignored, as OpenAI logs it

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise BadRequest(f"stop holds {len(stops)} strings; at most {MAX_STOP} are allowed", "stop")
        for index, stop in enumerate(stops):
            if len(stop) > MAX_STOP_CHARS:
                where = "stop" if isinstance(self.stop, str) else f"stop[{index}]"
                message = f"{where} is {len(stop)} characters long; at most {MAX_STOP_CHARS} are allowed"
                raise BadRequest(message, "stop")
        return stops


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def user_prompt(self) -> str:
        """The one user turn: a bundle's chat template is rendered at build time around a single user
        message (runtimes/text.py), so a conversation cannot be formatted the way the model was trained."""
        if len(self.messages) != 1 or self.messages[0].role != "user":
            roles = ", ".join(m.role for m in self.messages)
            raise BadRequest(
                f"messages must be exactly one user message (got: {roles}); the bundle's chat template is "
                "rendered at build time for one user turn. Use /v1/completions with your own formatting otherwise",
                "messages",
            )
        return self.messages[0].text()


class CompletionRequest(_Body):
    prompt: str

    def token_budget(self) -> int | None:
        return self.max_tokens


class BadRequest(Exception):
    """A request the server refuses (400 unless said otherwise), in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """The typed request, or BadRequest naming the first problem (bad JSON, unknown field, bad value)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "json_invalid":
            raise BadRequest(f"the body is not valid JSON: {error['msg']}") from None
        if error["type"] == "extra_forbidden":
            raise BadRequest(f"unknown field {where!r}: this server does not support it", where) from None
        raise BadRequest(f"{where or 'body'}: {error['msg']}", where or None) from None


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (what its clients parse into APIStatusError.message)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Completion:
    """What one generation gives the response: its text, why it ended, counts and runtime stats."""

    text: str
    finish_reason: str  # "stop" (end of text or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class ResponseIds:
    """One response's id, creation time and model name, shared by all its stream chunks."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseIds:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


def usage(done: Completion) -> dict[str, int]:
    total = done.prompt_tokens + done.completion_tokens
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens, "total_tokens": total}


def chat_response(ids: ResponseIds, done: Completion) -> dict[str, Any]:
    message = {"role": "assistant", "content": done.text}
    choice = {"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": None}
    return _envelope(ids, "chat.completion", [choice]) | {"usage": usage(done), "adaptive_export": done.stats}


def chat_chunk(ids: ResponseIds, delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return _envelope(ids, "chat.completion.chunk", [choice])


def completion_response(ids: ResponseIds, done: Completion) -> dict[str, Any]:
    choice = {"index": 0, "text": done.text, "finish_reason": done.finish_reason, "logprobs": None}
    return _envelope(ids, "text_completion", [choice]) | {"usage": usage(done), "adaptive_export": done.stats}


def completion_chunk(ids: ResponseIds, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return _envelope(ids, "text_completion", [choice])


def final_chunk(ids: ResponseIds, object_name: str, done: Completion) -> dict[str, Any]:
    """The stream's last data event: no choices, the usage and the runtime's stats (OpenAI's
    include_usage chunk, with the stats beside it)."""
    return _envelope(ids, object_name, []) | {"usage": usage(done), "adaptive_export": done.stats}


def models_response(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "local"}]}


def _envelope(ids: ResponseIds, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": ids.id, "object": object_name, "created": ids.created, "model": ids.model, "choices": choices}
