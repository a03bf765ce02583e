"""`adaptive-export check`: every engine of a bundle against the PyTorch reference.

Three kinds of checks, each a JUnit test case:
- engine parity: each graph on a fixed token sequence (a past prefix plus new tokens),
  logits, new K/V rows (and router scores / exit hidden states) against the same static
  graph run in PyTorch; decode graphs of the full model also against HF transformers.
- greedy tokens: the runtime's greedy output against HF `generate` on prompts, per
  configuration; a divergence passes only where the reference shows a float tie
  (top-1/top-2 margin < TIE_MARGIN at the first divergent position). Each reference is
  decoded once per (kept layers, prompt, new tokens) and shared by plain decoding, every
  draft source and every backend (ReferenceDecodes).
- the bundle itself (backend "bundle"): what the engines are, read from their ops
  (exporter/check_precision.py), against the manifest's dtype and `--expect-precision`; the
  tokenizer against the reference model's (exporter/check_tokenizer.py); and a failing row when
  no engine could run here. The reference is the model the user names (`--model`), never the
  bundle's recorded source, and the tolerance follows from the engines, never from the manifest.

Tolerances (fp32 graphs): logits |diff| <= LOGIT_ATOL + LOGIT_RTOL * max|ref|. ORT fuses
and reorders fp32 sums, so errors of 1e-5..1e-4 are expected over 30 layers; 1e-3 is an
order of magnitude above what we measure and far below the gap between distinct tokens.
"""

from __future__ import annotations

import contextlib
import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.exporter.check_precision import BundlePrecision, bundle_precision, precision_problems
from adaptive_export.loading.warning_filters import library_call_warnings_hidden
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.drafting.base import full_vocabulary_row
from adaptive_export.runtimes.kv_arena import KVArena

REPORT_SCHEMA = "adaptive-export-check/1"
TOLERANCES = {"float32": {"atol": 1e-3, "rtol": 1e-4}, "float16": {"atol": 5e-2, "rtol": 1e-2}}
TIE_MARGIN = 1e-3
# Quantized bundles cannot match fp32 logits within fp32 tolerances; they are gated on
# quality instead: teacher-forced top-1 agreement with the fp32 reference must reach this.
QUANT_MIN_AGREEMENT = {"int8": 0.90, "int4": 0.70}
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a compiler does.",
]


@dataclass(frozen=True)
class CheckResult:
    backend: str
    engine: str
    check: str
    passed: bool
    executed: bool = True
    max_abs: float | None = None
    max_rel: float | None = None
    tolerance: float | None = None
    seconds: float = 0.0
    detail: str = ""


@dataclass
class CheckReport:
    bundle: str
    model: str
    provider: str = "cpu"  # where ONNX Runtime ran the engines
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "bundle": self.bundle,
            "model": self.model,
            "provider": self.provider,
            "passed": self.passed,
            "tolerances": TOLERANCES,
            "tie_margin": TIE_MARGIN,
            "summary": {"total": len(self.results), "failed": sum(not r.passed for r in self.results)},
            "results": [asdict(r) for r in self.results],
        }

    def junit(self) -> ET.ElementTree:
        suite = ET.Element(
            "testsuite",
            name="adaptive-export-check",
            tests=str(len(self.results)),
            failures=str(sum(not r.passed for r in self.results)),
            skipped=str(sum(not r.executed for r in self.results)),
        )
        for r in self.results:
            case = ET.SubElement(
                suite, "testcase", classname=f"{r.backend}.{r.engine}", name=r.check, time=f"{r.seconds:.3f}"
            )
            if not r.executed:
                ET.SubElement(case, "skipped", message=r.detail)
            elif not r.passed:
                ET.SubElement(case, "failure", message=r.detail).text = json.dumps(asdict(r))
        return ET.ElementTree(suite)


def compare(
    actual: np.ndarray, expected: np.ndarray, dtype: str = "float32", scale_tol: float = 1.0
) -> tuple[bool, float, float, float]:
    tol = TOLERANCES[dtype]
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    bound = (tol["atol"] + tol["rtol"] * float(np.abs(expected).max(initial=0.0))) * scale_tol
    max_abs = float(diff.max(initial=0.0))
    max_rel = float((diff / np.maximum(np.abs(expected), 1e-6)).max(initial=0.0))
    return max_abs <= bound and bool(np.isfinite(actual).all()), max_abs, max_rel, bound


