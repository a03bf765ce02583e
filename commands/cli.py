"""The `adaptive-export` command line: build, run, check, inspect, bench.

Parses arguments, turns them into the command's typed options (commands/options.py) and
runs the command (commands/build.py, run.py, check.py). Exit codes: 0 success; 1 `check`
found a mismatch; 2 bad usage or input (one line on stderr naming the problem and the fix,
never a traceback). `run` and `inspect` import only the runtime, so they work where torch
and transformers are not installed.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, NoReturn

from adaptive_export.commands import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Signals,
    defer_signals,
    route_signals_to_engine_runs,
)

# Nothing heavy above this line: the project's modules (numpy, onnx, torch...) are imported by
# main() while SIGINT/SIGTERM are only recorded (see _prepare), never at module level here.


class _Parser(argparse.ArgumentParser):
    tokens: ClassVar[tuple[str, ...]] = ()  # the command line being parsed, for error()'s hint

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        _Parser.tokens = tuple(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:  # argparse would print usage and exit 2; keep it one line
        from adaptive_export.runtimes.errors import UsageError

        stray = self._stray_option(message)
        if stray is not None:
            raise UsageError(
                f"bad arguments: {stray[:60]!r} is read as an option, and {self.prog} has no such option",
                f"to pass a model, bundle or file of that name, write it as ./{stray[:60]} (or put it after `--`"
                f" at the end of the command); for an option, see `{self.prog} --help`",
            )
        raise UsageError(f"bad arguments: {message}", f"see `{self.prog} --help`")

    def _stray_option(self, message: str) -> str | None:
        """The word argparse took for an option that does not exist: most likely a MODEL or bundle
        named `-name` (argparse reads any word starting with '-' as an option)."""
        if message.startswith("unrecognized arguments: "):
            words = message.removeprefix("unrecognized arguments: ").split()
        elif message.startswith("the following arguments are required"):  # the name was taken, the slot left empty
            words = list(itertools.takewhile(lambda word: word != "--", _Parser.tokens))
            words = [word for word in words if word.split("=", 1)[0] not in self._option_string_actions]
        else:
            return None
        return next((w for w in words if w.startswith("-") and w != "-" and not w[1:2].isdigit()), None)


def _bounded_int(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is outside {low}..{high}")
        return value

    return parse


def _add_int(
    parser: argparse.ArgumentParser, flag: str, bounds: tuple[int, int], default: int | None, help: str, **more: Any
) -> None:
    """An integer option bounded to `bounds`: a value outside is a usage error naming them."""
    parser.add_argument(flag, type=_bounded_int(*bounds), default=default, help=help, **more)


def _router_threshold(text: str) -> str:
    """'auto' or a number strictly between 0 and 1, kept as text (the calibration parses it)."""
    if text == "auto":
        return text
    value = _finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and 1 (or 'auto')")
    return text


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


PREPACK_CHOICES = ["auto", "none", "decode", "all"]
DECODING_MODES = ["ar", "spec", "auto", "pipelined"]


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; the runtime's bounds and registries are imported here, not at module level."""
    parser = _Parser(
        prog="adaptive-export",
        description="Export adaptive-compute LLMs (router layer skipping, early-exit self-speculation) "
        "to static edge engines, run and check them.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log each step (default: warnings and progress bars only)"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_build_command(sub)
    _add_run_command(sub)
    _add_check_command(sub)
    _add_inspect_command(sub)
    _add_bench_command(sub)
    _add_serve_command(sub)
    return parser


def _add_build_command(sub: Any) -> None:
    """`build`'s arguments, in the order `build --help` lists them."""
    build = sub.add_parser(
        "build",
        help="export a model into a bundle of static engines",
        description="Export MODEL into a bundle: prefill (+ router scores), one decode engine per skip "
        "configuration, draft/verify engines; weights stored once.",
    )
    _add_build_output_arguments(build)
    _add_build_router_arguments(build)
    _add_build_speculation_arguments(build)
    _add_build_draft_arguments(build)
    _add_build_precision_arguments(build)
    build.add_argument("--seed", type=int, default=0, help="seed for calibration and training (default: 0)")


def _packaged_models() -> str:
    """Each packaged name with its model and install command, read from loading/packaged.py so a
    name added there is listed here."""
    from adaptive_export.loading.packaged import PACKAGED

    return ", ".join(f"'{model.name}' ({model.title}; {model.pip})" for model in PACKAGED.values())


def _add_build_output_arguments(build: argparse.ArgumentParser) -> None:
    """What to export, where, for which backends."""
    from adaptive_export.runtimes import limits
    from adaptive_export.runtimes.backends import BACKEND_NAMES

    build.add_argument(
        "model",
        nargs="?",
        default="smollm2",
        help="Hugging Face model directory, .gguf file, Hugging Face Hub id (org/name: from the HF cache, "
        "downloaded only when the hub is reachable and HF_HUB_OFFLINE is unset; a local directory or file of "
        "the same name wins), or a packaged model (default: smollm2): "
        + _packaged_models()
        + "; one split into chunk packages is assembled once into ~/.cache/adaptive-export",
    )
    build.add_argument(
        "--revision",
        default=None,
        help="with a Hub id: the branch, tag or commit to build from (default: the repository's main branch)",
    )
    build.add_argument(
        "--gguf-file",
        default=None,
        help="with a Hub id of a GGUF repository: the .gguf file to build from (e.g. model-Q8_0.gguf)",
    )
    build.add_argument(
        "-o",
        "--output",
        required=True,
        help="bundle directory to create (written to a temp dir beside it, then renamed)",
    )
    build.add_argument(
        "--backend",
        default="onnx",
        help=f"comma-separated backends: {', '.join(BACKEND_NAMES)} (onnx always; default: onnx)",
    )
    build.add_argument(
        "--onnx-flavour",
        choices=["ort", "portable"],
        default="ort",
        help="ort (default): ONNX Runtime's fused kernels (GroupQueryAttention, SkipSimplifiedLayerNormalization, "
        "packed QKV), KV updated in place, fastest; portable: standard ONNX ops that any runtime parses "
        "(always used when --backend includes tensorrt)",
    )
    _add_int(
        build,
        "--max-len",
        (1, limits.MAX_BUILD_LEN),
        2048,
        f"KV arena length: prompt + new tokens can never exceed it (default: 2048, at most {limits.MAX_BUILD_LEN})",
    )
    build.add_argument(
        "--force",
        action="store_true",
        help="replace the output directory if it is a previous bundle "
        "(never the model, the working directory or a parent of either)",
    )


def _add_build_router_arguments(build: argparse.ArgumentParser) -> None:
    """FiRST routers and the skip configurations they choose."""
    build.add_argument(
        "--routers",
        default=None,
        help="'train' to train FiRST routers on the calibration prompts, or a routers .safetensors file; "
        "omit for no layer skipping",
    )
    build.add_argument(
        "--calib",
        default=None,
        help="calibration prompts, JSONL with a 'prompt' field per line (default: the built-in sample set in samples/)",
    )
    _add_int(
        build, "--max-configs", (1, 64), 3, "most skip configurations to compile besides the full model (default: 3)"
    )
    build.add_argument(
        "--router-lambda",
        type=_finite_float,
        default=None,
        help="router sparsity weight lambda for --routers train (default: 0.02, the largest lambda of the "
        "docs/routers.md sweep keeping held-out top-1 agreement above 0.9; 0.1 skips about 4.6 of 30 SmolLM2 "
        "layers at 0.63)",
    )
    build.add_argument(
        "--quality-floor",
        "--min-config-agreement",
        dest="min_config_agreement",
        metavar="F",
        type=_finite_float,
        default=None,
        help="compile a skip configuration only if decoding with it keeps this share of the full model's greedy "
        "tokens on the calibration prompts (teacher-forced; default: 0.8, i.e. at most one token in five "
        "differs; 0 keeps every chosen configuration)",
    )
    build.add_argument(
        "--router-threshold",
        metavar="T|auto",
        type=_router_threshold,
        default=None,
        help="the runtime keeps layer i when its router scores p_i >= this (0 < T < 1; default 0.5); 'auto' "
        "compiles the configurations of each of 0.5, 0.6, 0.7, 0.8, 0.9 and keeps the threshold whose "
        "configurations, each above the quality floor, skip the most layers per calibration prompt "
        "(the default with --lora)",
    )
    _add_int(
        build,
        "--lora",
        (0, 256),
        0,
        "with --routers: train one shared set of rank-R skip adapters (FiRST's LoRA compensation: a low-rank "
        "residual block after each kept layer of a skip configuration's decode), so configurations that skip "
        "more layers pass the quality floor; measured on held-out calibration prompts; 0 (default): none",
        metavar="R",
    )
    build.add_argument(
        "--router-lr",
        type=_finite_float,
        default=None,
        help="Adam learning rate for --routers train "
        "(default: 5e-3, for about 120 steps on 40 prompts; raise it for tiny prompt sets)",
    )


def _add_build_speculation_arguments(build: argparse.ArgumentParser) -> None:
    """Early-exit self-speculation and the weight precision of the engines."""
    build.add_argument(
        "--speculate",
        metavar="auto|E:k",
        help="'auto' to calibrate self-speculation (exit layer E, draft length k, exit adapter) and build "
        "draft/verify engines, or 'E:k' to force them",
    )
    build.add_argument(
        "--exit-adapter",
        default="none",
        metavar="none|fit|FILE",
        help="with --speculate: 'fit' fits a low-rank exit adapter (head(adapter(h_E)) ~ full model, KL on the model's "
        "own continuations of the calibration prompts) at E in {L/2, 2L/3, 5L/6, L-2} (at E with --speculate E:k), "
        "so calibration sees the adapted acceptance and the chosen exit's adapter ships as "
        "exit_adapters.safetensors; FILE reuses such a file; none (default) drafts from the raw exit",
    )
    build.add_argument(
        "--quantize",
        choices=["auto", "none", "native", "int8", "int4"],
        default="auto",
        help="weight precision of the ONNX engines. native: keep a quantized GGUF's own blocks "
        "(Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0) bit for bit, no re-quantization (as MatMulNBits or as the "
        "file's rows: see --native-form); int8/int4: "
        "round-to-nearest re-quantization of float weights; none: fp32; auto (default): native for a quantized "
        ".gguf (e.g. smollm2), none otherwise",
    )


def _add_build_draft_arguments(build: argparse.ArgumentParser) -> None:
    """Draft sources besides the early exit: a cheaper precision, its trimmed head, each build-time source's option."""
    from adaptive_export.runtimes import limits

    build.add_argument(
        "--draft-precision",
        choices=["none", "int8", "int4", "native4"],
        default="none",
        help="also build a precision draft (run --draft precision): the full model at a cheaper weight precision "
        "drafts tokens that the bundle's own engines verify, losslessly, on the same KV arena. int8/int4: a "
        "round-to-nearest copy of float weights (adds about 1/4 / 1/7 of the fp32 weight bytes); native4: a "
        "GGUF-exact bundle's own blocks at accuracy 4 (shares its blocks; for --quant-accuracy 1 bundles). With "
        "--speculate auto, calibration measures it on the built engines. ONNX Runtime (ort flavour) only. "
        "Default: none",
    )
    from adaptive_export.calibration.drafts import BUILD_STEPS

    for step in BUILD_STEPS.values():  # a draft source's own option (calibration/drafts/<name>.py)
        step.option.add_to(build)
    build.add_argument(
        "--draft-head",
        default="none",
        metavar="none|train|FILE",
        help="with --speculate: 'train' trains the early-exit draft by self-distillation (an exit block of at most "
        "one layer's parameters, low-rank or gated MLP, and a VocabTrim head of the 2k/4k/8k ids the model writes "
        "most, on its own requests and answers plus stdlib docstrings; minutes) and calibrates a confidence threshold "
        "that ends a round's drafting early; FILE reuses a head file (e.g. the shipped samples/"
        "smollm2_draft_head.safetensors); see docs/speculation.md",
    )
    _add_int(
        build,
        "--draft-vocab",
        (0, limits.MAX_VOCAB),
        0,
        "VocabTrim: the precision draft's LM head scores only N tokens (the special tokens, then the model's own "
        "greedy continuations of the calibration prompts by frequency, then the prompts', then the lowest ids), "
        "so a draft step no longer pays the whole head (28M of SmolLM2's 135M parameters, 168M of Gemma 3's 270M). "
        "The verifier keeps the full head, so output is unchanged; a draft is accepted only when the verifier's "
        "token is among the N. Ships the ids as draft_vocab.bin; calibration.json draft_vocab holds the held-out "
        "coverage. Needs --draft-precision. Default: 0 (the full head)",
        metavar="N",
    )


def _add_build_precision_arguments(build: argparse.ArgumentParser) -> None:
    """Per-backend precision and the quantization grid."""
    build.add_argument(
        "--coreml-precision",
        choices=["float16", "float32"],
        default="float16",
        help="CoreML compute precision (default: float16)",
    )
    build.add_argument(
        "--trt-precision",
        choices=["fp32", "fp16", "int8"],
        default="fp16",
        help="TensorRT engine precision flag (default: fp16)",
    )
    _add_int(build, "--quant-block", (1, 4096), 32, "quantization block size along the input dimension (default: 32)")
    build.add_argument(
        "--quant-accuracy",
        type=int,
        default=4,
        help="accuracy_level of the quantized linears (MatMulNBits, MatMulPacked): 4 = int8 activations (fastest "
        "on CPU, default; slightly lossy), 1 = fp32 activations (with --quantize native: the engines compute "
        "exactly the GGUF's model), 0 = unset (not with --native-form packed)",
    )
    build.add_argument(
        "--native-form",
        choices=["auto", "packed", "nbits"],
        default="auto",
        help="with --quantize native, how the engines hold the GGUF's blocks. packed: the file's rows verbatim "
        "(uint8, the GGUF's own bytes) read by this package's MatMulPacked/GatherPacked CPU kernels (domain "
        "ai.adaptive_export; needs the compiled op library, CPU provider only, --quant-accuracy 1 or 4; Q5_1 "
        "is not read); nbits: converted, bit exact, to ONNX Runtime's MatMulNBits/GatherBlockQuantized "
        "(codes, scales and block-sum corrections); auto (default): nbits for now",
    )
    build.add_argument(
        "--prompt-rows",
        choices=["measure", "rule"],
        default="measure",
        help="measure (default): decode the prompts of samples/policy_prompts.jsonl on the built engines and record, "
        "per kind of prompt (edit: it holds code to copy; chat), whether two-row passes with exact prompt-lookup "
        "speculation beat one-row steps on this CPU (the default run reads it; 5 s on SmolLM2, 43 s on "
        "Qwen2.5-Coder-1.5B); rule: skip that and let the runtime's fixed rule decide (two rows for edit "
        "prompts only). Builds with --speculate choose their own decoding",
    )


def _add_run_command(sub: Any) -> None:
    """`run`: the prompt and sampling; the engines' settings follow in `_add_run_engine_arguments`."""
    run = _add_bundle_command(
        sub,
        "run",
        "generate text from a bundle (torch-free)",
        "Generate from a bundle with the pure-Python runtime. Streams text unless --json.",
    )
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "-p",
        "--prompt",
        help="prompt text (the bundle's chat template is applied unless --raw; a bundle without a template, such as a "
        "base model like gemma3, always takes raw text)",
    )
    source.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    run.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    run.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0 = off)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1 = off)")
    run.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    run.add_argument("--stop", action="append", default=[], help="stop when this string appears (repeatable)")
    run.add_argument(
        "--raw",
        action="store_true",
        help="do not apply the chat template (bundles of base models have none: their prompts are raw text anyway)",
    )
    run.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, tokens, prompt_tokens, stats) instead of streaming",
    )
    _add_run_decoding_arguments(run)
    _add_run_engine_arguments(run)


