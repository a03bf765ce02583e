"""Side-by-side decode benchmark against the tools an edge user would pick instead (issue #13).

One command re-runs everything (bundles built beforehand with `adaptive-export build smollm2
-o bundles/smollm2 [--quantize int8|int4]`; the genai models and the HF reference are
prepared once under --work-dir and reused):

    python -m benchmarks.peers --bundles fp32=bundles/smollm2,int8=bundles/smollm2-int8,int4=bundles/smollm2-int4 \\
        --repeat 2 --json peers.json
    python -m benchmarks.peers --model gemma3 --bundles native=bundles/gemma3

`--model` picks the packaged model (loading/packaged.py): smollm2 (SmolLM2-135M-Instruct,
Q4_1 GGUF; chat prompts of samples/eval_prompts.jsonl, chat template applied), gemma3
(Gemma 3 270M base, Q4_K_M GGUF; no chat template, so the raw-text prompts of
samples/heldout_text.jsonl with the tokenizer's BOS), or qwen2.5-coder-0.5b / qwen2.5-coder-1.5b
(Qwen2.5-Coder-Instruct, Q4_K_M GGUF, chat template applied; `--prompt-set chat` (default):
samples/coder_chat_prompts.jsonl, `--prompt-set edit`: samples/coder_edit_prompts.jsonl):

    python -m benchmarks.peers --model qwen2.5-coder-1.5b --prompt-set edit --bundles int4=bundles/coder-1.5b \\
        --prompts 16 --repeat 2 --skip optimum-ort

`--prompt-set FILE` runs any JSONL prompt file instead; `--prompts N` takes its first N.

Contenders, on the same prompt token ids (HF tokenizer), greedy, 32 new tokens (EOS ignored
by every contender), the same thread count, in one run:
- `hf-eager`: HF transformers `generate` (fp32, the packaged GGUF dequantized);
- `optimum-ort`: optimum's `ORTModelForCausalLM` exported from the same model (needs
  `optimum-onnx`, which pins an older transformers: use a separate venv with --python);
- `llama.cpp`: llama-cpp-python on the packaged GGUF itself (its own Q4_1 / Q4_K_M blocks), compiled from
  source for this CPU's SIMD extensions with AMX off (on a CPU with AMX it crashes otherwise):
  CMAKE_ARGS="$(python -m benchmarks.llama_cpp_flags)" pip install --no-binary llama-cpp-python
  llama-cpp-python==0.3.36 (benchmarks/llama_cpp_flags.py reads /proc/cpuinfo's flags)
  (timed with its own greedy sampler; a second instance with logits_all=True, which its
  `scores` need, serves the teacher-forced pass);
- `llama.cpp-lookup`: the same GGUF with llama.cpp's own speculation, llama-cpp-python's prompt-lookup
  draft (`Llama(..., draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_DRAFTS))`: n-grams of
  the context, no draft model; 2 drafts, the library's advice for CPU-only machines), with the same
  greedy sampler and its own quality columns;
- `llama.cpp-draft` (only with --model qwen2.5-coder-1.5b): the same with a draft model, the packaged
  Qwen2.5-Coder-0.5B GGUF in a second `Llama` (`LlamaModelDraft`: DRAFT_TOKENS=4 greedy drafts per
  round, its own KV cache kept across rounds; the two GGUFs' vocabularies must be equal);
- `genai-fp32`, `genai-int8`, `genai-int4`: onnxruntime-genai, its model builder run on the
  same weights (the GGUF dequantized to fp32 and saved as an HF directory, since the builder
  reads GGUF only at fp16/fp32), `-e cpu`, `intra_op_num_threads` set in genai_config.json
  (and its EOS/pad ids pointed at the last vocabulary entry, so it runs past <|im_end|> like
  the others); timed with its Python API: prefill = append_tokens + the first
  generate_next_token, TPOT over the next N-1 generate_next_token calls (the og.Generator,
  which allocates the KV cache for max_length, is created before the clock starts, as the
  bundle's arena is allocated at load); teacher forcing = append_tokens of prompt + forced
  tokens, then get_output("logits"), which 0.18 returns for every appended position. genai has no
  speculation row: up to 0.18 it has none; the speculative decoding added later (model.type
  "speculative") needs a separate, smaller draft model, which SmolLM2-135M and Gemma 3 270M do not
  have, and its n-gram (prompt lookup) draft was not released when this was written;
- `bundle-<name>`: this project's bundles through the torch-free runtime (any bundle dir;
  `NAME=DIR@auto` runs it with `--mode auto`, i.e. with its calibrated speculation; `NAME=DIR@ar/2` or
  `@auto/2` with `--decode-rows 2`: plain steps of two rows, on which speculation is exact at accuracy 4;
  `NAME=DIR@auto+DRAFT_DIR` with `--draft-bundle DRAFT_DIR`, a smaller bundle drafting).
Each contender runs in its own subprocess so peak RSS is its own.

Reported per contender: median prefill ms (time to the first token) and TPOT (the next N-1
tokens) over prompts x repetitions (one warm-up excluded); peak RSS MB (ru_maxrss of its
process, read after the timed pass, before the quality pass); greedy identity with HF fp32
(prompts whose N greedy tokens equal HF's; a divergence counts as identical only where HF's
top-1/top-2 logit margin at the first divergent position is < 1e-3, and those ties are
counted); teacher-forced top-1 agreement with HF fp32 (HF's greedy continuation fed in,
each contender's argmax compared at every position, mean over positions). The HF fp32
reference (prompt ids, greedy tokens, margins) is computed once per prompt set and cached.
A contender whose package is missing or whose preparation fails is listed with the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    bench_parser,
    cpu_model,
    hf_generate_timer,
    load_prompts,
    median_of,
    pin_threads,
)

FIXED = ("hf-eager", "optimum-ort", "llama.cpp", "llama.cpp-lookup", "genai-fp32", "genai-int8", "genai-int4")
DRAFTED = "llama.cpp-draft"  # offered only for a target of DRAFT_PAIRS
PRECISION = {
    "hf-eager": "fp32",
    "optimum-ort": "fp32",
    "llama.cpp": "int4",
    "llama.cpp-lookup": "int4",
    DRAFTED: "int4",
    "genai-fp32": "fp32",
    "genai-int8": "int8",
    "genai-int4": "int4",
}
BUNDLE_DTYPES = {"float32": "fp32", "float16": "fp16", "int8": "int8", "int4": "int4"}
WORK_ROOT = ROOT / "bundles"
# packaged model -> (title, prompt file): chat prompts for an instruct model, raw text for a base model
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct (Q4_1 GGUF)", ROOT / "samples" / "eval_prompts.jsonl"),
    "gemma3": ("Gemma 3 270M base (Q4_K_M GGUF)", ROOT / "samples" / "heldout_text.jsonl"),
    "qwen2.5-coder-0.5b": ("Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)", ROOT / "samples" / "coder_chat_prompts.jsonl"),
    "qwen2.5-coder-1.5b": ("Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)", ROOT / "samples" / "coder_chat_prompts.jsonl"),
}
RAW_TEXT = {"gemma3"}  # base models: raw-text prompts with BOS; the others get their chat template
# --prompt-set names -> prompt files (per model; a FILE path works for every model)
PROMPT_SETS = {
    name: {"chat": ROOT / "samples" / "coder_chat_prompts.jsonl", "edit": ROOT / "samples" / "coder_edit_prompts.jsonl"}
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
}
# llama.cpp-draft: the target model -> its draft model (same tokenizer), greedy drafts per round
DRAFT_PAIRS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}
DRAFT_TOKENS = 4
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}

# A contender: run(ids) -> (prefill_s, total_s, tokens) for exactly new_tokens greedy tokens,
# and forced(ids, continuation) -> argmax per continuation position (teacher forcing).
Runner = Callable[[list[int]], tuple[float, float, list[int]]]
Forced = Callable[[list[int], list[int]], list[int]]


# ---------------------------------------------------------------------------------------
# in the child process: one contender
# ---------------------------------------------------------------------------------------
def _measure(run: Runner, forced: Forced, ref: dict[str, Any], repeat: int, new_tokens: int) -> dict[str, Any]:
    """Timed pass (medians over prompts x repeat after one warm-up), RSS, then the quality pass."""
    ids_all = ref["ids"]
    run(ids_all[0])  # warm-up
    prefill, tpot, tokens = [], [], []
    for ids in ids_all:
        for r in range(repeat):
            p, total, toks = run(ids)
            prefill.append(p * 1e3)
            tpot.append(max(total - p, 0.0) * 1e3 / (new_tokens - 1))
            if r == 0:
                tokens.append([int(t) for t in toks])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    argmax = [[int(t) for t in forced(ids, cont)] for ids, cont in zip(ids_all, ref["tokens"])]
    return {
        "prefill_ms": median_of(prefill),
        "tpot_ms": median_of(tpot),
        "peak_rss_mb": rss,
        "greedy_tokens": tokens,
        "forced_argmax": argmax,
    }


def _hf_runner(model: Any, new_tokens: int) -> tuple[Runner, Forced]:
    """HF-style `generate` (benchmarks.common.hf_generate_timer) plus teacher forcing."""
    import torch

    run = hf_generate_timer(model, new_tokens)

    def forced(ids: list[int], cont: list[int]) -> list[int]:
        x = torch.tensor([ids + cont[:-1]])
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, len(ids) - 1 :]
        return logits.argmax(-1).tolist()

    return run, forced


def contender_hf(ref: dict[str, Any], threads: int, new_tokens: int, work: Path, spec: str) -> tuple[Runner, Forced]:
    import torch

    from adaptive_export.loading.model import load_model

    torch.set_num_threads(threads)
    return _hf_runner(load_model(ref["model"]).hf_model, new_tokens)


def contender_optimum(
    ref: dict[str, Any], threads: int, new_tokens: int, work: Path, spec: str
) -> tuple[Runner, Forced]:
    import onnxruntime
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(threads)
    cache = work / "optimum-fp32"
    if not (cache / "model.onnx").exists():
        ORTModelForCausalLM.from_pretrained(work / "hf-fp32", export=True).save_pretrained(cache)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    return _hf_runner(ORTModelForCausalLM.from_pretrained(cache, session_options=options), new_tokens)


LOOKUP_DRAFTS = 2  # llama-cpp-python's prompt-lookup drafts per round ("2 performs better for cpu-only machines")


def contender_llamacpp(
    ref: dict[str, Any], threads: int, new_tokens: int, work: Path, spec: str
) -> tuple[Runner, Forced]:
    return _llamacpp_runner(ref, threads, new_tokens)


def contender_llamacpp_lookup(
    ref: dict[str, Any], threads: int, new_tokens: int, work: Path, spec: str
) -> tuple[Runner, Forced]:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return _llamacpp_runner(ref, threads, new_tokens, LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_DRAFTS))


def contender_llamacpp_draft(
    ref: dict[str, Any], threads: int, new_tokens: int, work: Path, spec: str
) -> tuple[Runner, Forced]:
    from adaptive_export.loading.packaged import PACKAGED

    target = PACKAGED[ref["model"]].gguf_path()
    draft = PACKAGED[DRAFT_PAIRS[ref["model"]]].gguf_path()
    check_same_vocabulary(target, draft)
    return _llamacpp_runner(ref, threads, new_tokens, LlamaModelDraft(draft, threads, DRAFT_TOKENS))


def check_same_vocabulary(target: Path, draft: Path) -> None:
    """A draft model must share the target's vocabulary: equal `tokenizer.ggml.tokens` lengths."""
    from adaptive_export.loading.gguf_header import read_gguf_header

    key = "tokenizer.ggml.tokens"
    sizes = [read_gguf_header(path).array_lengths.get(key) for path in (target, draft)]
    if sizes[0] is None or sizes[0] != sizes[1]:
        raise RuntimeError(f"draft {draft.name} has {sizes[1]} {key}, the target {target.name} {sizes[0]}")


