"""`build`: load, calibrate what was asked, plan, export, write.

The one place that joins calibration (routers, speculation) and the exporter: each gets its
own typed options from the command's BuildOptions.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from adaptive_export.calibration.draft_builds import SourceBuild
from adaptive_export.calibration.drafts.precision import precision_asked
from adaptive_export.calibration.router_pipeline import THRESHOLD, RouterOptions
from adaptive_export.calibration.speculation import SpeculationOptions
from adaptive_export.commands import EXIT_OK
from adaptive_export.commands.options import BuildOptions
from adaptive_export.exporter.backends import needs_portable_onnx, preflight
from adaptive_export.exporter.build import ExportOptions, build_bundle
from adaptive_export.exporter.bundle_writer import check_output_dir
from adaptive_export.exporter.tokenizer_export import chat_format
from adaptive_export.graphs.drafts.early_exit import NAME as EXIT
from adaptive_export.graphs.drafts.precision import NAME as PRECISION
from adaptive_export.graphs.plan import BuildPlan
from adaptive_export.graphs.span_graph import ModelParts
from adaptive_export.loading.gguf_header import read_gguf_header
from adaptive_export.loading.lean_model import draft_vocab_rows, load_lean_model
from adaptive_export.loading.memory_plan import BuildPath, build_need, ensure_fits
from adaptive_export.loading.model import check_model_files, load_model, model_fields
from adaptive_export.loading.model_checks import SIZING_KEYS
from adaptive_export.loading.packaged import PACKAGED
from adaptive_export.loading.prompts import read_prompts
from adaptive_export.loading.warning_filters import third_party_warnings_hidden
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import Manifest

LEAN_QUANTIZE = ("native", "none")  # the precisions whose weights the lean build writes tensor by tensor


def quantized_gguf(model: str) -> Path | None:
    """The model's .gguf file when it holds quantized tensors (its own grid to keep), else None.
    Read from the checked header: gguf's reader would parse the whole vocabulary (19 s on Gemma 3)."""
    directory, gguf_file = check_model_files(model)
    if gguf_file is None:
        return None
    path = directory / gguf_file
    return path if read_gguf_header(path).has_quantized_tensors() else None


def resolve_quantize(choice: str, model: str, backends: tuple[str, ...], flavour: str) -> tuple[str, Path | None]:
    """`auto` keeps a quantized GGUF's own grid (native) where the fused engines run, else fp32."""
    portable = flavour == "portable" or needs_portable_onnx(backends)
    if choice not in ("auto", "native"):
        return choice, None
    source = quantized_gguf(model)
    if choice == "auto":
        return ("native", source) if source is not None and not portable else ("none", None)
    if source is None:
        raise UsageError(
            f"--quantize native needs a quantized .gguf model, and {model!r} is not one",
            "use --quantize int8 or int4 to quantize float weights, or none",
        )
    if portable:
        raise UsageError(
            "--quantize native needs the fused ONNX Runtime engines (--onnx-flavour ort, no tensorrt backend)",
            "drop --onnx-flavour portable / --backend tensorrt, or use --quantize none",
        )
    return "native", source


# Bits a weight takes in MatMulNBits' form of each GGUF type (exporter/gguf_native.py): codes at 4 or
# 8 bits, an fp32 scale per block of 32 (16 for Q6_K), and an fp32 correction per 32 for formats
# with mins. The packed form reads the GGUF's own bits (its block bytes).
NBITS_BITS = {"Q4_0": 5.0, "Q4_1": 6.0, "Q4_K": 6.0, "Q5_0": 9.0, "Q8_0": 9.0, "Q5_K": 10.0, "Q6_K": 10.0}
# auto picks packed where its rows are at most this share of MatMulNBits' bytes: a decode step
# streams its weights, so that is where the kernels' smaller reads pay. Measured on a 2-core Xeon
# (AVX-512 VNNI), 2026-12-02: Qwen2.5-Coder 1.5B/0.5B (0.71/0.70 of the bytes) decode at 0.80/0.90x
# MatMulNBits' step; SmolLM2's Q4_1 (0.86) at 1.12x, where ONNX Runtime's kernels compute faster.
AUTO_PACKED_BYTES = 0.8


def packed_share(tensors: list[tuple[str, int]]) -> float:
    """Bytes of the packed rows over MatMulNBits' bytes for (type, elements) of the quantized tensors."""
    from adaptive_export.runtimes.packed_ops import GGML_TYPES, TYPE_IDS

    packed = sum(n * GGML_TYPES[TYPE_IDS[t]][2] / GGML_TYPES[TYPE_IDS[t]][1] for t, n in tensors)
    nbits = sum(n * NBITS_BITS[t] / 8 for t, n in tensors)
    return packed / nbits if nbits else 1.0