def graph_spec(bundle: Bundle, graph_name: str) -> Any:
    """The bundle's graph entry as the GraphSpec the PyTorch reference builds."""
    from adaptive_export.exporter.graph_entry import spec_of_entry

    return spec_of_entry(bundle.graph(graph_name))


@dataclass(frozen=True)
class ParityInputs:
    """One graph's fixed inputs: `first` (ids or hidden states) over a random past of
    `past_len` rows, and the arena as it was before the engine wrote its `count` new rows."""

    first: np.ndarray
    past_len: int
    count: int
    before: np.ndarray


def parity_inputs(bundle: Bundle, backend: Any, spec: Any, seed: int) -> tuple[ParityInputs, KVArena]:
    """Random inputs and a random past in an arena of the backend's layout (the engine writes into it)."""
    from adaptive_export.graphs.drafts import appended_ids

    rng = np.random.default_rng(seed)
    model = bundle.model
    past_len, count = 7, (9 if spec.kind == "prefill" else 1 if spec.kind == "draft" else 4)
    if spec.kind == "prefill":
        past_len = 0
    first = (
        rng.integers(0, model.vocab_size, (1, count))
        if spec.source == "ids"
        else rng.standard_normal((1, count, model.hidden_size)).astype(np.float32)
    )
    appended = appended_ids(spec)  # a draft source's trained rows after the vocabulary
    if appended and spec.source == "ids":
        # the last rows are those ids: their embedding is checked too
        rows = min(appended, count - 1)
        first[0, count - rows :] = model.vocab_size + np.arange(rows)
    # fused engines bind the whole [1, n_kv, max_len, hd] block, so their arena is max_len long
    arena_len = bundle.max_len if spec.flavour == "ort" else past_len + count
    arena = KVArena(bundle.num_layers, arena_len, model.num_kv_heads, model.head_dim, layout=backend.kv_layout)
    for layer in range(bundle.num_layers):
        for kv in (0, 1):
            arena.seq_view(layer, kv)[:past_len] = rng.standard_normal(arena.seq_view(layer, kv)[:past_len].shape) * 0.5
    arena.length = past_len
    # the engine writes into the arena; the reference reads the same past
    return ParityInputs(first, past_len, count, arena.data.copy()), arena


def torch_outputs(bundle: Bundle, parts: Any, spec: Any, inputs: ParityInputs) -> Any:
    """The same graph in PyTorch on the same inputs: the fused modules for `ort` engines (whole
    KV blocks), the portable SpanGraph otherwise (KV prefixes)."""
    import torch

    from adaptive_export.graphs.span_graph import SpanGraph

    first, past_len, count, before = inputs.first, inputs.past_len, inputs.count, inputs.before
    with torch.no_grad():
        if spec.flavour == "ort":
            from adaptive_export.graphs.fused_graph import FusedSpanGraph, packed_weights

            module = FusedSpanGraph(parts, spec, packed_weights(parts, bundle.max_len)).eval()
            rows = np.arange(count - 1 if spec.logits == "last" else 0, count)
            control = (
                torch.from_numpy(rows),
                torch.tensor([past_len + count - 1], dtype=torch.int32),
                torch.tensor(past_len + count, dtype=torch.int32),
            )
            past = [torch.from_numpy(before[i, kv]) for kv in (0, 1) for i in spec.layers]
            return module(torch.from_numpy(first), *control, *past)
        module = SpanGraph(parts, spec).eval()
        past = [torch.from_numpy(np.ascontiguousarray(before[i, kv, :past_len])) for kv in (0, 1) for i in spec.layers]
        return module(torch.from_numpy(first), *past)