class LlamaModelDraft:
    """llama-cpp-python draft model (its `LlamaDraftModel` protocol: `__call__(input_ids) -> token ids`):
    a second `Llama` on a smaller GGUF of the same vocabulary drafts `k` tokens greedily.

    It keeps its own KV cache across calls: the ids it has evaluated are tracked, each call
    evaluates only the new suffix of `input_ids`, and where they diverge (drafts the target
    rejected) it rewinds to the common prefix (`n_tokens`, as `Llama.generate` does; its `eval`
    drops the KV entries past it), or resets where nothing is shared."""

    def __init__(self, model_path: Path, threads: int, k: int = DRAFT_TOKENS, n_ctx: int = 1024) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            verbose=False,
        )  # logits_all=False: only the last position's logits, all a greedy draft reads
        self.k = k
        self.evaluated: list[int] = []

    def _last_argmax(self) -> int:
        import llama_cpp
        import numpy as np

        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        return int(row.argmax())

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        import numpy as np

        ids = [int(t) for t in input_ids]
        shared = 0
        for a, b in zip(self.evaluated, ids):
            if a != b:
                break
            shared += 1
        if shared == len(ids):  # nothing new to evaluate (never in generate(); logits must be fresh)
            shared -= 1
        if shared <= 0:
            self.llm.reset()
            shared = 0
        self.llm.n_tokens = shared  # eval() removes the KV cache past n_tokens first
        self.evaluated = ids[:shared]
        suffix = ids[shared:]
        drafts: list[int] = []
        while len(drafts) < self.k and len(self.evaluated) + len(suffix) < self.llm.n_ctx():
            self.llm.eval(suffix)
            self.evaluated += suffix
            drafts.append(self._last_argmax())
            suffix = drafts[-1:]
        return np.asarray(drafts, dtype=np.intc)