def _draft_source_name(text: str) -> str:
    """`--draft`'s value; the prompt-token source's old name gets a pointer to its new one
    ("PPD" now names nothing here: a later source may take it)."""
    from adaptive_export.runtimes.draft_registry import RENAMED_SOURCES

    if text in RENAMED_SOURCES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is now called {RENAMED_SOURCES[text]!r}: use --draft {RENAMED_SOURCES[text]}"
        )
    return text


def _add_run_decoding_arguments(run: argparse.ArgumentParser) -> None:
    """Which layers run and how tokens are drafted."""
    from adaptive_export.runtimes import limits
    from adaptive_export.runtimes.draft_registry import DRAFT_SOURCES

    _add_config_and_mode(run)
    run.add_argument(
        "--draft",
        default=None,
        type=_draft_source_name,
        choices=list(DRAFT_SOURCES),
        help="draft source for --mode spec (default: the one calibration chose, else prompt_lookup); precision needs "
        "a bundle built with --draft-precision",
    )
    _add_int(
        run,
        "--draft-len",
        (1, limits.MAX_DRAFT_LEN),
        None,
        f"draft tokens per round, 1..{limits.MAX_DRAFT_LEN} (default: calibrated, else 4)",
    )
    run.add_argument(
        "--draft-bundle",
        default=None,
        metavar="DIR",
        help="a smaller bundle built from a model with the same tokenizer (Qwen2.5-Coder-0.5B's for the 1.5B) that "
        "drafts for this one under --mode auto/spec, verified exactly: greedy tokens stay --mode ar's, which then also "
        "decodes two rows a pass. Under auto it drafts on chat prompts; edit prompts keep prompt lookup. A round "
        "drafts up to 6 tokens (--draft-len sets it) and ends after one the draft is unsure of. Costs that bundle's "
        "memory (+41%% peak RSS for the 0.5B beside the 1.5B); on a GPU the bundle's own head drafts faster",
    )
    run.add_argument(
        "--decode-rows",
        type=int,
        choices=(1, 2),
        default=None,
        help="rows of every decode pass (default: the bundle's min_decode_rows, else 1). 2: each plain step also "
        "verifies one free guess, so plain decoding computes the rows a verify pass computes and --mode spec/auto "
        "give the tokens of --mode ar on accuracy-4 bundles too (docs/speculation.md)",
    )


