"""Typed options of each command: the command line parses argparse, then hands the layers
below one of these frozen dataclasses (never an argparse.Namespace)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from adaptive_export.exporter.backends import parse_backends
from adaptive_export.runtimes.settings import DEFAULT_DECODING, DecodingSettings

T = TypeVar("T", bound="Options")


class Options:
    """Built from the parsed namespace's attributes of the same names; a subclass converts the
    ones whose type differs in `from_args`."""

    @classmethod
    def from_args(cls: type[T], args: argparse.Namespace, **converted: Any) -> T:
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        values = {name: getattr(args, name) for name in names if name not in converted}
        return cls(**values, **converted)


def decoding_from_args(args: argparse.Namespace) -> DecodingSettings:
    """The one decoding record from `--config`, `--mode`, `--draft` and `--draft-len` (checked as it is made)."""
    return DecodingSettings(args.config, args.mode, getattr(args, "draft", None), getattr(args, "draft_len", None))


@dataclass(frozen=True)
class BuildOptions(Options):
    model: str
    output: str
    backends: tuple[str, ...] = ("onnx",)
    onnx_flavour: str = "ort"
    max_len: int = 2048
    force: bool = False
    routers: str | None = None
    calib: str | None = None
    max_configs: int = 3
    router_lambda: float | None = None
    min_config_agreement: float | None = None
    router_lr: float | None = None
    lora: int = 0
    router_threshold: str | None = None
    speculate: str | None = None
    exit_adapter: str = "none"
    draft_head: str = "none"
    quantize: str = "auto"
    draft_precision: str = "none"
    # each draft source's own build option (calibration/drafts/<name>.py BUILD), as (source, value)
    draft_options: tuple[tuple[str, str], ...] = ()
    draft_vocab: int = 0
    coreml_precision: str = "float16"
    trt_precision: str = "fp16"
    quant_block: int = 32
    quant_accuracy: int = 4
    native_form: str = "auto"  # --native-form: auto, packed or nbits (commands/build.py resolve_native_form)
    prompt_rows: str = "measure"  # "measure": calibration/prompt_rows.py on the built engines; "rule": the fixed rule
    seed: int = 0
    revision: str | None = None  # with a Hub id MODEL; `model` is then its snapshot's local path
    gguf_file: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, **converted: Any) -> BuildOptions:
        """A Hub id MODEL is resolved here (cache, else download) to the local path the build reads and records."""
        from adaptive_export.calibration.drafts import BUILD_STEPS
        from adaptive_export.loading.model import resolve_model_argument

        model = resolve_model_argument(args.model, args.revision, args.gguf_file)
        draft_options = tuple((name, getattr(args, step.option.dest)) for name, step in BUILD_STEPS.items())
        options = super().from_args(
            args, backends=parse_backends(args.backend), model=model, draft_options=draft_options
        )
        resolved = tuple((name, BUILD_STEPS[name].resolve(value, options)) for name, value in draft_options)
        return replace(options, draft_options=resolved)


@dataclass(frozen=True)
class RunOptions(Options):
    bundle: str
    prompt: str | None = None
    prompt_file: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    raw: bool = False
    json: bool = False
    decoding: DecodingSettings = DEFAULT_DECODING  # --config, --mode, --draft, --draft-len
    decode_rows: int | None = None  # None: the bundle's min_decode_rows
    draft_bundle: str | None = None  # a smaller bundle with the same tokenizer that drafts (runtimes/draft_model.py)
    backend: str = "onnx"
    provider: str = "cpu"
    threads: int = 0
    verify: str = "full"
    prepack: str = "auto"

    @classmethod
    def from_args(cls, args: argparse.Namespace, **converted: Any) -> RunOptions:
        return super().from_args(args, stop=tuple(args.stop), decoding=decoding_from_args(args))


@dataclass(frozen=True)
class CheckOptions(Options):
    bundle: str
    model: str | None = None
    report: str | None = None
    junit: str | None = None
    prompts: str | None = None
    new_tokens: int = 16
    tolerance: float = 1.0
    expect_precision: str | None = None  # fp32, int8, int4 or gguf: what the engines must be
    provider: str = "cpu"  # ONNX Runtime's execution provider for the engines
    allow_unrebuilt: tuple[str, ...] = ()  # engines accepted without a structural comparison

    @classmethod
    def from_args(cls, args: argparse.Namespace, **converted: Any) -> CheckOptions:
        names = (name.strip() for value in args.allow_unrebuilt or () for name in value.split(","))
        return super().from_args(args, allow_unrebuilt=tuple(name for name in names if name))


@dataclass(frozen=True)
class InspectOptions(Options):
    bundle: str
    json: bool = False


@dataclass(frozen=True)
class BenchOptions(Options):
    bundle: str
    prompt: str
    max_new_tokens: int = 32
    repeat: int = 5
    decoding: DecodingSettings = DEFAULT_DECODING  # --config, --mode
    threads: int = 0
    prepack: str = "auto"
    provider: str = "cpu"
    json: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, **converted: Any) -> BenchOptions:
        return super().from_args(args, decoding=decoding_from_args(args))


@dataclass(frozen=True)
class ServeOptions(Options):
    """`serve`'s own options; the bundle, decoding and engine options are `run`'s, in `run` (its
    prompt and sampling stay at their defaults: each request brings its own)."""

    run: RunOptions
    host: str = "127.0.0.1"
    port: int = 8000
    queue: int = 8
    max_tokens: int = 256
    max_connections: int = 100
    read_timeout: float = 10.0
    allow_origins: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace, **converted: Any) -> ServeOptions:
        shared = {f.name: getattr(args, f.name) for f in fields(RunOptions) if hasattr(args, f.name)}
        run = RunOptions(**shared, decoding=decoding_from_args(args))
        origins = tuple(getattr(args, "allow_origins", None) or ())
        return super().from_args(args, run=run, allow_origins=origins)
