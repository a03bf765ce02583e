"""Where a decode token's time goes: ONNX Runtime's node profiler plus the runtime's own share.

    python -m benchmarks.profile_decode --bundle bundles/smollm2-int4 [--threads 2] [--tokens 48]

Runs greedy decoding with ORT profiling on, then splits the median time per token into
ORT operator types (summed node times of the decode engine), ORT's own per-call overhead
(session run time not covered by nodes) and the Python runtime outside `session.run`
(sampling, arena bookkeeping, IO binding). That split shows what a faster kernel, fewer
nodes, or a leaner loop could still win.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import DEFAULT_PROMPTS, bench_parser, load_prompts, parse_and_pin, print_table


def main() -> None:
    parser = bench_parser(__doc__, bundle="bundle directory to profile")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens to decode while profiling (default: 48)")
    parser.add_argument("--top", type=int, default=12, help="operator types to list (default: 12)")
    args = parse_and_pin(parser)
    from adaptive_export.runtimes import Generator

    prefix = str(Path(tempfile.mkdtemp()) / "ort")
    gen = Generator(Path(args.bundle), threads=args.threads, profile_prefix=prefix)
    gen.codec.eos_ids = set()
    ids = gen.codec.encode(load_prompts(DEFAULT_PROMPTS, 1)[0])
    gen.generate(ids, max_new_tokens=4)  # warm-up
    started = time.perf_counter()
    result = gen.generate(ids, max_new_tokens=args.tokens)
    wall_ms = (time.perf_counter() - started) * 1e3
    graph = gen.bundle.config("full").decode
    events = json.loads(Path(gen.backend.session(graph).end_profiling()).read_text())
    # The fused flavour's prefill runs in the same session as decoding: keep only the runs of
    # one token (prefill runs are many times longer) and the nodes inside them.
    run_events = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    typical = sorted(e["dur"] for e in run_events)[len(run_events) // 2]
    decode_runs = [(e["ts"], e["ts"] + e["dur"]) for e in run_events if e["dur"] <= 3 * typical]
    node_us: dict[str, float] = defaultdict(float)
    run_us, runs = sum(end - start for start, end in decode_runs), len(decode_runs)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            if any(start <= event["ts"] <= end for start, end in decode_runs):
                node_us[event["args"].get("op_name", "?")] += event["dur"]
    # the profile holds the warm-up's and the timed run's decode steps alike: per step
    steps = max(runs, 1)
    tpot = result.stats.tpot_ms
    nodes_ms = sum(node_us.values()) / 1e3 / steps
    run_ms = run_us / 1e3 / steps
    rows = [
        {"part": f"op {op}", "ms_per_token": us / 1e3 / steps, "share": us / 1e3 / steps / tpot}
        for op, us in sorted(node_us.items(), key=lambda kv: -kv[1])[: args.top]
    ]
    rows.append({"part": "all ORT nodes", "ms_per_token": nodes_ms, "share": nodes_ms / tpot})
    rows.append(
        {
            "part": "ORT run overhead (run - nodes)",
            "ms_per_token": run_ms - nodes_ms,
            "share": (run_ms - nodes_ms) / tpot,
        }
    )
    rows.append({"part": "Python runtime (TPOT - run)", "ms_per_token": tpot - run_ms, "share": (tpot - run_ms) / tpot})
    print(
        f"{args.bundle}: decode engine {graph}, {args.threads} threads, {steps} profiled steps; "
        f"TPOT {tpot:.2f} ms (wall {wall_ms:.0f} ms for {args.tokens} tokens incl. prefill)"
    )
    print_table(rows, ["part", "ms_per_token", "share"])


if __name__ == "__main__":
    main()
