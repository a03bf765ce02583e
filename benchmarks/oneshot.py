"""What a user sees from `run`: one process per prompt, the default mode against `--mode ar`.

A warmed-up benchmark hides every per-process cost: importing, loading and checking the bundle,
creating sessions (a draft engine's included), prefill. Here each run is the CLI itself, as a
user types it:

    python -m benchmarks.oneshot --bundle bundles/qwen2.5-coder-1.5b --sets chat,edit --json oneshot.json

For each prompt of each set (`chat`: samples/coder_chat_prompts.jsonl, `edit`:
samples/coder_edit_prompts.jsonl, `eval`: samples/eval_prompts.jsonl; the chat template applied by
`run`) and each mode (`--mode ar`, then the default, which is `--mode auto`), --repeat processes
generate --max-new-tokens greedy tokens. Modes alternate within each repetition so a neighbour's
load hits both alike. Per prompt: the median TPOT (the run's own `tpot_ms`) and wall time of each
mode, the policy the default chose, and whether both emitted the same tokens. Per set: the median
of the per-prompt TPOTs and its default / ar ratio (< 1: the default is faster), and lscpu's model name.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, cpu_model, load_prompts  # noqa: E402

MODES = {"ar": ("--mode", "ar"), "default": ()}  # the default passes no --mode at all
SETS = {
    "chat": ROOT / "samples" / "coder_chat_prompts.jsonl",
    "edit": ROOT / "samples" / "coder_edit_prompts.jsonl",
    "eval": ROOT / "samples" / "eval_prompts.jsonl",
}


@dataclass(frozen=True)
class OneRun:
    """One `run` process: wall seconds, its own TPOT, its tokens and the policy it chose."""

    wall_s: float
    tpot_ms: float
    tokens: list[int]
    policy: str
    draft_source: str


@dataclass(frozen=True)
class PromptTiming:
    """Median TPOT and wall seconds of one prompt per mode, and what the default did."""

    set: str
    prompt: str
    ar_tpot_ms: float
    default_tpot_ms: float
    ar_s: float
    default_s: float
    policy: str
    draft_source: str
    same_tokens: bool

    @property
    def ratio(self) -> float:
        return self.default_tpot_ms / self.ar_tpot_ms


def run_once(bundle: str, prompt: str, mode_flags: tuple[str, ...], tokens: int, threads: int) -> OneRun:
    """One `adaptive-export run --json` process."""
    command = [sys.executable, "-m", "adaptive_export.commands.cli", "run", bundle, "-p", prompt]
    command += ["--max-new-tokens", str(tokens), "--threads", str(threads), "--json", *mode_flags]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(mode_flags) or 'default'}): {proc.stderr.strip()[-500:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    stats = out["stats"]
    return OneRun(elapsed, stats["tpot_ms"], out["tokens"], stats.get("policy", ""), stats.get("draft_source", ""))


def time_prompt(bundle: str, kind: str, prompt: str, tokens: int, repeat: int, threads: int) -> PromptTiming:
    runs: dict[str, list[OneRun]] = {mode: [] for mode in MODES}
    for _ in range(repeat):
        for mode, flags in MODES.items():  # alternating: load on the machine hits both modes alike
            runs[mode].append(run_once(bundle, prompt, flags, tokens, threads))
    ar, default = runs["ar"], runs["default"]
    return PromptTiming(
        kind,
        prompt,
        statistics.median(r.tpot_ms for r in ar),
        statistics.median(r.tpot_ms for r in default),
        statistics.median(r.wall_s for r in ar),
        statistics.median(r.wall_s for r in default),
        default[-1].policy,
        default[-1].draft_source,
        ar[-1].tokens == default[-1].tokens,
    )


def report(timings: list[PromptTiming], bundle: str, tokens: int, repeat: int, threads: int) -> str:
    lines = [
        f"CPU: {cpu_model()} ({os.cpu_count()} CPUs); threads {threads}; bundle {bundle}",
        f"one `run` process per prompt, {tokens} new tokens, median of {repeat}",
        "",
        "| set | prompt | ar TPOT ms | default TPOT ms | default / ar | policy | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in timings:
        lines.append(
            f"| {t.set} | {t.prompt[:40]} | {t.ar_tpot_ms:.2f} | {t.default_tpot_ms:.2f} | {t.ratio:.3f}"
            f" | {t.policy} | {t.same_tokens} |"
        )
    lines += [
        "",
        "| set | prompts | ar TPOT median | default TPOT median | default / ar | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for kind in dict.fromkeys(t.set for t in timings):
        rows = [t for t in timings if t.set == kind]
        ar = statistics.median(t.ar_tpot_ms for t in rows)
        default = statistics.median(t.default_tpot_ms for t in rows)
        same = sum(t.same_tokens for t in rows)
        lines.append(
            f"| {kind} | {len(rows)} | {ar:.2f} | {default:.2f} | **{default / ar:.3f}** | {same}/{len(rows)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__, threads_help="ONNX Runtime threads per run (default: 2)", bundle="bundle directory")
    parser.add_argument("--sets", default="chat,edit", help="prompt sets, comma-separated: chat, edit, eval")
    parser.add_argument("--prompts", default="10,6", help="prompts per set, comma-separated (default: 10,6)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per run (default: 48)")
    parser.add_argument("--repeat", type=int, default=1, help="processes per prompt and mode (default: 1)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the timings as JSON here")
    args = parser.parse_args()
    sets = args.sets.split(",")
    limits = [int(n) for n in args.prompts.split(",")]
    timings = []
    for kind, limit in zip(sets, limits + limits[-1:] * len(sets)):
        for prompt in load_prompts(SETS[kind], limit=limit):
            timing = time_prompt(args.bundle, kind, prompt, args.max_new_tokens, args.repeat, args.threads)
            print(f"{kind} {timing.ratio:.3f} {timing.policy:>7}  {prompt[:60]}", file=sys.stderr, flush=True)
            timings.append(timing)
    print(report(timings, args.bundle, args.max_new_tokens, args.repeat, args.threads))
    if args.json:
        rows = [{**asdict(t), "ratio": t.ratio} for t in timings]
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