def _add_run_engine_arguments(run: argparse.ArgumentParser) -> None:
    """Backend, provider, threads, verification and prepacking of the engines."""
    from adaptive_export.runtimes.backends import BACKEND_NAMES

    run.add_argument("--backend", default="onnx", help=f"engine backend: {', '.join(BACKEND_NAMES)} (default: onnx)")
    _add_provider(run, "ONNX Runtime execution provider")
    run.add_argument(
        "--verify",
        default="full",
        choices=["full", "size"],
        help="bundle verification: full sha256 (default) or sizes only (fast path)",
    )
    _add_threads_and_prepack(run)


MODE_HELP = {
    "auto": "the draft source calibration found to pay on this bundle, else prompt lookup (free: no draft engine), "
    "gated to draft only while drafts pay for the wider verify pass (plain speed on chat, faster where the answer "
    "repeats the context; ar's tokens under greedy decoding, up to near-ties: docs/speculation.md); on two-row "
    "passes (an edit prompt) prompt lookup drafts one token a round, more after rounds it got all right",
    "ar": "plain decoding",
    "spec": "self-speculative with --draft, ungated",
    "pipelined": "predictive pipelined decoding: the early-exit draft of the next token runs beside the rest of this "
    "token's layers, half the threads each (needs a bundle built with --speculate; exact: ar's tokens, up to "
    "near-ties; docs/pipelined.md)",
}