def _llamacpp_runner(ref: dict[str, Any], threads: int, new_tokens: int, draft: Any = None) -> tuple[Runner, Forced]:
    """llama-cpp-python on the packaged GGUF, plain or with a `draft_model` (prompt lookup, a draft GGUF)."""
    import numpy as np
    from llama_cpp import Llama

    from adaptive_export.loading.packaged import PACKAGED

    path = str(PACKAGED[ref["model"]].gguf_path())
    common = {
        "model_path": path,
        "n_ctx": 1024,
        "n_threads": threads,
        "n_threads_batch": threads,
        "n_batch": 512,
        "verbose": False,
    }
    if draft is not None:
        llm = Llama(**common, draft_model=draft)
    else:
        llm = Llama(**common)  # logits_all=False: llama.cpp's own sampler picks the greedy token

    def run(ids: list[int]) -> tuple[float, float, list[int]]:
        llm.reset()  # else generate() reuses the KV cache of a repeated prompt
        tokens: list[int] = []
        started = time.perf_counter()
        prefill = 0.0
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            if not tokens:
                prefill = time.perf_counter() - started
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return prefill, time.perf_counter() - started, tokens

    scorer: list[Any] = []

    def forced(ids: list[int], cont: list[int]) -> list[int]:
        if not scorer:  # a second instance with logits_all=True (scores stay zero without it)
            scorer.append(Llama(**common, logits_all=True))
        s = scorer[0]
        s.reset()
        s.eval(ids + cont[:-1])
        return np.asarray(s.scores[len(ids) - 1 : len(ids) - 1 + len(cont)]).argmax(-1).tolist()

    return run, forced