def engine_output(name: str, out: Any, arena: KVArena, inputs: ParityInputs, expected: np.ndarray) -> tuple[Any, Any]:
    """(actual, expected) for one named output: KV outputs are read back from the arena."""
    past_len, count = inputs.past_len, inputs.count
    if name.startswith("new_"):
        kind, layer = name[4:].rsplit("_", 1)
        return arena.seq_view(int(layer), 0 if kind == "key" else 1)[past_len : past_len + count], expected
    if name.startswith("present_"):  # the whole valid block: the past must be left as it was
        kind, layer = name[8:].rsplit("_", 1)
        actual = arena.block(int(layer), 0 if kind == "key" else 1)[:, :, : past_len + count]
        return actual, expected[:, :, : past_len + count]
    named = {"logits": out.logits, "router_scores": out.router_scores, "exit_hidden": out.exit_hidden}
    return {**named, "guesses": out.guesses}[name], expected


@dataclass(frozen=True)
class ParityOutcome:
    """Every output compared: the failures, and the worst difference with its bound."""

    failures: tuple[str, ...]
    max_abs: float
    max_rel: float
    bound: float


def compare_outputs(
    names: list[str], actual_expected: list[tuple[Any, Any]], informational: bool, scale_tol: float
) -> ParityOutcome:
    """Compare each output; `informational` (quantized weights) fails only on non-finite values."""
    worst = (0.0, 0.0, 0.0)
    failures = []
    for name, (actual, expected) in zip(names, actual_expected):
        if name == "guesses":  # token ids: equal, or (quantized engines) informational
            agree = float(np.mean(np.asarray(actual) == expected)) if np.size(expected) else 1.0
            if agree < 1.0 and not informational:
                failures.append(f"guesses: {agree:.0%} of rows guess the reference's token")
            continue
        if informational:  # the quality checks gate quantized engines
            _, max_abs, max_rel, bound = compare(np.asarray(actual), expected, "float32", scale_tol)
            ok = bool(np.isfinite(actual).all())
        else:
            ok, max_abs, max_rel, bound = compare(np.asarray(actual), expected, "float32", scale_tol)
        if not ok:
            failures.append(f"{name}: max |diff| {max_abs:.3g} > {bound:.3g}")
        if max_abs > worst[0] or not ok:
            worst = (max_abs, max_rel, bound)
    return ParityOutcome(tuple(failures), *worst)


def engine_parity(
    bundle: Bundle,
    backend: Any,
    parts: Any,
    graph_name: str,
    seed: int = 0,
    scale_tol: float = 1.0,
    precision: BundlePrecision | None = None,
) -> CheckResult:
    """Run one graph in the backend and in PyTorch on the same inputs; compare every output.
    Parity is informational only where the engine itself holds quantized weights (its ops say so)."""
    precision = precision or bundle_precision(bundle)
    spec = graph_spec(bundle, graph_name)
    inputs, arena = parity_inputs(bundle, backend, spec, seed)
    started = time.perf_counter()
    out = backend.run(graph_name, inputs.first, arena, inputs.past_len)
    ref = torch_outputs(bundle, parts, spec, inputs)
    names = bundle.graph(graph_name).output_names()
    pairs = [engine_output(name, out, arena, inputs, ref[index].numpy()) for index, name in enumerate(names)]
    quantized = precision.informational(graph_name)
    outcome = compare_outputs(names, pairs, quantized, scale_tol)
    engine = precision.engines.get(graph_name)
    dtype = engine.dtype if engine else precision.dtype
    detail = "; ".join(outcome.failures) or (
        f"{dtype} weights: difference to fp32 is informational, the quality checks gate"
        if quantized
        else f"{len(names)} outputs within tolerance"
    )
    return CheckResult(
        backend.name,
        graph_name,
        "parity",
        not outcome.failures,
        max_abs=outcome.max_abs,
        max_rel=outcome.max_rel,
        tolerance=None if quantized else outcome.bound,
        seconds=time.perf_counter() - started,
        detail=detail,
    )


def first_divergence(actual: list[int], expected: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(actual, expected)):
        if a != b:
            return index
    return None if len(actual) == len(expected) else min(len(actual), len(expected))


def top2_margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit: below TIE_MARGIN the reference's choice is a float tie."""
    top2 = np.sort(np.asarray(logits, dtype=np.float64))[-2:]
    return float(top2[1] - top2[0])


