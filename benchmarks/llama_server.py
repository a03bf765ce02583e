"""llama.cpp at its best on a packaged GGUF: the C++ `llama-server`, plain and with its own
speculation, timed by its own per-request timings over the coder prompt sets.

    python -m benchmarks.llama_server --server PATH/llama-server --model qwen2.5-coder-1.5b \
        [--spec ngram-mod] [--draft qwen2.5-coder-0.5b] [--set chat|edit] [--tokens 64] [--threads 2]

Build the server from the llama.cpp that llama-cpp-python's sdist vendors (GGML_NATIVE on, AMX
off, as docs/benchmarks.md says). Each prompt goes to /v1/chat/completions (the model's own chat
template, greedy, `max_tokens` = --tokens, the prompt cache off so every request prefills);
the server's `timings` give prefill ms and ms per generated token. Prints the medians with the
server's peak RSS (from /proc) and the CPU. The server listens on 127.0.0.1 only and is stopped
at the end.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, bench_parser, cpu_model, parse_and_pin

PROMPT_SETS = {
    "chat": ROOT / "samples" / "coder_chat_prompts.jsonl",
    "edit": ROOT / "samples" / "coder_edit_prompts.jsonl",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(args: Any, port: int) -> subprocess.Popen[bytes]:
    from adaptive_export.loading.packaged import PACKAGED

    command = [args.server, "-m", str(PACKAGED[args.model].gguf_path()), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", str(args.threads), "-tb", str(args.threads), "-c", "4096", "-np", "1", "--no-webui"]
    if args.spec:
        command += ["--spec-type", args.spec]
    if args.draft:
        command += ["--model-draft", str(PACKAGED[args.draft].gguf_path()), "-td", str(args.threads)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("llama-server did not become healthy within 300 s")


def complete(port: int, prompt: str, tokens: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "cache_prompt": False,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return dict(json.loads(reply.read())["timings"])


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = bench_parser(__doc__, "llama-server's generation and batch threads (default: 2)")
    parser.add_argument("--server", required=True, help="path of the llama-server binary")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="packaged model name")
    parser.add_argument("--spec", default="", help="llama-server --spec-type (e.g. ngram-mod); default plain")
    parser.add_argument("--draft", default="", help="packaged model name of a draft model (--model-draft)")
    parser.add_argument("--set", default="chat", choices=sorted(PROMPT_SETS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parse_and_pin(parser)
    prompts = [json.loads(line)["prompt"] for line in PROMPT_SETS[args.set].read_text().splitlines() if line.strip()]
    port = free_port()
    server = start_server(args, port)
    try:
        complete(port, prompts[0], 8)  # warm-up
        runs = [complete(port, prompt, args.tokens) for prompt in prompts[: args.prompts]]
        rss = peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    tpot = statistics.median(r["predicted_per_token_ms"] for r in runs)
    prefill = statistics.median(r["prompt_ms"] for r in runs)
    label = "plain" if not (args.spec or args.draft) else "+".join(filter(None, [args.spec, args.draft and "draft"]))
    print(f"{cpu_model()}, {args.threads} threads, llama-server {label}, {args.model}, {args.set} x{len(runs)}")
    print(f"TPOT median {tpot:.2f} ms, prefill median {prefill:.1f} ms, peak RSS {rss:.0f} MB")
    print(json.dumps({"tpot_ms": tpot, "prefill_ms": prefill, "rss_mb": rss, "runs": runs}))


if __name__ == "__main__":
    main()