def contender_genai(ref: dict[str, Any], threads: int, new_tokens: int, work: Path, spec: str) -> tuple[Runner, Forced]:
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(spec)  # intra_op_num_threads set in its genai_config.json by the parent
    # a sliding-window model's cache must hold the window (genai refuses a smaller max_length)
    window = json.loads((Path(spec) / "genai_config.json").read_text())["model"]["decoder"].get("sliding_window") or {}

    def generator(length: int) -> Any:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=max(length, int(window.get("window_size", 0))))
        return og.Generator(model, params)

    def run(ids: list[int]) -> tuple[float, float, list[int]]:
        gen = generator(len(ids) + new_tokens)
        tokens: list[int] = []
        started = time.perf_counter()
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
        prefill = time.perf_counter() - started
        while len(tokens) < new_tokens:
            if gen.is_done():
                raise RuntimeError(f"genai stopped after {len(tokens)} tokens (EOS not disabled in genai_config.json?)")
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        return prefill, time.perf_counter() - started, tokens

    def forced(ids: list[int], cont: list[int]) -> list[int]:
        gen = generator(len(ids) + len(cont) + 1)
        gen.append_tokens(np.asarray(ids + cont[:-1], dtype=np.int32))
        logits = np.asarray(gen.get_output("logits"))
        logits = logits.reshape(-1, logits.shape[-1])
        if len(logits) < len(cont):  # only the last position is kept: step the forced tokens one by one
            gen = generator(len(ids) + len(cont) + 1)
            gen.append_tokens(np.asarray(ids, dtype=np.int32))
            rows = [np.asarray(gen.get_logits()).reshape(-1)]
            for token in cont[:-1]:
                gen.append_tokens(np.asarray([token], dtype=np.int32))
                rows.append(np.asarray(gen.get_logits()).reshape(-1))
            logits = np.stack(rows)
        return logits[-len(cont) :].argmax(-1).tolist()

    return run, forced


def contender_bundle(
    ref: dict[str, Any], threads: int, new_tokens: int, work: Path, spec: str
) -> tuple[Runner, Forced]:
    from adaptive_export.exporter.check import teacher_forced_logits
    from adaptive_export.runtimes import Generator

    path, _, how = spec.partition("@")  # DIR, DIR@MODE (ar|auto|spec) or DIR@MODE/ROWS (decode rows, 1|2)
    how, _, draft = how.partition("+")  # ...+DRAFT_DIR: that bundle drafts (`run --draft-bundle`)
    mode, _, rows = how.partition("/")
    gen = Generator(path, threads=threads, decode_rows=int(rows) if rows else None, draft_bundle=draft or None)
    gen.codec.eos_ids = set()

    def run(ids: list[int]) -> tuple[float, float, list[int]]:
        started = time.perf_counter()
        result = gen.generate(ids, max_new_tokens=new_tokens, mode=mode or "ar")
        return result.stats.prefill_ms / 1e3, time.perf_counter() - started, result.tokens

    def forced(ids: list[int], cont: list[int]) -> list[int]:
        return teacher_forced_logits(gen, ids, cont).argmax(-1).tolist()

    return run, forced


CONTENDERS = {
    "hf-eager": contender_hf,
    "optimum-ort": contender_optimum,
    "llama.cpp": contender_llamacpp,
    "llama.cpp-lookup": contender_llamacpp_lookup,
    DRAFTED: contender_llamacpp_draft,
    "genai-fp32": contender_genai,
    "genai-int8": contender_genai,
    "genai-int4": contender_genai,
}


def run_one(
    name: str, spec: str, threads: int, repeat: int, new_tokens: int, work: Path, ref_path: Path
) -> dict[str, Any]:
    pin_threads(threads)
    ref = json.loads(ref_path.read_text())
    factory = contender_bundle if name.startswith("bundle-") else CONTENDERS[name]
    run, forced = factory(ref, threads, new_tokens, work, spec)
    result = _measure(run, forced, ref, repeat, new_tokens)
    if name.startswith("bundle-"):
        from adaptive_export.runtimes.bundle import load_bundle
        from adaptive_export.runtimes.text import TextCodec

        bundle = load_bundle(spec.partition("@")[0], verify="size")
        codec = TextCodec(bundle)
        result["precision"] = BUNDLE_DTYPES.get(bundle.manifest.dtype, bundle.manifest.dtype)
        result["codec_ids_match"] = all(codec.encode(p) == ids for p, ids in zip(ref["prompts"], ref["ids"]))
    return result