def greedy_verdict(actual: list[int], expected: list[int], margins: list[float]) -> tuple[int | None, float, bool]:
    """(first divergent index or None, reference margin there, passed): a divergence passes
    only where the reference's top-1/top-2 margin at that position is below TIE_MARGIN."""
    at = first_divergence(actual, expected)
    if at is None:
        return None, float("inf"), True
    margin = float(margins[at]) if at < len(margins) else float("inf")
    return at, margin, margin < TIE_MARGIN


def teacher_forced_logits(
    generator: Any, prompt_ids: list[int], continuation: list[int], config: str = "full", engine: str | None = None
) -> np.ndarray:
    """Logits of a bundle at each position of `continuation` (row i predicts continuation[i])
    when fed prompt + continuation[:-1]: the prefill engine over the prompt, then one pass of
    the configuration's decode engine (or `engine`) over the forced tokens, on the generator's arena."""
    decode = engine or generator.bundle.config(config).decode
    arena = generator.arena
    arena.reset()
    out = generator.backend.run("prefill", np.asarray([prompt_ids]), arena, 0)
    rows = [out.logits[0, -1].copy()]
    arena.length = len(prompt_ids)
    if len(continuation) > 1:
        out = generator.backend.run(decode, np.asarray([continuation[:-1]]), arena, arena.length)
        if generator.bundle.graph(decode).draft_vocab:  # a reduced draft head: its rows over the vocabulary
            ids, vocab = generator.bundle.draft_vocab_ids, generator.bundle.model.vocab_size
            rows += [full_vocabulary_row(row, ids, vocab) for row in out.logits[0]]
        else:
            rows += list(out.logits[0].copy())
    return np.stack(rows)