def _add_config_and_mode(parser: argparse.ArgumentParser) -> None:
    """Which layers run and whether tokens are drafted: `run`, `serve` and `bench` alike, with the
    defaults of the one decoding record (runtimes/settings.py)."""
    from adaptive_export.runtimes.settings import DEFAULT_DECODING

    default_mode = DEFAULT_DECODING.mode
    parser.add_argument(
        "--config",
        default=DEFAULT_DECODING.config,
        help="skip configuration: auto (routers pick, default), full, or a config id from `inspect`",
    )
    order = [default_mode, *(mode for mode in MODE_HELP if mode != default_mode)]
    parser.add_argument(
        "--mode",
        default=default_mode,
        choices=DECODING_MODES,
        help="; ".join(f"{mode}{' (default)' if mode == default_mode else ''}: {MODE_HELP[mode]}" for mode in order),
    )


def _add_provider(parser: argparse.ArgumentParser, what: str) -> None:
    """ONNX Runtime's execution provider: `run`, `bench` and `check` alike."""
    from adaptive_export.runtimes.backends import PROVIDERS

    parser.add_argument(
        "--provider",
        default="cpu",
        choices=list(PROVIDERS),
        help=f"{what} (default: cpu; cuda and tensorrt need onnxruntime-gpu and a GPU: docs/backends.md)",
    )