# ---------------------------------------------------------------------------------------
# in child processes: preparation (HF reference, HF directory for the genai builder)
# ---------------------------------------------------------------------------------------
def compute_reference(model: str, prompts: list[str], new_tokens: int, out: Path) -> None:
    """HF fp32 greedy tokens (no EOS stop) and top-1/top-2 margins on the prompt ids: chat-templated
    where the tokenizer has a template, else raw text with its special tokens (BOS)."""
    import transformers

    from adaptive_export.exporter.check import reference_greedy, top2_margin
    from adaptive_export.loading.model import load_model
    from adaptive_export.loading.prompts import hf_prompt_ids

    loaded = load_model(model)
    ids = []
    for prompt in prompts:
        ids.append(hf_prompt_ids(loaded.tokenizer, prompt))
    every = list(range(loaded.spec.num_layers))
    tokens, margins = [], []
    for prompt_ids in ids:
        toks, steps = reference_greedy(loaded, prompt_ids, new_tokens, set(), every)
        tokens.append(toks)
        margins.append([top2_margin(s) for s in steps])
    out.write_text(
        json.dumps(
            {
                "model": model,
                "prompts": prompts,
                "new_tokens": new_tokens,
                "ids": ids,
                "tokens": tokens,
                "margins": margins,
                "transformers": transformers.__version__,
            }
        )
    )