def reference_greedy(
    parts: Any, prompt_ids: list[int], new_tokens: int, eos_ids: set[int], kept: list[int], adapted: bool = False
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and per-step logits in PyTorch: HF transformers itself for the full
    model; for a skip configuration, prefill over every layer and decode over the kept
    layers (adapted by the bundle's skip adapters where `adapted`) with the static PyTorch
    graphs (validated against HF in the tests)."""
    import torch

    every = tuple(range(parts.spec.num_layers))
    with torch.no_grad(), library_call_warnings_hidden():  # HF's deprecation notices are not check's output
        if tuple(kept) == every:
            return hf_greedy(parts, prompt_ids, new_tokens, eos_ids)
        return span_greedy(parts, prompt_ids, new_tokens, eos_ids, kept, adapted)


def hf_greedy(
    parts: Any, prompt_ids: list[int], new_tokens: int, eos_ids: set[int]
) -> tuple[list[int], list[np.ndarray]]:
    """The full model's greedy decode by HF transformers, with its own KV cache."""
    import torch

    tokens: list[int] = []
    steps: list[np.ndarray] = []
    out = parts.hf_model(torch.tensor([prompt_ids]), use_cache=True)
    for _ in range(new_tokens):
        logits = out.logits[0, -1]
        steps.append(logits.float().numpy())
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos_ids or len(tokens) == new_tokens:
            break
        out = parts.hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, steps


def span_greedy(
    parts: Any, prompt_ids: list[int], new_tokens: int, eos_ids: set[int], kept: list[int], adapted: bool = False
) -> tuple[list[int], list[np.ndarray]]:
    """A skip configuration's greedy decode: prefill over every layer, then decode over the
    kept layers (each adapted where `adapted`) with the static PyTorch graphs."""
    import torch

    from adaptive_export.graphs.span_graph import GraphSpec, SpanGraph

    every = tuple(range(parts.spec.num_layers))
    tokens: list[int] = []
    steps: list[np.ndarray] = []
    n = len(every)
    prefill = SpanGraph(parts, GraphSpec("prefill", "prefill", every, logits="last")).eval()
    decode = SpanGraph(parts, GraphSpec("decode", "decode", tuple(kept), skip_adapters=adapted)).eval()
    empty = [torch.zeros(0, parts.spec.num_kv_heads, parts.spec.head_dim)] * (2 * n)
    out = prefill(torch.tensor([prompt_ids]), *empty)
    keys, values = list(out[1 : 1 + n]), list(out[1 + n :])
    logits = out[0][0, -1]
    for _ in range(new_tokens):
        steps.append(logits.numpy())
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos_ids or len(tokens) == new_tokens:
            break
        out = decode(torch.tensor([[tokens[-1]]]), *[keys[i] for i in kept], *[values[i] for i in kept])
        for j, layer in enumerate(kept):
            keys[layer] = torch.cat((keys[layer], out[1 + j]))
            values[layer] = torch.cat((values[layer], out[1 + len(kept) + j]))
        logits = out[0][0, -1]
    return tokens, steps


@dataclass(frozen=True)
class ReferenceKey:
    """What a reference decode depends on; the backend, engine and draft source do not enter."""

    kept: tuple[int, ...]
    prompt_ids: tuple[int, ...]
    new_tokens: int
    eos_ids: frozenset[int]
    adapted: bool = False


class ReferenceDecodes:
    """The PyTorch greedy references of one `check` run, each decoded once: every draft source,
    engine and backend on the same prompt and configuration compares against the same tokens."""

    def __init__(self, parts: Any) -> None:
        self.parts = parts
        self.decodes: dict[ReferenceKey, tuple[tuple[int, ...], tuple[np.ndarray, ...]]] = {}

    def greedy(
        self, prompt_ids: list[int], new_tokens: int, eos_ids: set[int], kept: list[int], adapted: bool = False
    ) -> tuple[list[int], list[np.ndarray]]:
        """reference_greedy's tokens and per-step logits, decoded on the first request only."""
        key = ReferenceKey(tuple(kept), tuple(prompt_ids), new_tokens, frozenset(eos_ids), adapted)
        if key not in self.decodes:
            tokens, steps = reference_greedy(
                self.parts, list(prompt_ids), new_tokens, set(eos_ids), list(kept), adapted
            )
            self.decodes[key] = (tuple(tokens), tuple(steps))
        stored_tokens, stored_steps = self.decodes[key]
        return list(stored_tokens), list(stored_steps)


def greedy_check(
    generator: Any,
    parts: Any,
    config: dict[str, Any],
    prompt: str,
    new_tokens: int,
    draft: str | None = None,
    references: ReferenceDecodes | None = None,
) -> CheckResult:
    """Greedy tokens of the runtime (plain decoding, or speculation with `draft`) against PyTorch."""
    references = references or ReferenceDecodes(parts)
    started = time.perf_counter()
    mode = "ar" if draft is None else "spec"
    result = generator.generate(prompt, max_new_tokens=new_tokens, config=config.id, mode=mode, draft=draft)
    adapted = generator.bundle.manifest.graph(config.decode).skip_adapters
    expected, steps = references.greedy(result.prompt_ids, new_tokens, generator.codec.eos_ids, config.kept, adapted)
    at, margin, passed = greedy_verdict(result.tokens, expected, [top2_margin(s) for s in steps])
    detail = f"{len(result.tokens)} tokens identical"
    if at is not None:
        verdict = "a float tie" if passed else "a real mismatch"
        detail = f"first divergence at token {at} (reference top-1/top-2 margin {margin:.2e}: {verdict})"
    engine = config.decode if draft is None else f"spec:{config.id}:{draft}"
    return CheckResult(
        generator.backend.name,
        engine,
        f"greedy[{prompt[:32]}]",
        passed,
        seconds=time.perf_counter() - started,
        detail=detail,
    )


def draft_quality(
    generator: Any, engine: str, prompt: str, predicted: np.ndarray, expected: np.ndarray, started: float
) -> CheckResult:
    """A precision draft's teacher-forced agreement: informational per prompt (the mean gates);
    a reduced head is judged on the tokens it can name, its coverage reported beside."""
    agreement = float(np.mean(predicted == expected))
    detail = f"top-1 agreement {agreement:.3f} of the draft's forced rows with the fp32 greedy tokens"
    if generator.bundle.graph(engine).draft_vocab:
        named = np.isin(expected, generator.bundle.draft_vocab_ids)
        agreement = float(np.mean(predicted[named] == expected[named])) if named.any() else 1.0
        detail = (
            f"top-1 agreement {agreement:.3f} with the fp32 greedy tokens on the {named.mean():.0%} of rows whose "
            f"token the reduced head can name"
        )
    return CheckResult(
        generator.backend.name,
        engine,
        f"quality[{prompt[:32]}]",
        True,
        max_abs=1.0 - agreement,
        seconds=time.perf_counter() - started,
        detail=detail,
    )


def mean_nll(logits: np.ndarray, tokens: list[int]) -> float:
    """Mean negative log-likelihood of `tokens` under the rows of `logits`."""
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(tokens)), tokens].mean())