def _add_threads_and_prepack(parser: argparse.ArgumentParser) -> None:
    """ONNX Runtime's threads and weight prepacking: `run` and `bench` alike."""
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads, at most 4 per core (default: 0 = ONNX Runtime's choice, the physical cores)",
    )
    parser.add_argument(
        "--prepack",
        default="auto",
        choices=PREPACK_CHOICES,
        help="ONNX Runtime weight prepacking for fp32 engines (quantized ones always prepack). auto (default): the "
        "fused full-model engine only (faster decoding and verification, no extra memory: the runtime releases its "
        "own copy); decode: every decode engine; all: every engine; each further prepacked engine holds its own "
        "packed copy",
    )


def _add_bundle_command(sub: Any, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A command that reads a bundle: its parser, with the bundle directory as its first argument."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=description)
    parser.add_argument("bundle", help="bundle directory")
    return parser


def _add_check_command(sub: Any) -> None:
    from adaptive_export.commands.check import MAX_TOLERANCE
    from adaptive_export.exporter.check_precision import PRECISION_CLASSES
    from adaptive_export.loading.packaged import PACKAGED
    from adaptive_export.runtimes import limits

    check = _add_bundle_command(
        sub,
        "check",
        "check every engine against the PyTorch reference (CI gate)",
        "Parity of every engine of every backend against PyTorch, greedy tokens against HF transformers, "
        "the tokenizer against the reference's, the engines' precision against the manifest. Nothing is taken from "
        "the bundle on trust: the reference is --model (docs/hardening.md). Exit 0 pass, 1 mismatch, 2 bad input.",
    )
    check.add_argument(
        "--model",
        default=None,
        help="the reference model the bundle was built from (required): a HF model directory, a .gguf file or a "
        f"packaged name as `build` accepts ({', '.join(PACKAGED)}); the bundle's recorded source is never opened",
    )
    check.add_argument(
        "--expect-precision",
        choices=PRECISION_CLASSES,
        default=None,
        help="fail unless the engines are this precision (read from their ops and initializers; default: "
        "whatever they are, the manifest's dtype having to agree)",
    )
    check.add_argument(
        "--allow-unrebuilt",
        action="append",
        metavar="ENGINE",
        help="accept these engines (comma-separated, repeatable) although no rebuild from --model makes them: "
        "they are then checked by behaviour only. By default every engine is compared node for node and "
        "byte for byte with the one the model's build makes, and one that is not fails",
    )
    check.add_argument("--report", default=None, help="write the JSON report here")
    check.add_argument("--junit", default=None, help="write JUnit XML here (one test case per engine and check)")
    check.add_argument(
        "--prompts",
        default=None,
        help="JSONL prompts ('prompt' field) for the greedy checks (default: built-in prompts)",
    )
    _add_int(check, "--new-tokens", (1, limits.MAX_LEN), 16, "greedy tokens compared per prompt (default: 16)")
    _add_provider(check, "ONNX Runtime execution provider the onnx engines are checked on, as `run` runs them")
    check.add_argument(
        "--tolerance",
        type=float,
        default=1.0,
        help=f"multiply the documented logit tolerances by this factor, in (0, {MAX_TOLERANCE:g}] (default: 1)",
    )


def _add_inspect_command(sub: Any) -> None:
    inspect = _add_bundle_command(
        sub,
        "inspect",
        "describe a bundle: graphs, sizes, configurations, backends",
        "Print what a bundle holds and can do (torch-free).",
    )
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")


def _add_bench_command(sub: Any) -> None:
    from adaptive_export.runtimes import limits

    bench = _add_bundle_command(
        sub,
        "bench",
        "time prefill and decoding of a bundle",
        "Median prefill ms and TPOT of the bundle over repetitions (torch-free). "
        "For comparisons with HF transformers use benchmarks/decode.py.",
    )
    bench.add_argument(
        "-p", "--prompt", default="Write a short story about a robot who learns to paint.", help="prompt text"
    )
    _add_int(bench, "--max-new-tokens", (1, limits.MAX_LEN), 32, "tokens per repetition (default: 32)")
    _add_int(bench, "--repeat", (1, 1000), 5, "timed repetitions after one warm-up (default: 5)")
    _add_config_and_mode(bench)
    _add_provider(bench, "ONNX Runtime execution provider")
    _add_threads_and_prepack(bench)
    bench.add_argument("--json", action="store_true", help="print JSON")


def _add_serve_command(sub: Any) -> None:
    """`serve`: the bundle behind an OpenAI-compatible HTTP API; decoding and engine options as `run`'s."""
    from adaptive_export.commands.serve import MAX_CONNECTIONS, MAX_QUEUE

    summary = "serve a bundle over an OpenAI-compatible HTTP API (torch-free; needs the serve extra)"
    description = (
        "Serve one bundle at /v1/chat/completions, /v1/completions and /v1/models (OpenAI's API, "
        "streaming with server-sent events). One generation at a time; see docs/serve.md."
    )
    serve = _add_bundle_command(sub, "serve", summary, description)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 exposes the model to the network "
        "without authentication, and prints a warning)",
    )
    _add_int(serve, "--port", (1, 65535), 8000, "TCP port (default: 8000)")
    _add_int(
        serve,
        "--queue",
        (1, MAX_QUEUE),
        8,
        "requests that may wait while one generates (default: 8); more get HTTP 429",
    )
    _add_int(
        serve,
        "--max-tokens",
        (1, 1 << 20),
        256,
        "tokens to generate when a request names no max_tokens (default: 256, capped by the bundle's context)",
    )
    _add_int(
        serve,
        "--max-connections",
        (1, MAX_CONNECTIONS),
        100,
        "connections open at once (default: 100); over it the longest-idle one is closed, or 503 when all are busy",
    )
    serve.add_argument(
        "--read-timeout",
        type=_finite_float,
        default=10.0,
        metavar="S",
        help="seconds a client has to send a request's headers, and then its body (default: 10); slower ones are "
        "closed (408)",
    )
    serve.add_argument(
        "--allow-origin",
        dest="allow_origins",
        action="append",
        metavar="ORIGIN",
        help="let web pages from ORIGIN (scheme://host[:port], or * for any) call the server; repeatable. By "
        "default requests carrying another Origin, a Host other than this server's, or a body that is not "
        "application/json are refused (403/415), so a web page cannot drive the model",
    )
    _add_run_decoding_arguments(serve)
    _add_run_engine_arguments(serve)


