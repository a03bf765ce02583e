"""`serve`: the tiny bundle behind the real HTTP stack (uvicorn on a loopback port, in a thread of this
process), spoken to with the real `openai` client; answers compared with the Generator's own."""

from __future__ import annotations

import contextlib
import importlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import running_in_ci  # noqa: E402
from tests.test_torch_free import run_blocked  # noqa: E402


def serve_extra(name: str) -> Any:
    """The `serve` extra and the `openai` client: skipped where missing, a failure in CI (which installs them)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if running_in_ci():
            raise
        pytest.skip(f"{name} is not installed (pip install -e '.[serve,test]')", allow_module_level=True)


openai = serve_extra("openai")
uvicorn = serve_extra("uvicorn")
serve_extra("starlette")

from adaptive_export.commands.cli import build_parser  # noqa: E402
from adaptive_export.commands.options import RunOptions  # noqa: E402
from adaptive_export.commands.run import load_generator  # noqa: E402
from adaptive_export.commands.serve import exposure_warning, model_name, uvicorn_config  # noqa: E402
from adaptive_export.commands.serve_app import create_app  # noqa: E402
from adaptive_export.commands.serve_guard import ConnectionLimits, EventLog  # noqa: E402
from adaptive_export.commands.serve_origin import BrowserPolicy  # noqa: E402
from adaptive_export.commands.serve_worker import GenerationWorker  # noqa: E402
from adaptive_export.runtimes import Generator, SamplingParams  # noqa: E402
from adaptive_export.runtimes.settings import DecodingSettings  # noqa: E402

PROMPT = "What is the capital of France?"


@dataclass
class Served:
    url: str
    worker: GenerationWorker
    model: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_for(condition: Callable[[], bool], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@contextlib.contextmanager
def serving(
    bundle: Path,
    queue: int,
    settings: DecodingSettings | None = None,
    limits: ConnectionLimits | None = None,
    policy: BrowserPolicy | None = None,
) -> Iterator[Served]:
    """uvicorn configured as `serve` configures it, on a socket bound here (so the port is known and free)."""
    worker = GenerationWorker(load_generator(RunOptions(str(bundle))), settings or DecodingSettings(), queue, 256)
    limits, events = limits or ConnectionLimits(), EventLog()
    app = create_app(worker, model_name(str(bundle)), limits, events, policy)
    server = uvicorn.Server(uvicorn_config(app, limits, events))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", worker, model_name(str(bundle)))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


@pytest.fixture(scope="module")
def served(tiny_bundle: Path) -> Iterator[Served]:
    with serving(tiny_bundle, queue=8) as server:
        yield server


@pytest.fixture(scope="module")
def reference(tiny_bundle: Path) -> Generator:
    return Generator(tiny_bundle)


def chat(served: Served, **kwargs: object) -> object:
    return served.client().chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": PROMPT}], **kwargs
    )


def test_should_stop_ends_the_generation_at_that_token(reference: Generator) -> None:
    """The runtime's hook the server cancels through: asked once per token, True ends it there."""
    assert reference.generate(PROMPT, max_new_tokens=10).stats.stop_reason == "length"
    calls = []

    def third_call() -> bool:
        calls.append(1)
        return len(calls) == 3

    pieces = reference.stream(PROMPT, max_new_tokens=10, should_stop=third_call)
    text = "".join(pieces)
    result = reference.last_result
    assert len(calls) == 3 and len(result.tokens) == 3 and result.stats.stop_reason == "cancelled"
    assert result.tokens == reference.generate(PROMPT, max_new_tokens=3).tokens and text == result.text


def test_models_lists_the_bundle(served: Served) -> None:
    assert [m.id for m in served.client().models.list()] == ["tiny"]