def quality_check(
    generator: Any,
    parts: Any,
    prompt: str,
    new_tokens: int,
    engine: str | None = None,
    references: ReferenceDecodes | None = None,
) -> CheckResult:
    """Teacher-forced top-1 agreement and perplexity of the bundle (or of a precision-draft
    `engine`) on the fp32 reference's own greedy continuation, plus where free-running greedy
    decoding first diverges."""
    references = references or ReferenceDecodes(parts)
    started = time.perf_counter()
    prompt_ids = generator.codec.encode(prompt)
    full = generator.bundle.config("full")
    reference, steps = references.greedy(prompt_ids, new_tokens, set(), full.kept)
    logits = teacher_forced_logits(generator, prompt_ids, reference, engine=engine)
    # a draft engine never predicts the first token (prefill does): its rows start at 1
    first = 1 if engine is not None else 0
    predicted, expected = logits[first:].argmax(-1), np.asarray(reference[first:])
    if engine is not None:
        return draft_quality(generator, engine, prompt, predicted, expected, started)
    agreement = float(np.mean(predicted == expected))
    free = generator.generate(prompt_ids, max_new_tokens=new_tokens, config="full").tokens
    at = first_divergence(free, reference)
    detail = (
        f"top-1 agreement {agreement:.3f}, perplexity {np.exp(mean_nll(logits, reference)):.3f} vs fp32 "
        f"{np.exp(mean_nll(np.stack(steps), reference)):.3f}, greedy diverges at {'never' if at is None else at}"
    )
    # Per prompt (32 tokens) agreement is noisy, so each prompt is informational and the mean
    # over all prompts gates (see quality_gate).
    return CheckResult(
        generator.backend.name,
        "quality",
        f"quality[{prompt[:32]}]",
        True,
        max_abs=1.0 - agreement,
        seconds=time.perf_counter() - started,
        detail=detail,
    )


def quality_gate(backend: str, dtype: str, rows: list[CheckResult], engine: str = "quality") -> CheckResult:
    """Mean teacher-forced top-1 agreement over the prompts against the documented bar."""
    mean = 1.0 - float(np.mean([r.max_abs for r in rows]))
    threshold = QUANT_MIN_AGREEMENT[dtype]
    return CheckResult(
        backend,
        engine,
        "quality[mean]",
        mean >= threshold,
        max_abs=1.0 - mean,
        tolerance=1.0 - threshold,
        detail=f"{dtype}: mean top-1 agreement with fp32 {mean:.3f} over {len(rows)} prompts (min {threshold})",
    )


def precision_bits(precision: str) -> str:
    """A precision draft's weight grid, as QUANT_MIN_AGREEMENT names it."""
    return "int8" if precision == "int8" else "int4"


@dataclass(frozen=True)
class CheckSettings:
    """What one `check` run does on every backend."""

    prompts: tuple[str, ...]
    new_tokens: int = 16
    scale_tol: float = 1.0
    progress: bool = True
    provider: str = "cpu"  # the execution provider of the backends that take one (ONNX Runtime's)

    def backend_options(self, backend_name: str) -> dict[str, str]:
        """The options that run `backend_name` on this check's provider: none for a backend without providers."""
        from adaptive_export.runtimes.backends import BACKENDS

        return {"provider": self.provider} if BACKENDS[backend_name].takes_provider else {}


def greedy_cases(bundle: Bundle, prompts: tuple[str, ...]) -> list[tuple[dict[str, Any], str, str | None]]:
    """(configuration, prompt, draft source or None): plain decoding for every configuration;
    speculation (lossless) for every draft source, on every configuration with its engines,
    or on the full model for a source without any."""
    from adaptive_export.runtimes.drafting import SOURCES

    cases: list[tuple[dict[str, Any], str, str | None]] = [
        (c, p, None) for c in bundle.manifest.configs for p in prompts
    ]
    for name, source in SOURCES.items():
        configs = (
            [c for c in bundle.manifest.configs if source.available(c)] if source.engines else [bundle.config("full")]
        )
        cases += [(c, p, name) for c in configs for p in prompts]
    return cases