def _command(name: str) -> tuple[Any, Any]:
    """(options class, command function); each command's module is imported only when chosen,
    so `run` and `inspect` never import torch."""
    import importlib

    module_name, function, options = {
        "build": ("adaptive_export.commands.build", "cmd_build", "BuildOptions"),
        "run": ("adaptive_export.commands.run", "cmd_run", "RunOptions"),
        "check": ("adaptive_export.commands.check", "cmd_check", "CheckOptions"),
        "inspect": ("adaptive_export.commands.run", "cmd_inspect", "InspectOptions"),
        "bench": ("adaptive_export.commands.run", "cmd_bench", "BenchOptions"),
        "serve": ("adaptive_export.commands.serve", "cmd_serve", "ServeOptions"),
    }[name]
    from adaptive_export.commands import options as typed

    return getattr(typed, options), getattr(importlib.import_module(module_name), function)


# C extensions each command imports anyway, loaded while signals are only recorded: an interrupt
# raised inside an extension's own import can abort the interpreter (SIGABRT/SIGSEGV).
_PRELOAD = {
    "build": ("onnx", "torch", "tokenizers", "safetensors"),
    "check": ("onnx", "onnxruntime", "torch", "tokenizers", "safetensors"),
    "run": ("onnx", "onnxruntime", "tokenizers"),
    "bench": ("onnx", "onnxruntime", "tokenizers"),
    "inspect": ("onnx",),
    "serve": ("onnx", "onnxruntime", "tokenizers"),
}