def test_chat_greedy_equals_the_generator(served: Served, reference: Generator) -> None:
    expected = reference.generate(PROMPT, max_new_tokens=12)
    response = chat(served, max_tokens=12, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == ("length" if expected.stats.stop_reason == "length" else "stop")
    assert response.usage.prompt_tokens == len(expected.prompt_ids)
    assert response.usage.completion_tokens == len(expected.tokens)
    stats = response.model_extra["adaptive_export"]
    assert stats["mode"] == expected.stats.mode and stats["new_tokens"] == len(expected.tokens) and stats["tpot_ms"] > 0


def test_chat_streamed_equals_the_generator(served: Served, reference: Generator) -> None:
    expected = reference.generate(PROMPT, max_new_tokens=12)
    chunks = list(chat(served, max_tokens=12, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in {"stop", "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.tokens)
    assert chunks[-1].model_extra["adaptive_export"]["new_tokens"] == len(expected.tokens)
    assert len({c.id for c in chunks}) == 1


def test_completions_take_raw_text(served: Served, reference: Generator) -> None:
    prompt = "The quick brown fox"
    expected = reference.generate(prompt, max_new_tokens=10, raw=True)
    client = served.client()
    response = client.completions.create(model=served.model, prompt=prompt, max_tokens=10)
    assert response.choices[0].text == expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_ids)
    streamed = client.completions.create(model=served.model, prompt=prompt, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_stop_string_cuts_the_text_and_ends(served: Served, reference: Generator) -> None:
    full = reference.generate(PROMPT, max_new_tokens=24).text
    assert len(full) > 6, "the tiny model should say something"
    stop = full[3:6]
    expected = reference.generate(PROMPT, max_new_tokens=24, stop=[stop])
    response = chat(served, max_tokens=24, stop=[stop, "never-appears"])
    assert response.choices[0].message.content == expected.text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_sampling_parameters_reach_the_runtime(served: Served, reference: Generator) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    expected = reference.generate(PROMPT, max_new_tokens=16, sampling=params)
    response = chat(served, max_tokens=16, temperature=0.9, top_p=0.95, seed=7, extra_body={"top_k": 20})
    assert response.choices[0].message.content == expected.text
    greedy = reference.generate(PROMPT, max_new_tokens=16)
    assert expected.tokens != greedy.tokens  # the parameters changed the answer, so the match above means something


def test_two_concurrent_clients_both_complete(served: Served, reference: Generator) -> None:
    prompts = [PROMPT, "Write a short poem about the sea."]
    expected = [reference.generate(p, max_new_tokens=20).text for p in prompts]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        client = served.client()
        messages = [{"role": "user", "content": prompts[i]}]
        stream = client.chat.completions.create(model=served.model, messages=messages, max_tokens=20, stream=True)
        answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    waiting: list[int] = []  # requests queued, seen at each token: the two must overlap
    served.worker.pace = lambda: (waiting.append(served.worker.waiting()), time.sleep(0.01))
    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        served.worker.pace = None
    assert answers == {0: expected[0], 1: expected[1]}
    assert max(waiting) == 1  # one generated while the other waited


def test_disconnect_mid_stream_stops_within_one_token(served: Served, reference: Generator) -> None:
    max_tokens = 100
    assert reference.generate(PROMPT, max_new_tokens=max_tokens).stats.stop_reason == "length"  # would run on
    counters = served.worker.counters
    cancelled_before = counters.cancelled
    served.worker.pace = lambda: time.sleep(0.02)  # about 2 s for the whole answer: the client leaves long before
    try:
        stream = chat(served, max_tokens=max_tokens, stream=True)
        pieces = [next(iter(stream)) for _ in range(3)]
        assert len(pieces) == 3
        stream.close()
        wait_for(lambda: counters.cancelled == cancelled_before + 1, seconds=30)
    finally:
        served.worker.pace = None
    assert counters.tokens_after_cancel[-1] <= 1
    assert chat(served, max_tokens=4).choices[0].finish_reason  # the worker is free for the next request


def ask(url: str, body: bytes | None = None) -> tuple[int, dict[str, object]]:
    """The status and JSON answer of a POST of `body` (a GET without one), errors included."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data=body, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    return ask(url, body)


def test_bad_json_gets_400_in_openai_shape(served: Served) -> None:
    status, body = post(f"{served.url}/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in body["error"]["message"] and "Traceback" not in json.dumps(body)


def test_unknown_field_gets_400_naming_it(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(served, max_tokens=4, extra_body={"frobnicate": 1})
    assert caught.value.status_code == 400
    assert "frobnicate" in caught.value.message


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 100000}, "max_len"),
        ({"model": "tiny", "messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}, "one"),
        ({"model": "tiny", "prompt": "   "}, "empty"),
    ],
)
def test_bad_values_get_400_with_a_message(served: Served, body: dict[str, object], words: str) -> None:
    route = "chat/completions" if "messages" in body else "completions"
    status, answer = post(f"{served.url}/v1/{route}", json.dumps(body).encode())
    assert status == 400, answer
    assert words in answer["error"]["message"]


def test_full_queue_gets_429(tiny_bundle: Path) -> None:
    with serving(tiny_bundle, queue=1) as served:
        release, running = threading.Event(), threading.Event()

        def pace() -> None:
            running.set()
            release.wait(30)

        served.worker.pace = pace
        results: list[str] = []

        def ask() -> None:
            results.append(chat(served, max_tokens=3).choices[0].finish_reason)

        first = threading.Thread(target=ask)
        first.start()
        assert running.wait(60)  # the first request is generating
        second = threading.Thread(target=ask)
        second.start()
        wait_for(lambda: served.worker.waiting() == 1)  # the second waits in the queue
        with pytest.raises(openai.RateLimitError) as caught:
            chat(served, max_tokens=3)
        assert caught.value.status_code == 429 and "queue is full" in caught.value.message
        release.set()
        first.join(timeout=60)
        second.join(timeout=60)
        assert len(results) == 2


def test_an_unknown_path_gets_404_in_openai_shape(served: Served) -> None:
    status, answer = ask(f"{served.url}/v1/engines")
    assert status == 404, answer
    assert answer["error"]["type"] == "not_found_error" and "/v1/engines" in answer["error"]["message"]


def test_a_wrong_method_gets_405_naming_it(served: Served) -> None:
    status, answer = ask(f"{served.url}/v1/completions")
    assert status == 405, answer
    assert answer["error"]["message"].startswith("GET /v1/completions")


def test_a_failure_while_generating_is_500_and_the_worker_lives_on(served: Served) -> None:
    """A bug in the generation loop (raised here through the per-token hook) answers 500 without a
    traceback, and the worker thread that every later request waits on keeps serving."""

    def fail() -> None:
        raise RuntimeError("a bug in the loop")

    served.worker.pace = fail
    try:
        status, answer = post(f"{served.url}/v1/completions", json.dumps({"model": "tiny", "prompt": PROMPT}).encode())
    finally:
        served.worker.pace = None
    assert status == 500, answer
    assert answer["error"]["type"] == "server_error" and "Traceback" not in json.dumps(answer)
    assert chat(served, max_tokens=4).choices[0].finish_reason  # the next request is answered


def test_body_over_the_limit_gets_413(served: Served) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x" * (5 << 20)}).encode()
    status, answer = post(f"{served.url}/v1/completions", body)
    assert status == 413 and "exceeds" in answer["error"]["message"]


def test_speculative_mode_reports_acceptance(tiny_bundle: Path, reference: Generator) -> None:
    prompt = "the sea and the sky and the sea and the sky and the sea"
    expected = reference.generate(prompt, max_new_tokens=20, raw=True, mode="spec", draft="prompt_lookup")
    with serving(tiny_bundle, queue=2, settings=DecodingSettings(mode="spec", draft="prompt_lookup")) as served:
        response = served.client().completions.create(model=served.model, prompt=prompt, max_tokens=20)
    assert response.choices[0].text == expected.text
    stats = response.model_extra["adaptive_export"]
    assert stats["mode"] == "spec" and stats["draft_source"] == "prompt_lookup"
    assert stats["drafted"] == expected.stats.speculation["drafted"] > 0
    assert 0 < stats["acceptance"] <= 1


def test_serve_is_torch_free(tiny_bundle: Path) -> None:
    code = f"""
from adaptive_export.commands.options import RunOptions
from adaptive_export.commands.run import load_generator
from adaptive_export.commands.serve_app import create_app
from adaptive_export.commands.serve_worker import GenerationWorker
from adaptive_export.runtimes.settings import DecodingSettings
app = create_app(GenerationWorker(load_generator(RunOptions({str(tiny_bundle)!r})), DecodingSettings(), 1, 64), 'tiny')
assert not any(m.split('.')[0] in ('torch', 'transformers') for m in sys.modules), 'torch leaked'
print('ok')
"""
    proc = run_blocked(code, Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


def test_listening_beyond_loopback_warns() -> None:
    assert exposure_warning("127.0.0.1") is None and exposure_warning("localhost") is None
    warning = exposure_warning("0.0.0.0")
    assert warning is not None and warning.startswith("warning:") and "\n" not in warning


def test_serve_help_explains_each_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for option in ("--host", "--port", "--queue", "--max-tokens", "127.0.0.1", "429"):
        assert option in text


def test_serve_options_hold_runs_decoding_and_engine_options() -> None:
    """`serve`'s namespace fills its own options and, through RunOptions, run's decoding and
    engine options; run's prompt and sampling options stay at their defaults."""
    from adaptive_export.commands.options import ServeOptions

    argv = ["serve", "b", "--queue", "3", "--mode", "spec", "--draft-len", "2", "--threads", "2", "--verify", "size"]
    options = ServeOptions.from_args(build_parser().parse_args(argv))
    assert (options.queue, options.port, options.max_tokens) == (3, 8000, 256)
    run = options.run
    assert (run.bundle, run.decoding.mode, run.decoding.draft_len, run.threads, run.verify) == (
        "b",
        "spec",
        2,
        2,
        "size",
    )
    assert (run.decoding.config, run.prepack, run.prompt, run.max_new_tokens) == ("auto", "auto", None, 64)