def quality_rows(
    generator: Any, references: ReferenceDecodes, settings: CheckSettings, engine: str | None, label: str
) -> list[CheckResult]:
    """quality_check on every prompt (of the bundle, or of a precision-draft `engine`)."""
    backend_name = generator.backend.name
    with progress_bar(settings.prompts, f"check {backend_name} {label}", "prompt", settings.progress) as prompts:
        return [
            quality_check(
                generator, references.parts, prompt, settings.new_tokens, engine=engine, references=references
            )
            for prompt in prompts
        ]


@contextlib.contextmanager
def progress_bar(items: Any, desc: str, unit: str, enabled: bool) -> Iterator[Any]:
    """A tqdm bar closed also when a check raises, so the one error line starts on its own line."""
    from tqdm import tqdm

    with tqdm(items, desc=desc, unit=unit, disable=not enabled) as bar:
        yield bar


def quality_gated_engines(bundle: Bundle) -> list[tuple[str, str]]:
    """(label, engine) of the full configuration's draft engines whose own quality `check` gates
    (a draft source's contract names them: runtimes/draft_contracts.py `quality_gated`)."""
    from adaptive_export.runtimes.draft_contracts import CONTRACTS

    engines = bundle.config("full").engines
    return [
        (role.replace("_", " "), engines[role])
        for contract in CONTRACTS.values()
        for role in contract.quality_gated
        if role in engines
    ]


def check_backend(
    bundle: Bundle,
    backend_name: str,
    references: ReferenceDecodes,
    settings: CheckSettings,
    precision: BundlePrecision | None = None,
) -> list[CheckResult]:
    """One backend's rows: every engine's parity, the precision draft's quality, then the
    bundle's quality gate (quantized weights) or greedy identity (every configuration and source)."""
    from adaptive_export.runtimes.backends import make_backend
    from adaptive_export.runtimes.generate import Generator

    precision = precision or bundle_precision(bundle)
    options = settings.backend_options(backend_name)
    backend = make_backend(bundle, backend_name, **options)
    graphs = list(bundle.backend_entry(backend_name).graphs)
    if not backend.executes:
        return [
            CheckResult(backend_name, g, "parity", True, executed=False, detail=backend.skip_reason) for g in graphs
        ]
    parts = references.parts
    with progress_bar(graphs, f"check {backend_name} engines", "engine", settings.progress) as engines:
        results = [
            engine_parity(bundle, backend, parts, graph, scale_tol=settings.scale_tol, precision=precision)
            for graph in engines
        ]
    # the parity sessions go before the decoders' own open: each session that prepacks holds its own
    # copy of the weights (Gemma 3 at accuracy 1, four engine files: 9.5 GB peak with both sets held)
    del backend
    generator = Generator(bundle, backend=backend_name, **options)
    for label, draft_engine in quality_gated_engines(bundle):  # drafts that rarely agree cost time, not correctness
        rows = quality_rows(generator, references, settings, draft_engine, label)
        detected = precision.engines.get(draft_engine)
        bits = (
            detected.dtype if detected and detected.quantized else precision_bits(bundle.graph(draft_engine).precision)
        )
        results += rows + [quality_gate(backend_name, bits, rows, engine=draft_engine)]
    if precision.gated_on_quality:  # the engines' own precision, never the manifest's word
        rows = quality_rows(generator, references, settings, None, "quality")
        return results + rows + [quality_gate(backend_name, precision.dtype, rows)]
    cases = greedy_cases(bundle, settings.prompts)
    with progress_bar(cases, f"check {backend_name} greedy", "prompt", settings.progress) as greedy:
        for config, prompt, draft in greedy:
            results.append(greedy_check(generator, parts, config, prompt, settings.new_tokens, draft, references))
    return results