def _preload(command: str) -> None:
    import importlib
    import importlib.util

    for name in _PRELOAD[command]:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM unwind like Ctrl-C, so a build in progress removes its staging
    directory; the request is recorded first, so a build whose library swallows the
    KeyboardInterrupt still stops at its commit (exporter/bundle_writer.py). Imports nothing:
    a handler may run in the middle of an import."""
    Signals.requested = True
    bundle_writer = sys.modules.get("adaptive_export.exporter.bundle_writer")
    if bundle_writer is not None:
        bundle_writer.request_interrupt()
    raise KeyboardInterrupt


def _interrupted() -> bool:
    bundle_writer = sys.modules.get("adaptive_export.exporter.bundle_writer")
    return Signals.requested or bool(bundle_writer and bundle_writer.Interrupts.requested)


class _LineTrackingStderr:
    """The CLI's stderr, remembering whether its last write ended a line. A signal can land
    inside a progress bar's close(), after the bar's text and before its newline; the error
    line must still start a line of its own. Everything but write() is the real stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if text:
            self.at_line_start = False  # an interrupt mid-write leaves "not at a line start": one blank line at worst
        written = self._stream.write(text)
        if text:
            self.at_line_start = text.endswith(("\n", "\r"))
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _error_line(text: str) -> None:
    """Print the one-line error on a line of its own. A progress bar redraws its line without a
    newline, and the bar of a loop that an exception left is closed only when its frame is freed,
    after this line: close the live bars first, so `error: ...` never trails a bar's text."""
    progress = sys.modules.get("tqdm")
    for bar in list(getattr(progress.tqdm, "_instances", ()) if progress else ()):
        bar.close()
    if not getattr(sys.stderr, "at_line_start", True):
        text = "\n" + text
    print(text, file=sys.stderr)


