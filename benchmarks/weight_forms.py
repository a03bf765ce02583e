"""The two weight forms of a GGUF-exact bundle, plain and default runs, against llama.cpp's server,
in one run: what `--native-form packed` changes where users decode.

    python -m benchmarks.weight_forms --model qwen2.5-coder-1.5b --bundles packed=DIR,nbits=DIR \
        [--server PATH/llama-server] [--set chat|edit] [--prompts 8] [--tokens 64] [--threads 2]

Each bundle runs every prompt as a user would, one `adaptive-export run --json` process per
prompt, with `--mode ar` (plain steps) and with the default `--mode auto`; llama-server (when
--server is given: benchmarks/llama_server.py) runs the same prompts plain and with its
`--spec-type ngram-mod`, one server at a time after the bundles. Prints median TPOT and
prefill per contender, each bundle run's peak RSS (/usr/bin/time),
the ratio to llama.cpp plain, and whether the default run's tokens equal `--mode ar`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

from benchmarks.common import bench_parser, cpu_model, parse_and_pin, print_table
from benchmarks.llama_server import PROMPT_SETS, complete, free_port, peak_rss_mb, start_server


def run_bundle(bundle: str, prompt: str, tokens: int, threads: int, mode: str) -> tuple[dict[str, Any], float]:
    """One `run` process under /usr/bin/time: its --json result and its peak RSS in MB."""
    command = ["/usr/bin/time", "-f", "peak-rss-kb %M", sys.executable, "-m", "adaptive_export.commands.cli", "run"]
    command += [bundle, "-p", prompt, "--max-new-tokens", str(tokens), "--threads", str(threads), "--json"]
    proc = subprocess.run([*command, "--mode", mode], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{bundle}: {proc.stderr.strip().splitlines()[-1]}")
    peak = next(line for line in proc.stderr.splitlines() if line.startswith("peak-rss-kb"))
    return json.loads(proc.stdout.strip().splitlines()[-1]), int(peak.split()[1]) / 1024


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--bundles", required=True, help="NAME=DIR,... bundles of the model")
    parser.add_argument("--server", default="", help="llama-server binary (optional)")
    parser.add_argument("--set", default="chat", choices=sorted(PROMPT_SETS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parse_and_pin(parser)
    bundles = dict(pair.split("=", 1) for pair in args.bundles.split(","))
    prompts = [json.loads(line)["prompt"] for line in PROMPT_SETS[args.set].read_text().splitlines() if line.strip()]
    prompts = prompts[: args.prompts]
    tpot: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    rss: dict[str, float] = {}
    same: dict[str, int] = {}
    for prompt in prompts:
        for name, bundle in bundles.items():
            plain, peak_plain = run_bundle(bundle, prompt, args.tokens, args.threads, "ar")
            default, peak_default = run_bundle(bundle, prompt, args.tokens, args.threads, "auto")
            for label, result, peak in ((f"{name} ar", plain, peak_plain), (f"{name} default", default, peak_default)):
                tpot.setdefault(label, []).append(result["stats"]["tpot_ms"])
                prefill.setdefault(label, []).append(result["stats"]["prefill_ms"])
                rss[label] = max(rss.get(label, 0.0), peak)
            same[name] = same.get(name, 0) + (plain["tokens"] == default["tokens"])
    for label, spec in (("llama.cpp", ""), ("llama.cpp ngram-mod", "ngram-mod")) if args.server else ():
        # one server at a time: an idle llama-server's threads would share the cores with the timed one
        port = free_port()
        server_args = argparse.Namespace(
            server=args.server, model=args.model, threads=args.threads, spec=spec, draft=""
        )
        server = start_server(server_args, port)
        try:
            complete(port, prompts[0], 8)
            for prompt in prompts:
                timings = complete(port, prompt, args.tokens)
                tpot.setdefault(label, []).append(timings["predicted_per_token_ms"])
                prefill.setdefault(label, []).append(timings["prompt_ms"])
            rss[label] = peak_rss_mb(server.pid)
        finally:
            server.terminate()
            server.wait(timeout=60)
    base = statistics.median(tpot["llama.cpp"]) if "llama.cpp" in tpot else None
    rows = []
    for label in tpot:
        median = statistics.median(tpot[label])
        name = label.split()[0]
        rows.append(
            {
                "contender": label,
                "TPOT ms": f"{median:.2f}",
                "x llama.cpp": f"{median / base:.2f}" if base else "-",
                "prefill ms": f"{statistics.median(prefill[label]):.0f}",
                "peak RSS MB": f"{rss[label]:.0f}" if label in rss else "-",
                "default = ar tokens": f"{same[name]}/{len(prompts)}" if label.endswith("default") else "",
            }
        )
    print(f"{cpu_model()}, {args.threads} threads, {args.model}, {args.set} x{len(prompts)}, {args.tokens} tokens")
    print_table(rows, list(rows[0]))
    print(json.dumps({"tpot": tpot, "prefill": prefill, "rss": rss, "same": same}))


if __name__ == "__main__":
    main()