def bundle_rows(bundle: Bundle, precision: BundlePrecision, expected: str | None, loaded: Any) -> list[CheckResult]:
    """What the engines are, and the tokenizer, against the reference and the user's expectation:
    one failing row per difference, or one passing row each."""
    from adaptive_export.exporter.check_tokenizer import tokenizer_problems
    from adaptive_export.runtimes.text import TextCodec

    checks = {
        "precision": (
            precision_problems(bundle, precision, expected),
            f"engines are {precision.precision_class}, as the manifest declares",
        ),
        "tokenizer": (
            tokenizer_problems(TextCodec(bundle), loaded.tokenizer, loaded.hf_model),
            "encode/decode, special tokens and chat format identical to the reference's",
        ),
    }
    rows = []
    for check, (problems, fine) in checks.items():
        rows += [CheckResult("bundle", check, check, False, detail=problem) for problem in problems]
        rows += [] if problems else [CheckResult("bundle", check, check, True, detail=fine)]
    return rows


def structure_check(bundle: Bundle, model: str | None, allow_unrebuilt: Collection[str] = ()) -> list[CheckResult]:
    """The engines against those the model defines, node for node and byte for byte (exporter/check_structure.py)."""
    from adaptive_export.exporter.check_structure import structure_rows

    if model is None:
        return []  # load_parts says the reference is required
    rows = structure_rows(bundle, model, allow_unrebuilt)
    return [
        CheckResult("onnx", r.engine, "structure", r.passed, r.executed, seconds=r.seconds, detail=r.detail)
        for r in rows
    ]


def nothing_executed(results: list[CheckResult], skipped: dict[str, str]) -> CheckResult | None:
    """A run in which no engine ran is no pass: a failing row naming each skipped backend and why."""
    if any(r.executed and r.check == "parity" for r in results):
        return None
    reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items()) or "the bundle lists no engines"
    return CheckResult("bundle", "engines", "executed", False, detail=f"no engine could be checked ({reasons})")


def run_check(
    bundle_dir: str,
    model: str | None,
    prompts: list[str] | None,
    new_tokens: int = 16,
    scale_tol: float = 1.0,
    progress: bool = True,
    expect_precision: str | None = None,
    provider: str = "cpu",
    allow_unrebuilt: Collection[str] = (),
) -> CheckReport:
    """Load the bundle and the reference the user named once, then check what the engines are,
    the tokenizer, and every backend against it. Nothing is taken from the bundle on trust."""
    from adaptive_export.loading.artifacts import load_parts
    from adaptive_export.loading.gguf_parses import one_parse_per_file
    from adaptive_export.loading.read_once import model_headers_read_once
    from adaptive_export.runtimes.bundle import load_bundle

    bundle = load_bundle(bundle_dir)
    precision = bundle_precision(bundle)  # reads every engine through the graph policy: a refused one is bad input
    # the rebuild and the reference load one model: its config and tokenizer are read, and a .gguf
    # parsed, once (two parses of Gemma 3's 262k-token vocabulary cost 47 s of a 167 s check, Zen 3)
    with model_headers_read_once(), one_parse_per_file():
        # before the fp32 reference loads: one model in memory at a time
        structure = structure_check(bundle, model, allow_unrebuilt)
        loaded, parts = load_parts(bundle, model)
    report = CheckReport(bundle=str(bundle_dir), model=loaded.source, provider=provider)
    report.results += structure + bundle_rows(bundle, precision, expect_precision, loaded)
    settings = CheckSettings(tuple(prompts or BUILTIN_PROMPTS), new_tokens, scale_tol, progress, provider)
    references = ReferenceDecodes(parts)
    skipped: dict[str, str] = {}
    for backend_name in bundle.manifest.backends:
        rows = check_backend(bundle, backend_name, references, settings, precision)
        if rows and not rows[0].executed:  # a backend that cannot run here skips all its engines, for one reason
            skipped[backend_name] = rows[0].detail
        report.results += rows
    missing = nothing_executed(report.results, skipped)
    report.results += [missing] if missing else []
    return report


def write_report(report: CheckReport, json_path: str | None, junit_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if junit_path:
        report.junit().write(junit_path, encoding="utf-8", xml_declaration=True)
