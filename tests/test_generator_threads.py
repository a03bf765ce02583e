"""One Generator shared by threads and by interleaved streams (runtimes/generate.py): it holds one
sequence (one KV arena, one set of ONNX Runtime output buffers), so concurrent `generate` calls
take turns, and a second `stream()` of the same thread while the first is live is refused.

Before: four threads calling `generate` on one Generator crashed ONNX Runtime (SIGABRT, heap
corruption), so that case runs in a child process; two interleaved streams silently changed the
first answer."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.generate import Generator

ROOT = Path(__file__).parents[1]
PROMPTS = ["The quick brown fox", "What is the capital of France?", "Write a short poem", "Static graphs"]
THREADS_TIMEOUT_S = 120

_THREADS = r"""
import sys, threading
from adaptive_export.runtimes.generate import Generator
bundle, prompts = sys.argv[1], sys.argv[2:]
generator = Generator(bundle)
expected = [generator.generate(p, max_new_tokens=24).tokens for p in prompts]
results, errors = {}, []
def work(index):
    try:
        for round_ in range(6):
            results[index, round_] = generator.generate(prompts[index], max_new_tokens=24).tokens
    except BaseException as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
wrong = [key for key, tokens in results.items() if tokens != expected[key[0]]]
assert not wrong, f"answers changed under threads: {wrong}"
print("ok", len(results))
"""


def test_threads_sharing_one_generator_take_turns(tiny_bundle: Path) -> None:
    """Four real threads, six generations each, on one Generator: no crash, every answer the one
    the same prompt gets alone."""
    proc = subprocess.run(
        [sys.executable, "-c", _THREADS, str(tiny_bundle), *PROMPTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=THREADS_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == f"ok {len(PROMPTS) * 6}"


@pytest.fixture(scope="module")
def generator(tiny_bundle: Path) -> Generator:
    return Generator(tiny_bundle)


def test_a_second_stream_while_the_first_is_live_is_refused(generator: Generator) -> None:
    alone = generator.generate(PROMPTS[0], max_new_tokens=16).text
    first = generator.stream(PROMPTS[0], max_new_tokens=16)
    pieces = [next(first)]
    with pytest.raises(UsageError, match="still live") as refused:
        for _ in generator.stream(PROMPTS[1], max_new_tokens=16):
            pass
    assert refused.value.fix
    with pytest.raises(UsageError, match="still live"):
        generator.generate(PROMPTS[1], max_new_tokens=4)
    pieces += list(first)
    assert "".join(pieces) == alone, "the first stream's answer changed"
    assert generator.generate(PROMPTS[1], max_new_tokens=4).tokens  # free again once exhausted


def test_a_closed_stream_frees_the_generator(generator: Generator) -> None:
    first = generator.stream(PROMPTS[0], max_new_tokens=16)
    next(first)
    first.close()
    assert "".join(generator.stream(PROMPTS[1], max_new_tokens=4))


def test_a_stream_in_another_thread_waits_its_turn(generator: Generator) -> None:
    """Another thread's generate waits until this thread's live stream ends, then runs."""
    alone = generator.generate(PROMPTS[2], max_new_tokens=8).tokens
    first = generator.stream(PROMPTS[0], max_new_tokens=16)
    next(first)
    done: list[list[int]] = []
    other = threading.Thread(target=lambda: done.append(generator.generate(PROMPTS[2], max_new_tokens=8).tokens))
    other.start()
    time.sleep(0.5)
    assert not done, "the other thread ran while this thread's stream was live"
    list(first)
    other.join(timeout=30)
    assert done == [alone]


# two threads quiet fd 2 in the order that lost it: A redirects, B saves A's /dev/null and redirects,
# A restores, B restores /dev/null. Each waits for the other's step with a timeout, which only bounds
# how long a serialized (correct) run takes: it cannot turn a correct run into a failure.
_INTERLEAVED_QUIET = r"""
import os, sys, threading
from adaptive_export.runtimes.tokenizer_policy import rust_stderr_quiet
before = os.fstat(2)
a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
def first():
    with rust_stderr_quiet():
        a_in.set()
        b_in.wait(timeout=3)
    a_out.set()
def second():
    a_in.wait()
    with rust_stderr_quiet():
        b_in.set()
        a_out.wait(timeout=3)
threads = [threading.Thread(target=first), threading.Thread(target=second)]
for t in threads: t.start()
for t in threads: t.join()
after = os.fstat(2)
print("same" if (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino) else "changed")
"""


def test_stderr_quieting_from_two_threads_restores_fd_2() -> None:
    """tokenizers' stderr silencing dup2()s fd 2; from two threads (two Generators served at once)
    it once left fd 2 at /dev/null for the rest of the process, every later traceback lost."""
    proc = subprocess.run(
        [sys.executable, "-c", _INTERLEAVED_QUIET], cwd=ROOT, capture_output=True, text=True, timeout=THREADS_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "same", "fd 2 was left redirected"