def resolve_native_form(requested: str, library_available: bool, tensors: list[tuple[str, int]]) -> str:
    """The weight form of a `--quantize native` bundle: "packed" (the GGUF's rows as stored, read by
    this package's MatMulPacked/GatherPacked) or "nbits" (ONNX Runtime's MatMulNBits).

    An explicit choice is kept, or refused in one line when it cannot be built: packed needs the
    compiled op library and GGUF types the kernels read (`tensors`: (type, elements) of the file's
    quantized tensors). `auto` chooses packed where its rows are at most AUTO_PACKED_BYTES of
    MatMulNBits' bytes (K-quant files such as Q4_K_M), nbits otherwise, and nbits whenever the
    library is missing or a type is unread (Q5_1): both forms compute the same model, and auto
    never fails."""
    from adaptive_export.runtimes.packed_ops import TYPE_IDS, missing_library_error

    unread = sorted({t for t, _ in tensors if t not in TYPE_IDS})
    if requested == "packed":
        if not library_available:
            raise missing_library_error()
        if unread:
            raise UsageError(
                f"--native-form packed reads the GGUF's rows with this package's kernels, which do not read "
                f"{unread[0]} (they read {', '.join(TYPE_IDS)})",
                "build with --native-form nbits (or auto), which converts it to MatMulNBits",
            )
        return "packed"
    if requested == "auto":
        fits = library_available and not unread and bool(tensors)
        return "packed" if fits and packed_share(tensors) <= AUTO_PACKED_BYTES else "nbits"
    if requested != "nbits":
        raise UsageError(f"--native-form {requested!r} is unknown", "choose auto, packed or nbits")
    return "nbits"


def check_native_form(options: BuildOptions, quantize: str, native_source: Path | None) -> str:
    """The bundle's weight form ("nbits" unless --quantize native), the packed form's needs
    checked before minutes of loading: quantize native, accuracy 1 or 4, the op library."""
    from adaptive_export.runtimes.packed_ops import ACCURACY_LEVELS, library_path

    if options.native_form == "packed" and quantize != "native":
        raise UsageError(
            f"--native-form packed keeps a quantized GGUF's rows, and this build's weights are --quantize {quantize}",
            "add --quantize native (a quantized .gguf model), or drop --native-form",
        )
    if quantize != "native":
        return "nbits"
    if options.native_form == "packed" and options.quant_accuracy not in ACCURACY_LEVELS:
        raise UsageError(
            f"--native-form packed runs at accuracy level 1 or 4, not {options.quant_accuracy}",
            "use --quant-accuracy 1 (fp32 activations, exact) or 4 (int8 activations)",
        )
    tensors: list[tuple[str, int]] = []
    if native_source is not None:
        import gguf

        floats = ("F32", "F16", "BF16", "F64")
        for tensor in read_gguf_header(native_source).tensors:
            kind = gguf.GGMLQuantizationType(tensor.kind).name
            if kind not in floats:
                tensors.append((kind, math.prod(tensor.dims)))
    return resolve_native_form(options.native_form, library_path() is not None, tensors)


def check_draft_options(options: BuildOptions) -> tuple[tuple[str, str], ...]:
    """The draft sources asked for by their own build options (calibration/drafts/<name>.py BUILD),
    as (source, value), each value checked before minutes of loading."""
    from adaptive_export.calibration.drafts import BUILD_STEPS

    asked = tuple((name, value) for name, value in options.draft_options if BUILD_STEPS[name].asked(value))
    for name, value in asked:
        BUILD_STEPS[name].check(value)
    return asked


def check_source_options(options: BuildOptions, quantize: str) -> None:
    """Each draft source's own checks of the options that shape it (calibration/drafts/<name>.py
    `check_options`), before minutes of loading."""
    from adaptive_export.calibration.drafts import OPTION_CHECKS

    for check in OPTION_CHECKS.values():
        check(options, quantize)


@dataclass(frozen=True)
class CheckedBuild:
    """What the fast checks decided, before minutes of loading and export."""

    output: Path
    quantize: str
    native_source: Path | None
    draft_precision: str | None
    draft_builds: tuple[tuple[str, str], ...]  # (source, option value) of the sources asked for by their option
    native_form: str = "nbits"  # a native bundle's weight form (resolve_native_form)


