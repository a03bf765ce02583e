"""Side-by-side decode benchmark against the tools an edge user would pick instead.

    python -m benchmarks.peers --bundles fp32=bundles/smollm2,int8=bundles/smollm2-int8,int4=bundles/smollm2-int4

Contenders, on the same chat-formatted prompts, greedy, same thread count, in one run:
- `hf-eager`: HF transformers `generate` (fp32, the GGUF dequantized);
- `optimum-ort`: optimum's `ORTModelForCausalLM` exported from the same model (needs
  `optimum-onnx`, which pins an older transformers: use a separate venv, see README);
- `llama.cpp-q4_1`: llama-cpp-python on the packaged Q4_1 GGUF (compiled from source);
- `bundle-<name>`: this project's bundles (plain AR; add routed/spec bundles the same way).
Each contender runs in its own subprocess so peak RSS is its own. Reported: median prefill
ms and TPOT over repetitions (one warm-up excluded), peak RSS MB, TPOT ratio to hf-eager.
A contender whose package is missing is listed with the reason instead of numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import hf_generate_timer, load_prompts, median_of, pin_threads, print_table  # noqa: E402

NEW_TOKENS = 32


def _measure(run: Callable[[list[int]], tuple[float, float]], prompts: list[list[int]], repeat: int) -> dict[str, float]:
    """run(ids) -> (prefill_s, total_s) for NEW_TOKENS tokens; medians over prompts x repeats."""
    run(prompts[0])  # warm-up
    prefill, tpot = [], []
    for ids in prompts:
        for _ in range(repeat):
            p, generate = run(ids)  # generate covers the prefill again plus NEW_TOKENS - 1 decode steps
            prefill.append(p * 1e3)
            tpot.append(max(generate - p, 0.0) * 1e3 / (NEW_TOKENS - 1))
    return {"prefill_ms": median_of(prefill), "tpot_ms": median_of(tpot)}


def contender_bundle(path: str, threads: int, prompts: list[str], repeat: int) -> dict[str, float]:
    from runtimes import Generator

    gen = Generator(path, threads=threads)
    gen.codec.eos_ids = set()
    ids = [gen.codec.encode(p) for p in prompts]

    def run(prompt_ids: list[int]) -> tuple[float, float]:
        started = time.perf_counter()
        stats = gen.generate(prompt_ids, max_new_tokens=NEW_TOKENS).stats
        return stats.prefill_ms / 1e3, time.perf_counter() - started

    return _measure(run, ids, repeat)


def _hf_model_and_ids(prompts: list[str]) -> tuple[Any, Any, list[list[int]]]:
    from exporter.model_loading import resolve_model_path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf = resolve_model_path("smollm2")
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval()
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    return model, tok, ids


def contender_hf(threads: int, prompts: list[str], repeat: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    model, _, ids = _hf_model_and_ids(prompts)
    return _measure(hf_generate_timer(model, NEW_TOKENS), ids, repeat)


def contender_optimum(threads: int, prompts: list[str], repeat: int) -> dict[str, float]:
    from optimum.onnxruntime import ORTModelForCausalLM
    import onnxruntime

    import torch

    torch.set_num_threads(threads)
    model, tok, ids = _hf_model_and_ids(prompts)
    cache = Path(tempfile.gettempdir()) / "adaptive-export-optimum-smollm2"
    if not (cache / "model.onnx").exists():
        src = cache.with_suffix(".hf")
        model.save_pretrained(src)
        tok.save_pretrained(src)
        ORTModelForCausalLM.from_pretrained(src, export=True).save_pretrained(cache)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    ort_model = ORTModelForCausalLM.from_pretrained(cache, session_options=options)
    return _measure(hf_generate_timer(ort_model, NEW_TOKENS), ids, repeat)


def contender_llamacpp(threads: int, prompts: list[str], repeat: int) -> dict[str, float]:
    from llama_cpp import Llama

    from exporter.model_loading import smollm2_gguf_path

    llm = Llama(model_path=str(smollm2_gguf_path()), n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    _, _, ids = _hf_model_and_ids(prompts)

    def run(prompt_ids: list[int]) -> tuple[float, float]:
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt_ids)
        prefill = time.perf_counter() - started
        for _ in range(NEW_TOKENS - 1):
            token = int(llm.scores[llm.n_tokens - 1].argmax())
            llm.eval([token])
        return prefill, time.perf_counter() - started

    return _measure(run, ids, repeat)


def run_one(name: str, spec: str, threads: int, prompts: list[str], repeat: int) -> dict[str, Any]:
    pin_threads(threads)
    if name.startswith("bundle-"):
        result = contender_bundle(spec, threads, prompts, repeat)
    else:
        result = {"hf-eager": contender_hf, "optimum-ort": contender_optimum, "llama.cpp-q4_1": contender_llamacpp}[name](threads, prompts, repeat)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundles", default="", help="comma-separated name=dir pairs of bundles to include")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions per prompt")
    parser.add_argument("--prompts", type=int, default=3, help="how many prompts of samples/eval_prompts.jsonl")
    parser.add_argument("--skip", default="", help="comma-separated contenders to leave out")
    parser.add_argument("--python", action="append", default=[], metavar="NAME=PATH",
                        help="run contender NAME with another interpreter (e.g. hf-eager with the newest transformers, "
                             "while optimum needs an older one in its own venv)")
    parser.add_argument("--one", nargs=2, metavar=("NAME", "SPEC"), help=argparse.SUPPRESS)  # internal: child process
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    prompts = load_prompts(limit=args.prompts)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.threads, prompts, args.repeat)))
        return
    contenders = [("hf-eager", ""), ("optimum-ort", ""), ("llama.cpp-q4_1", "")]
    contenders += [(f"bundle-{pair.split('=', 1)[0]}", pair.split("=", 1)[1]) for pair in args.bundles.split(",") if pair]
    skip = set(filter(None, args.skip.split(",")))
    interpreters = dict(pair.split("=", 1) for pair in args.python)
    rows = []
    for name, spec in contenders:
        if name in skip:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([interpreters.get(name, sys.executable), __file__, "--one", name, spec or "-", "--threads", str(args.threads),
                               "--repeat", str(args.repeat), "--prompts", str(args.prompts)],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
            rows.append({"contender": name, "note": last[:90]})
            continue
        version = subprocess.run([interpreters.get(name, sys.executable), "-c", "import transformers; print(transformers.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        note = f"transformers {version}" if name in ("hf-eager", "optimum-ort") and version else ""
        rows.append({"contender": name, **json.loads(proc.stdout.strip().splitlines()[-1]), "note": note})
    base = next((r["tpot_ms"] for r in rows if r["contender"] == "hf-eager" and "tpot_ms" in r), None)
    for r in rows:
        if base and "tpot_ms" in r:
            r["tpot_vs_hf"] = r["tpot_ms"] / base
    print(f"SmolLM2-135M-Instruct, {args.threads} threads, {NEW_TOKENS} new tokens, {args.prompts} prompts x {args.repeat} (medians), "
          f"{os.cpu_count()} CPUs, {os.uname().machine}")
    print_table(rows, ["contender", "prefill_ms", "tpot_ms", "tpot_vs_hf", "peak_rss_mb", "note"])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