def save_hf_dir(model: str, out: Path) -> None:
    """The packaged GGUF dequantized to fp32 and saved as an HF directory (the genai builder's input)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaptive_export.loading.model import resolve_model_path

    directory, gguf = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32, local_files_only=True)
    model.hf_quantizer = None  # transformers refuses to save a model loaded from a quantized GGUF otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    partial.rename(out)


# ---------------------------------------------------------------------------------------
# in the parent
# ---------------------------------------------------------------------------------------
def _child(
    model: str, args: list[str], python: str = sys.executable, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, __file__, "--model", model, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)},
        timeout=timeout,
    )


def _last_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (proc.stderr or proc.stdout or "").strip().splitlines() if line.strip()]
    return (lines or [f"exit code {proc.returncode}"])[-1][:160]


def ensure_reference(model: str, work: Path, prompts: list[str], new_tokens: int, prompt_file: Path) -> Path:
    key = hashlib.sha1(json.dumps([model, prompts, new_tokens]).encode()).hexdigest()[:12]
    path = work / f"reference-{key}.json"
    if not path.exists():
        print("computing the HF fp32 reference ...", file=sys.stderr, flush=True)
        proc = _child(
            model,
            ["--reference-out", str(path), "--prompts", str(len(prompts)), "--new-tokens", str(new_tokens)]
            + ["--prompt-set", str(prompt_file)],
        )
        if proc.returncode != 0:
            sys.exit(f"HF fp32 reference failed: {_last_error(proc)}")
    return path


def ensure_hf_dir(model: str, work: Path) -> Path:
    hf = work / "hf-fp32"
    if not (hf / "config.json").exists():
        print("saving the GGUF as an fp32 HF directory ...", file=sys.stderr, flush=True)
        proc = _child(model, ["--save-hf", str(hf)])
        if proc.returncode != 0:
            raise RuntimeError(f"saving the HF directory failed: {_last_error(proc)}")
    return hf


def ensure_genai(model: str, work: Path, precision: str, threads: int) -> Path:
    """Run onnxruntime-genai's model builder once per precision (offline), then set the threads."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise RuntimeError("onnxruntime-genai is not installed (pip install onnxruntime-genai)")
    out = work / f"genai-{precision}"
    if not (out / "genai_config.json").exists():
        hf = ensure_hf_dir(model, work)
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        print(f"building genai-{precision} with onnxruntime_genai.models.builder ...", file=sys.stderr, flush=True)
        args = ["-i", str(hf), "-o", str(partial), "-p", precision, "-e", "cpu", "-c", str(work / "builder-cache")]
        cmd = [sys.executable, "-c", _GENAI_BUILDER_SHIM, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **OFFLINE}, cwd=work)
        (work / f"genai-{precision}.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0 or not (partial / "genai_config.json").exists():
            raise RuntimeError(f"genai builder failed ({work / f'genai-{precision}.log'}): {_last_error(proc)}")
        partial.rename(out)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    before = json.dumps(config)
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    # Every contender makes exactly new_tokens tokens (EOS ignored, as HF's reference does). genai
    # has no search option for that and rejects an empty or out-of-vocabulary eos_token_id (a
    # Config.overlay of it is not honoured by generation in 0.18), so the EOS and pad ids point at
    # the last vocabulary entry; a run that still stops early fails loudly instead of counting.
    never = int(config["model"]["vocab_size"]) - 1
    config["model"]["eos_token_id"] = config["model"]["pad_token_id"] = never
    if json.dumps(config) != before:
        config_path.write_text(json.dumps(config, indent=4))
    return out


# onnxruntime-genai 0.18's Gemma 3 builder reads the transformers 4 config layout
# (rope_theta, rope_local_base_freq, a flat rope_parameters); transformers 5 nests
# rope_parameters per layer type. The builder's own config read (its first AutoConfig call)
# gets the old layout; its weight loading (later calls) gets the config unchanged.
_GENAI_BUILDER_SHIM = """
import runpy, sys, transformers
original, calls = transformers.AutoConfig.from_pretrained, []
def first_call_flat(*args, **kwargs):
    config = original(*args, **kwargs)
    calls.append(1)
    rope = getattr(config, "rope_parameters", None)
    if len(calls) == 1 and isinstance(rope, dict) and "full_attention" in rope:
        config.rope_theta = rope["full_attention"]["rope_theta"]
        config.rope_local_base_freq = rope.get("sliding_attention", rope["full_attention"])["rope_theta"]
        config.rope_parameters = dict(rope["full_attention"])
    return config
transformers.AutoConfig.from_pretrained = first_call_flat
sys.argv = ["builder", *sys.argv[1:]]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
"""


def quality(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Greedy identity (ties counted) and teacher-forced top-1 agreement against the HF reference."""
    from adaptive_export.exporter.check import greedy_verdict

    identical = ties = 0
    divergence = []
    for toks, expected, margins in zip(result["greedy_tokens"], ref["tokens"], ref["margins"]):
        at, margin, passed = greedy_verdict(toks, expected, margins)
        identical += passed
        ties += passed and at is not None
        divergence.append(at)
    hits = total = 0
    for argmax, expected in zip(result["forced_argmax"], ref["tokens"]):
        hits += sum(a == b for a, b in zip(argmax, expected))
        total += len(expected)
    return {
        "greedy_identical": identical,
        "greedy_ties": ties,
        "prompts": len(ref["tokens"]),
        "first_divergence": divergence,
        "top1_agreement": hits / total if total else None,
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def f(value: Any, digits: int = 2) -> str:
        return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = [
        "| contender | prefill ms | TPOT ms | TPOT vs genai (same precision) | peak RSS MB "
        "| greedy identical (k/N, ties) | top-1 agreement | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        greedy = f"{r['greedy_identical']}/{r['prompts']} ({r['greedy_ties']} ties)" if "greedy_identical" in r else ""
        lines.append(
            f"| {r['contender']} | {f(r.get('prefill_ms'), 1)} | {f(r.get('tpot_ms'))} | {f(r.get('tpot_vs_genai'))} | "
            f"{f(r.get('peak_rss_mb'), 0)} | {greedy} | {f(r.get('top1_agreement'), 3)} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def select(names: list[str], wanted: str, skip: str) -> list[str]:
    """Keep names matching a comma-separated list of names or prefixes (`genai`, `bundle`)."""
    picks = [w for w in wanted.split(",") if w]
    drops = set(filter(None, skip.split(",")))
    return [n for n in names if (not picks or any(n.startswith(p) for p in picks)) and n not in drops]


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "threads for every contender (torch, ORT intra-op, llama.cpp, genai) (default: 2)")
    parser.add_argument(
        "--bundles",
        default="",
        metavar="NAME=DIR,...",
        help="comma-separated name=dir pairs of bundles to include, each as contender bundle-NAME "
        "(any bundle directory; its precision is read from its manifest)",
    )
    parser.add_argument(
        "--contenders",
        default="",
        metavar="LIST",
        help="comma-separated contenders (or prefixes: genai, bundle) to run; "
        f"default all: {', '.join(FIXED)}, bundle-* (and {DRAFTED} with --model {', '.join(DRAFT_PAIRS)})",
    )
    parser.add_argument("--skip", default="", metavar="LIST", help="comma-separated contenders to leave out")
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed repetitions per prompt, after one warm-up run (default: 3)"
    )
    _add_setting_arguments(parser)
    parser.add_argument("--one", nargs=2, metavar=("NAME", "SPEC"), help=argparse.SUPPRESS)  # internal: child process
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--reference-out", default=None, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--save-hf", default=None, help=argparse.SUPPRESS)  # internal
    return parser


def _add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, prompts and tokens every contender runs, and where caches and results go."""
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="smollm2",
        help="packaged model every contender runs: smollm2 (default; chat prompts of samples/eval_prompts.jsonl), "
        "gemma3 (base model; raw-text prompts of samples/heldout_text.jsonl), qwen2.5-coder-0.5b or "
        "qwen2.5-coder-1.5b (chat template; samples/coder_chat_prompts.jsonl unless --prompt-set edit)",
    )
    parser.add_argument(
        "--prompt-set",
        default=None,
        metavar="chat|edit|FILE",
        help="the prompts: chat or edit (the coder models: samples/coder_chat_prompts.jsonl, "
        'samples/coder_edit_prompts.jsonl) or a JSONL file of {"prompt": ...} lines '
        "(default: the model's own set; --prompts N takes the first N of it)",
    )
    for flag, kind, default, text in (
        ("--prompts", int, 10, "how many prompts of the prompt set"),
        ("--new-tokens", int, 32, "greedy tokens per run; TPOT is over the last N-1"),
        ("--timeout", float, 3600, "seconds allowed per contender process"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="cache for the HF fp32 reference, the fp32 HF directory and the genai models; reused when present "
        f"(default: {WORK_ROOT.relative_to(ROOT)}/peers-cache-MODEL)",
    )
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="run contender NAME with another interpreter (e.g. optimum-ort from a venv with optimum-onnx "
        "and the older transformers it pins)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="also write the raw results (rows, per-prompt tokens, setting) as JSON here",
    )


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (TPOT is over the tokens after the first)")
    work = Path(args.work_dir or WORK_ROOT / f"peers-cache-{args.model}").resolve()
    title = MODELS[args.model][0]
    prompt_file = resolve_prompt_set(parser, args.model, args.prompt_set)
    args.prompt_set = str(prompt_file)  # the children read the same file
    if DRAFTED in args.contenders.split(",") and args.model not in DRAFT_PAIRS:
        parser.error(f"{DRAFTED} needs a target with a draft model: --model {' or '.join(DRAFT_PAIRS)}")
    prompts = load_prompts(prompt_file, limit=args.prompts)
    if args.reference_out:
        compute_reference(args.model, prompts, args.new_tokens, Path(args.reference_out))
        return
    if args.save_hf:
        save_hf_dir(args.model, Path(args.save_hf))
        return
    if args.one:
        result = run_one(
            args.one[0], args.one[1], args.threads, args.repeat, args.new_tokens, work, Path(args.reference)
        )
        print(json.dumps(result))
        return

    work.mkdir(parents=True, exist_ok=True)
    bundles = [(f"bundle-{pair.split('=', 1)[0]}", pair.split("=", 1)[1]) for pair in args.bundles.split(",") if pair]
    fixed = [*FIXED, DRAFTED] if args.model in DRAFT_PAIRS else list(FIXED)
    specs = dict([(n, "") for n in fixed] + bundles)
    interpreters = dict(pair.split("=", 1) for pair in args.python)
    ref_path = ensure_reference(args.model, work, prompts, args.new_tokens, prompt_file)
    ref = json.loads(ref_path.read_text())
    runs = ContenderRuns(args, work, ref_path, ref, interpreters)
    rows = [runs.row(name, specs[name]) for name in select(list(specs), args.contenders, args.skip)]
    add_ratios(rows)
    setting = {
        "model": args.model,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "machine": os.uname().machine,
        "threads": args.threads,
        "prompts": len(prompts),
        "prompt_file": str(prompt_file),
        "repeat": args.repeat,
        "new_tokens": args.new_tokens,
        "reference": ref_path.name,
        "reference_transformers": ref.get("transformers"),
    }
    print(f"CPU: {setting['cpu']} ({setting['cpus']} CPUs, {setting['machine']}); threads: {args.threads}")
    kind = "raw-text" if args.model in RAW_TEXT else "chat-templated"
    print(
        f"{title}, {len(prompts)} {kind} prompts of {prompt_file.name} x {args.repeat} "
        "(medians after a warm-up), greedy, "
        f"{args.new_tokens} new tokens; quality against HF transformers {ref.get('transformers')} fp32"
    )
    print()
    print(markdown_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": setting, "rows": rows}, indent=2) + "\n")


def resolve_prompt_set(parser: argparse.ArgumentParser, model: str, choice: str | None) -> Path:
    """--prompt-set: the model's own file (None), a named set of the model (chat, edit) or a file."""
    if choice is None:
        return MODELS[model][1]
    named = PROMPT_SETS.get(model, {})
    if choice in named:
        return named[choice]
    path = Path(choice)
    if not path.is_file():
        sets = ", ".join(named) or "none"
        parser.error(f"--prompt-set {choice!r}: not a file, nor a prompt set of --model {model} (sets: {sets})")
    return path.resolve()


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """TPOT against genai at the same precision, and against HF eager."""
    genai = {r["precision"]: r["tpot_ms"] for r in rows if r["contender"].startswith("genai-") and "tpot_ms" in r}
    hf = next((r["tpot_ms"] for r in rows if r["contender"] == "hf-eager" and "tpot_ms" in r), None)
    for r in rows:
        if "tpot_ms" in r and genai.get(r.get("precision")):
            r["tpot_vs_genai"] = r["tpot_ms"] / genai[r["precision"]]
        if "tpot_ms" in r and hf:
            r["tpot_vs_hf"] = r["tpot_ms"] / hf


@dataclass(frozen=True)
class ContenderRuns:
    """Runs each contender in its own subprocess (so peak RSS is its own) against one reference."""

    args: argparse.Namespace
    work: Path
    ref_path: Path
    ref: dict[str, Any]
    interpreters: dict[str, str]

    def row(self, name: str, spec: str) -> dict[str, Any]:
        """The table row of contender `name`: its timings and quality, or a note saying why not."""
        row: dict[str, Any] = {"contender": name, "precision": PRECISION.get(name)}
        try:
            spec = self.prepare(name, spec)
        except RuntimeError as exc:
            print(f"{name}: {exc}", file=sys.stderr, flush=True)
            return {**row, "note": str(exc)}
        print(f"running {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            proc = self.run(name, spec)
        except subprocess.TimeoutExpired:
            return {**row, "note": f"timed out after {self.args.timeout:.0f} s"}
        if proc.returncode != 0:
            print(f"{name} failed: {proc.stderr[-2000:]}", file=sys.stderr, flush=True)
            return {**row, "note": _last_error(proc)}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        row.update(result)
        row.update(quality(result, self.ref))
        row["seconds"] = time.perf_counter() - started
        row["note"] = self.note(name, spec, row)
        print(
            f"{name}: prefill {row['prefill_ms']:.1f} ms, TPOT {row['tpot_ms']:.2f} ms, "
            f"RSS {row['peak_rss_mb']:.0f} MB, "
            f"greedy {row['greedy_identical']}/{row['prompts']}, agreement {row['top1_agreement']:.3f}",
            file=sys.stderr,
            flush=True,
        )
        return row

    def prepare(self, name: str, spec: str) -> str:
        """Builds what the contender needs (genai model, HF directory) and returns its spec;
        RuntimeError where it cannot."""
        if name.startswith("genai-"):
            return str(ensure_genai(self.args.model, self.work, name.split("-", 1)[1], self.args.threads))
        if name == DRAFTED:
            from adaptive_export.loading.packaged import PACKAGED

            target, draft = (PACKAGED[m].gguf_path() for m in (self.args.model, DRAFT_PAIRS[self.args.model]))
            check_same_vocabulary(target, draft)
        elif name == "optimum-ort":
            ensure_hf_dir(self.args.model, self.work)
        elif name.startswith("bundle-"):
            directory, at, mode = spec.partition("@")
            spec = str(Path(directory).resolve()) + at + mode
            if not (Path(directory) / "manifest.json").exists():
                raise RuntimeError(f"no bundle at {directory}")
        return spec

    def run(self, name: str, spec: str) -> subprocess.CompletedProcess[str]:
        args = self.args
        child_args = ["--one", name, spec or "-", "--threads", str(args.threads), "--repeat", str(args.repeat)]
        child_args += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]
        child_args += ["--work-dir", str(self.work), "--reference", str(self.ref_path)]
        child_args += ["--prompt-set", args.prompt_set]
        python = self.interpreters.get(name, sys.executable)
        return _child(args.model, child_args, python=python, timeout=args.timeout)

    def note(self, name: str, spec: str, row: dict[str, Any]) -> str:
        """The table's note: the contender's library version, or a bundle's precision, directory and mode."""
        notes = []
        if name.startswith("llama.cpp"):
            notes.append(_version(self.interpreters.get(name, sys.executable), "llama_cpp"))
            if name == "llama.cpp-lookup":
                notes.append(f"prompt-lookup draft, {LOOKUP_DRAFTS} tokens")
            elif name == DRAFTED:
                notes.append(f"draft model {DRAFT_PAIRS[self.args.model]}, {DRAFT_TOKENS} greedy tokens")
        elif name.startswith("genai-"):
            notes.append(_version(sys.executable, "onnxruntime_genai"))
        elif name in ("hf-eager", "optimum-ort"):
            notes.append(_version(self.interpreters.get(name, sys.executable), "transformers"))
        elif name.startswith("bundle-"):
            notes.append(
                f"{row['precision']}, {Path(spec.partition('@')[0]).name}"
                + (f", --mode {spec.partition('@')[2]}" if "@" in spec else "")
            )
            if not row.get("codec_ids_match", True):
                notes.append("bundle codec's prompt ids differ from HF's (HF's are used)")
        return ", ".join(n for n in notes if n)


def _version(python: str, module: str) -> str:
    proc = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({_DIST[module]!r}))"],
        capture_output=True,
        text=True,
    )
    return f"{_DIST[module]} {proc.stdout.strip()}" if proc.returncode == 0 else ""


_DIST = {"llama_cpp": "llama-cpp-python", "onnxruntime_genai": "onnxruntime-genai", "transformers": "transformers"}


if __name__ == "__main__":
    main()