@dataclass
class Calibrated:
    """What the calibration steps add to the export, filled in step by step: the plan, the
    manifest's `speculation`, calibration.json's entries and the files beside the graphs."""

    plan: BuildPlan
    speculation: dict[str, Any] | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    extra_files: dict[str, bytes] = field(default_factory=dict)
    router_threshold: float = THRESHOLD  # the routers' cut, calibrated with --router-threshold auto
    built: list[SourceBuild] = field(default_factory=list)  # the draft sources made by their own option


def check_build_options(options: BuildOptions) -> CheckedBuild:
    """Every check that needs no model, so a bad option fails in a second, not after the loading."""
    draft_builds = check_draft_options(options)
    preflight(options.backends)  # a backend whose tools are missing fails before any work
    output = Path(options.output)
    protect = tuple(
        Path(p)
        for p in (
            options.model,
            options.calib,
            options.routers,
            options.exit_adapter,
            options.draft_head,
            *(value for _, value in draft_builds),
        )
        if p and p not in (*PACKAGED, "train", "fit", "none")
    )
    check_output_dir(output, options.force, protect)  # fail fast, before minutes of loading and export
    quantize, native_source = resolve_quantize(options.quantize, options.model, options.backends, options.onnx_flavour)
    if quantize != "none":
        from adaptive_export.exporter.quantize import validate_options

        validate_options(options.quant_block, options.quant_accuracy)  # before minutes of loading and export
    native_form = check_native_form(options, quantize, native_source)
    if (options.lora or options.router_threshold) and not options.routers:
        asked = f"--lora {options.lora}" if options.lora else f"--router-threshold {options.router_threshold}"
        raise UsageError(
            f"{asked} calibrates skip configurations, and this build has no routers",
            f"add --routers train (or a routers file), or drop {asked.split()[0]}",
        )
    if options.calib and (options.routers or options.speculate or draft_builds or options.draft_vocab):
        read_prompts(options.calib)  # a bad calibration file fails before minutes of loading
    check_source_options(options, quantize)
    draft_precision = options.draft_precision if precision_asked(options) else None
    return CheckedBuild(output, quantize, native_source, draft_precision, draft_builds, native_form)


def calibrate_routers(options: BuildOptions, loaded: Any, parts: ModelParts, state: Calibrated) -> None:
    """`--routers`: train or load the routers, keep the skip configurations that agree enough."""
    from adaptive_export.calibration.router_pipeline import plan_routers

    # RouterOptions' fields are build options of the same names
    router_options = RouterOptions(**{f.name: getattr(options, f.name) for f in fields(RouterOptions)})
    planned = plan_routers(router_options, loaded)
    parts.routers, parts.skip_adapters = planned.routers, planned.skip_adapters
    state.router_threshold = planned.threshold
    state.calibration["routers"] = planned.report
    state.extra_files = {**state.extra_files, **planned.files}
    state.plan = BuildPlan(
        num_layers=loaded.spec.num_layers, configs=planned.configs, routers=True, drafts=state.plan.drafts
    )
    state.calibration["configs"] = state.calibration["routers"].pop("configs")


def calibrate_draft_vocab(options: BuildOptions, loaded: Any, parts: ModelParts, state: Calibrated) -> None:
    """`--draft-vocab N`: the N token ids the precision draft's head scores."""
    from adaptive_export.calibration.draft_vocab import plan_draft_vocab
    from adaptive_export.calibration.measure import calibration_prompts

    parts.draft_vocab, state.calibration["draft_vocab"] = plan_draft_vocab(
        loaded, calibration_prompts(options.calib), options.draft_vocab
    )
    state.plan.draft_vocab = options.draft_vocab


def calibrate_draft_builds(
    options: BuildOptions, checked: CheckedBuild, loaded: Any, parts: ModelParts, state: Calibrated
) -> None:
    """Each draft source asked for by its own option: train (or load) what it drafts with; they
    draft unless --speculate chooses."""
    from adaptive_export.calibration.drafts import BUILD_STEPS
    from adaptive_export.calibration.measure import calibration_prompts

    for name, value in checked.draft_builds:
        built = BUILD_STEPS[name].build(value, loaded, calibration_prompts(options.calib), options.seed)
        parts.draft_tables[name] = built.table
        if built.draft_vocab is not None:  # the bundle's one draft vocabulary (the source's check_options saw to it)
            parts.draft_vocab, state.plan.draft_vocab = built.draft_vocab, int(built.draft_vocab.numel())
        state.plan.draft_fields.update(built.draft_fields)
        state.extra_files = {**state.extra_files, **built.files}
        state.built.append(built)
    state.speculation = {
        "source": None,
        "auto_enabled": False,
        **{built.name: built.section for built in state.built},
        "chosen_by": ", ".join(built.chosen_by for built in state.built),
    }
    state.calibration["speculation"] = {built.name: built.rounds for built in state.built}


