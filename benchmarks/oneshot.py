"""What a user sees from `run`: one process per prompt, the default mode against `--mode ar`.

A warmed-up benchmark hides every per-process cost: importing, loading and checking the bundle,
creating sessions (a draft engine's included), prefill. Here each run is the CLI itself, as a
user types it, timed from process start to exit:

    python -m benchmarks.oneshot --bundle bundles/smollm2-acc4 --json oneshot.json

For each of the chat prompts (samples/eval_prompts.jsonl, chat template applied) and each mode
(`--mode ar`, then the default, which is `--mode auto`), the median wall time of --repeat
processes generating --max-new-tokens tokens (EOS can end a run early; both modes emit the same
greedy tokens up to near-ties, so they nearly always stop at the same place: `same text` says
where not). Modes alternate within each repetition so a neighbour's load hits both alike.
Printed: per prompt both medians and default / ar, the sum over prompts and its ratio (< 1: the
default is faster), and lscpu's model name.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import DEFAULT_PROMPTS, bench_parser, cpu_model, load_prompts  # noqa: E402

MODES = {"ar": ("--mode", "ar"), "default": ()}  # the default passes no --mode at all


@dataclass(frozen=True)
class PromptTiming:
    """Median seconds of one `run` process per mode for one prompt, and what the default did."""

    prompt: str
    ar_s: float
    default_s: float
    same_text: bool

    @property
    def ratio(self) -> float:
        return self.default_s / self.ar_s


def run_once(bundle: str, prompt: str, mode_flags: tuple[str, ...], tokens: int, threads: int) -> tuple[float, str]:
    """One `adaptive-export run` process: its wall seconds and its text."""
    command = [sys.executable, "-m", "adaptive_export.commands.cli", "run", bundle, "-p", prompt]
    command += ["--max-new-tokens", str(tokens), "--threads", str(threads), "--json", *mode_flags]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(mode_flags) or 'default'}): {proc.stderr.strip()[-500:]}")
    return elapsed, json.loads(proc.stdout)["text"]


def time_prompt(bundle: str, prompt: str, tokens: int, repeat: int, threads: int) -> PromptTiming:
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    texts: dict[str, str] = {}
    for _ in range(repeat):
        for mode, flags in MODES.items():  # alternating: load on the machine hits both modes alike
            elapsed, texts[mode] = run_once(bundle, prompt, flags, tokens, threads)
            seconds[mode].append(elapsed)
    return PromptTiming(
        prompt,
        statistics.median(seconds["ar"]),
        statistics.median(seconds["default"]),
        texts["ar"] == texts["default"],
    )


def report(timings: list[PromptTiming], bundle: str, tokens: int, repeat: int, threads: int) -> str:
    lines = [
        f"CPU: {cpu_model()} ({os.cpu_count()} CPUs); threads {threads}; bundle {bundle}",
        f"one `run` process per prompt, {tokens} new tokens, median of {repeat}",
        "",
        "| prompt | --mode ar s | default (auto) s | default / ar | same text |",
        "|---|---|---|---|---|",
    ]
    for t in timings:
        lines.append(f"| {t.prompt[:48]} | {t.ar_s:.3f} | {t.default_s:.3f} | {t.ratio:.3f} | {t.same_text} |")
    ar, default = sum(t.ar_s for t in timings), sum(t.default_s for t in timings)
    ratios = [t.ratio for t in timings]
    lines.append(f"| **all prompts** | {ar:.3f} | {default:.3f} | **{default / ar:.3f}** | |")
    lines.append("")
    lines.append(f"median per-prompt ratio {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__, threads_help="ONNX Runtime threads per run (default: 2)", bundle="bundle directory")
    parser.add_argument("--prompts", type=int, default=10, help="chat prompts from samples/ (default: 10)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per run (default: 32)")
    parser.add_argument("--repeat", type=int, default=3, help="processes per prompt and mode (default: 3)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the timings as JSON here")
    args = parser.parse_args()
    prompts = load_prompts(DEFAULT_PROMPTS, limit=args.prompts)
    timings = []
    for prompt in prompts:
        timing = time_prompt(args.bundle, prompt, args.max_new_tokens, args.repeat, args.threads)
        print(f"{timing.ratio:.3f}  {prompt[:60]}", file=sys.stderr, flush=True)
        timings.append(timing)
    print(report(timings, args.bundle, args.max_new_tokens, args.repeat, args.threads))
    if args.json:
        rows = [{**asdict(t), "ratio": t.ratio} for t in timings]
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