def _report_interrupt() -> int:
    """One line for every way an interrupt surfaces (Ctrl-C, SIGTERM, or a library's own exception)."""
    _error_line("error: interrupted. Fix: run the command again (no partial bundle was left)")
    return EXIT_INTERRUPTED


def _report_unexpected(exc: BaseException) -> int:
    """The backstop's one line: the exception's type and first line, and how to get the traceback."""
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    _error_line(
        f"error: unexpected {type(exc).__name__}{': ' + text if text else ''}. "
        "Fix: check the inputs; if they are valid, report this with the traceback from ADAPTIVE_EXPORT_TRACEBACK=1"
    )
    return EXIT_USAGE


def _prepare(argv: Sequence[str] | None, owns_signals: bool) -> tuple[Any, Any, Any]:
    """Parse the arguments and import the chosen command (args, options class, command function).
    Under the real CLI signals are only recorded meanwhile, then raise from the command on."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    options_class, command = _command(args.command)
    if owns_signals:
        _preload(args.command)
        bundle_writer = sys.modules.get("adaptive_export.exporter.bundle_writer")
        if bundle_writer is not None:
            bundle_writer.Interrupts.managed = True
            bundle_writer.Interrupts.requested = bundle_writer.Interrupts.requested or Signals.requested
        if not Signals.requested:
            signal.signal(signal.SIGTERM, _terminate_as_interrupt)
            signal.signal(signal.SIGINT, _terminate_as_interrupt)
        if args.command in ("run", "check", "bench"):
            route_signals_to_engine_runs()
    return args, options_class, command


def main(argv: Sequence[str] | None = None) -> int:
    owns_signals = argv is None and threading.current_thread() is threading.main_thread()  # not in-process callers
    if owns_signals:
        defer_signals()  # already done at import when this process is the command; idempotent
        if not isinstance(sys.stderr, _LineTrackingStderr):
            sys.stderr = _LineTrackingStderr(sys.stderr)
    from adaptive_export.runtimes.errors import UsageError

    try:
        args, options_class, command = _prepare(argv, owns_signals)
        if owns_signals and Signals.requested:  # arrived during start-up
            return _report_interrupt()
        return command(options_class.from_args(args))
    except SystemExit:  # --help, --version
        if owns_signals and _interrupted():
            return _report_interrupt()
        raise
    except UsageError as exc:
        if _interrupted():
            return _report_interrupt()
        _error_line(exc.one_line())
        return EXIT_USAGE
    except KeyboardInterrupt:
        return _report_interrupt()
    except BrokenPipeError:  # e.g. `inspect DIR | head`
        return EXIT_OK
    except (Exception, RecursionError) as exc:  # backstop: bad input the explicit checks missed is still exit 2
        if _interrupted():  # an interrupt a library turned into another exception
            return _report_interrupt()
        if os.environ.get("ADAPTIVE_EXPORT_TRACEBACK"):
            raise
        return _report_unexpected(exc)
    finally:
        if owns_signals:  # the outcome is decided; a late signal must not change it, nor the interpreter's
            for signum in (signal.SIGINT, signal.SIGTERM):  # shutdown (which resets Python handlers to default)
                signal.signal(signum, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