def calibrate_speculation(options: BuildOptions, loaded: Any, parts: ModelParts, state: Calibrated) -> None:
    """`--speculate auto|E:k`: the exit layer, draft length and exit adapter."""
    from adaptive_export.calibration.speculation import plan_speculation

    speculation_options = SpeculationOptions(
        options.speculate, exit_adapter=options.exit_adapter, calib=options.calib, seed=options.seed
    )
    state.plan.drafts[EXIT], state.speculation, measured, adapter_files = plan_speculation(
        speculation_options, loaded, parts, state.built
    )
    state.calibration.update(measured)
    state.extra_files = {**state.extra_files, **adapter_files}


def calibrate_draft_head(options: BuildOptions, loaded: Any, parts: ModelParts, state: Calibrated) -> None:
    """`--speculate ... --draft-head train|FILE`: the trained exit block, its trimmed head and stop threshold."""
    from adaptive_export.calibration.draft_head import plan_draft_head
    from adaptive_export.calibration.speculation import keep_built_sections

    assert options.speculate is not None  # checked with the options
    exit_plan, speculation, measured, files = plan_draft_head(options.draft_head, options.speculate, loaded, parts)
    state.plan.drafts[EXIT] = exit_plan
    state.plan.draft_vocab = exit_plan.draft_vocab  # the bundle's draft_vocab.bin holds the head's ids
    keep_built_sections(state.built, speculation, measured["speculation"])  # sources built by their own option
    state.speculation = speculation
    state.calibration.update(measured)
    state.extra_files = {**state.extra_files, **files}


def after_export_hook(
    options: BuildOptions, draft_precision: str | None, calibration: dict[str, Any]
) -> Callable[[Path, dict[str, Any]], None] | None:
    """What times the staged engines before the bundle is final (exporter's after_export): with
    `--speculate auto` the speculation choice (a trained draft head's is its own held-out
    measurement), else, unless `--prompt-rows rule`, the rows each kind of prompt decodes on."""
    if options.speculate == "auto" and (options.draft_head or "none") == "none":
        return speculation_hook(options, draft_precision, calibration)
    if not options.speculate and options.prompt_rows == "measure":
        return prompt_rows_hook
    return None


def speculation_hook(
    options: BuildOptions, draft_precision: str | None, calibration: dict[str, Any]
) -> Callable[[Path, dict[str, Any]], None]:
    from adaptive_export.calibration.measure import calibration_prompts
    from adaptive_export.calibration.speculation import finalize_with_latencies

    # a precision draft's acceptance is measured on its built engines, over these prompts
    prompts = calibration_prompts(options.calib) if draft_precision else None

    def after_export(root: Path, manifest: dict[str, Any]) -> None:
        finalize_with_latencies(root, manifest, calibration, prompts)

    return after_export


def prompt_rows_hook(root: Path, manifest: dict[str, Any]) -> None:
    """The manifest's `prompt_rows`, measured on the staged engines (calibration/prompt_rows.py)."""
    from adaptive_export.calibration.prompt_rows import calibrate_prompt_rows

    choice = calibrate_prompt_rows(root)
    manifest["prompt_rows"] = choice.to_json()
    shown = ", ".join(
        f"{c.kind} {c.rows} ({c.decoder}; growing {c.growing_cost:.2f}, floor {c.floor_cost:.2f} steps/token)"
        for c in choice.choices
    )
    print(f"decode rows per prompt kind: {shown}")


def export_options(options: BuildOptions, checked: CheckedBuild, state: Calibrated) -> ExportOptions:
    """The exporter's typed options: the command's choices joined with what calibration decided."""
    return ExportOptions(
        speculation=state.speculation,
        calibration=state.calibration or None,
        extra_files=state.extra_files,
        router_threshold=state.router_threshold,
        output=checked.output,
        backends=options.backends,
        max_len=options.max_len,
        force=options.force,
        quantize=checked.quantize,
        onnx_flavour=options.onnx_flavour,
        native_source=checked.native_source,
        after_export=after_export_hook(options, checked.draft_precision, state.calibration),
        coreml_precision=options.coreml_precision,
        trt_precision=options.trt_precision,
        quant_options={
            "block_size": options.quant_block,
            "accuracy_level": options.quant_accuracy,
            **({"native_form": "packed"} if checked.native_form == "packed" else {}),  # default manifests unchanged
        }
        if checked.quantize != "none"
        else {},
    )


