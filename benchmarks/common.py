"""Shared benchmark helpers: prompts, medians, thread pinning, table printing."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT / "samples" / "eval_prompts.jsonl"


def bench_parser(
    doc: str | None,
    threads_help: str = "ONNX Runtime intra-op threads (default: 2)",
    bundle: str | None = None,
    bundle_required: bool = True,
) -> argparse.ArgumentParser:
    """The parser every benchmark starts from: its module docstring as help, --threads, and
    --bundle (the bundle it measures) when `bundle` gives that option's help."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help=threads_help)
    if bundle is not None:
        parser.add_argument("--bundle", required=bundle_required, default=None, help=bundle)
    return parser


def parse_and_pin(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line and pin every runtime to --threads before any is imported."""
    args = parser.parse_args()
    pin_threads(args.threads)
    return args


def cpu_model() -> str:
    """lscpu's model name: every printed number names the machine it was measured on."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def load_prompts(path: Path = DEFAULT_PROMPTS, limit: int | None = None) -> list[str]:
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


def pin_threads(threads: int) -> None:
    """Same thread count for every contender: torch, ONNX Runtime (via options) and BLAS."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    import sys

    if "torch" in sys.modules:  # never import torch here: it would inflate a torch-free contender's RSS
        sys.modules["torch"].set_num_threads(threads)


def median_of(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


def timed_runs(fn: Callable[[], dict[str, float]], repeat: int, warmup: int = 1) -> dict[str, float]:
    """Median of each metric over `repeat` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    runs = [fn() for _ in range(repeat)]
    return {key: median_of([r[key] for r in runs]) for key in runs[0]}


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    lines = [" | ".join(c.ljust(widths[c]) for c in columns), "-|-".join("-" * widths[c] for c in columns)]
    lines += [" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns) for r in rows]
    text = "\n".join(lines)
    print(text)
    return text


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "" if value is None else str(value)


def hf_generate_timer(model: Any, new_tokens: int) -> Callable[[list[int]], tuple[float, float, list[int]]]:
    """run(ids) -> (prefill_s, generate_s, tokens) for HF-style `generate` of exactly new_tokens
    greedy tokens (EOS disabled): prefill = one forward over the prompt; generate covers the
    prefill again plus new_tokens - 1 decode steps."""
    import time

    import torch

    model.generation_config.eos_token_id = None

    def run(prompt_ids: list[int]) -> tuple[float, float, list[int]]:
        x = torch.tensor([prompt_ids])
        mask = torch.ones_like(x)
        with torch.no_grad():
            started = time.perf_counter()
            model(input_ids=x, attention_mask=mask)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            out = model.generate(
                input_ids=x,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            return prefill, time.perf_counter() - started, out[0, len(prompt_ids) :].tolist()

    return run