def builds_lean(options: BuildOptions, checked: CheckedBuild) -> bool:
    """Whether the build only exports (nothing trains or measures on the torch model) and its
    export streams: then the model's weights are never loaded whole (exporter/lean_export.py)."""
    from adaptive_export.calibration.drafts import BUILD_STEPS

    trains = any(BUILD_STEPS[name].trains(value) for name, value in checked.draft_builds)
    calibrates = options.routers or options.speculate or trains
    return not calibrates and exports_streamed(options, checked)


def exports_streamed(options: BuildOptions, checked: CheckedBuild) -> bool:
    """Whether the export can stream the weights from a .gguf into ONNX Runtime engines, whatever
    calibration trained first: routers and skip/exit adapters are small real tensors the lean
    trace embeds. Re-quantization (int8/int4), precision drafts, draft vocabularies and draft heads
    read the float weights (a draft source built by its own option says whether it does), and
    CoreML/TensorRT read them all."""
    from adaptive_export.calibration.drafts import BUILD_STEPS

    reads_floats = (
        checked.draft_precision is not None
        or bool(options.draft_vocab)
        or not all(BUILD_STEPS[name].streams(value) for name, value in checked.draft_builds)
        or (options.draft_head or "none") != "none"
    )
    _, gguf_file = check_model_files(options.model)
    streams = options.backends == ("onnx",) and checked.quantize in LEAN_QUANTIZE
    return not reads_floats and streams and gguf_file is not None


def ensure_build_fits(options: BuildOptions, path: BuildPath) -> None:
    """The build's peak memory from the model's dimensions, refused before any work if it cannot fit."""
    fields = model_fields(options.model)
    if all(fields.get(key) is not None for key in SIZING_KEYS):  # a partial config: transformers' defaults
        ensure_fits(build_need(fields, path))


def build_path(options: BuildOptions, checked: CheckedBuild) -> BuildPath:
    """ "stream" (export only, streamed), "calibrate" (the fp32 model for calibration, then a
    streamed export) or "full" (the fp32 model throughout): loading/memory_plan.py's paths."""
    if builds_lean(options, checked):
        return "stream"
    return "calibrate" if exports_streamed(options, checked) else "full"


def run_build(options: BuildOptions) -> Manifest:
    checked = check_build_options(options)
    path = build_path(options, checked)
    ensure_build_fits(options, path)
    loaded = load_lean_model(options.model) if path == "stream" else load_model(options.model)
    chat_format(
        loaded.tokenizer
    )  # the model's own template, rendered bounded: a hostile one fails here, not after export
    parts = ModelParts(loaded.hf_model, loaded.spec)
    drafts = {PRECISION: checked.draft_precision} if checked.draft_precision else {}
    state = Calibrated(BuildPlan(num_layers=loaded.spec.num_layers, drafts=drafts))
    if options.routers:
        calibrate_routers(options, loaded, parts, state)
    if options.draft_vocab:
        calibrate_draft_vocab(options, loaded, parts, state)
    if checked.draft_builds:
        calibrate_draft_builds(options, checked, loaded, parts, state)
    if options.speculate and (options.draft_head or "none") != "none":
        calibrate_draft_head(options, loaded, parts, state)
    elif options.speculate:
        calibrate_speculation(options, loaded, parts, state)
    if path == "calibrate":  # what calibration trained is kept; the fp32 model goes before the export
        trained = {
            "routers": parts.routers,
            "exit_adapters": parts.exit_adapters,
            "skip_adapters": parts.skip_adapters,
            "draft_tables": parts.draft_tables,
            "draft_vocab": parts.draft_vocab,
        }
        del loaded, parts
        gc.collect()
        loaded = load_lean_model(options.model)
        parts = ModelParts(loaded.hf_model, loaded.spec, **trained)
    if path != "full" and parts.draft_vocab is not None:  # the fake LM head cannot be indexed: its rows from the file
        parts.draft_heads[int(parts.draft_vocab.numel())] = draft_vocab_rows(loaded, parts.draft_vocab)
    return build_bundle(loaded, state.plan, export_options(options, checked, state), parts)


def cmd_build(options: BuildOptions) -> int:
    with third_party_warnings_hidden():  # a build's log shows its progress, not the libraries' deprecations
        manifest = run_build(options)
    onnx_entry = manifest.backends["onnx"]
    print(
        f"wrote {options.output}: {len(manifest.graphs)} graphs, {len(manifest.configs)} configurations, "
        f"weights {onnx_entry.weight_bytes / 1e6:.1f} MB stored once"
    )
    return EXIT_OK
