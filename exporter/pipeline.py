"""`build` from parsed CLI arguments: load, calibrate what was asked, plan, export, write."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from exporter.build import EXTRA_BACKENDS, SUPPORTED_BACKENDS, BuildOptions, build_bundle
from exporter.bundle_writer import check_output_dir
from exporter.model_loading import load_model, resolve_model_path
from graphs.plan import BuildPlan
from graphs.span_graph import ModelParts
from calibration.router_pipeline import THRESHOLD
from runtimes.errors import UsageError


def parse_backends(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in SUPPORTED_BACKENDS]
    if not names or unknown:
        raise UsageError(f"unknown backend {unknown[0] if unknown else text!r}", f"use a comma-separated list of: {', '.join(SUPPORTED_BACKENDS)}")
    return names


def register_backends(backends: tuple[str, ...], args: argparse.Namespace) -> None:
    """Hook the non-ONNX compilers into the build; fail before any work if their tools are missing."""
    if "coreml" in backends:
        from exporter.coreml_compile import _import_coremltools, compile_coreml

        _import_coremltools()
        EXTRA_BACKENDS["coreml"] = lambda root, manifest, parts, plan: compile_coreml(root, manifest, parts, plan, args.coreml_precision)
    if "tensorrt" in backends:
        from exporter.tensorrt_compile import compile_tensorrt

        EXTRA_BACKENDS["tensorrt"] = lambda root, manifest, parts, plan: compile_tensorrt(root, manifest, args.trt_precision)


def check_exit_adapter_option(args: argparse.Namespace) -> None:
    """`--exit-adapter none|fit|FILE` needs --speculate; a missing FILE fails before minutes of loading."""
    option = getattr(args, "exit_adapter", "none") or "none"
    if option == "none":
        return
    if not args.speculate:
        raise UsageError(f"--exit-adapter {option} needs --speculate (the adapter belongs to the early-exit draft)",
                         "add --speculate auto, or --speculate E:k")
    if option != "fit" and not Path(option).is_file():
        raise UsageError(f"exit adapter file {option!r} does not exist",
                         "pass --exit-adapter fit, or an exit_adapters.safetensors file written by a previous build")


def quantized_gguf(model: str) -> Path | None:
    """The model's .gguf file when it holds quantized tensors (its own grid to keep), else None."""
    directory, gguf_file = resolve_model_path(model)
    if gguf_file is None:
        return None
    import gguf

    path = directory / gguf_file
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read GGUF file {str(path)!r}: {exc}", "pass a complete .gguf file") from exc
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    return path if any(t.tensor_type not in floats for t in reader.tensors) else None


def resolve_quantize(choice: str, model: str, backends: tuple[str, ...], flavour: str) -> tuple[str, Path | None]:
    """`auto` keeps a quantized GGUF's own grid (native) where the fused engines run, else fp32."""
    portable = flavour == "portable" or "tensorrt" in backends
    if choice not in ("auto", "native"):
        return choice, None
    source = quantized_gguf(model)
    if choice == "auto":
        return ("native", source) if source is not None and not portable else ("none", None)
    if source is None:
        raise UsageError(f"--quantize native needs a quantized .gguf model, and {model!r} is not one",
                         "use --quantize int8 or int4 to quantize float weights, or none")
    if portable:
        raise UsageError("--quantize native needs the fused ONNX Runtime engines (--onnx-flavour ort, no tensorrt backend)",
                         "drop --onnx-flavour portable / --backend tensorrt, or use --quantize none")
    return "native", source


def check_draft_precision(args: argparse.Namespace, backends: tuple[str, ...]) -> str | None:
    """`--draft-precision` needs ONNX Runtime's fused engines (MatMulNBits) and a cheaper grid."""
    choice = getattr(args, "draft_precision", "none") or "none"
    if choice == "none":
        return None
    if getattr(args, "onnx_flavour", "ort") != "ort" or set(backends) != {"onnx"}:
        raise UsageError(f"--draft-precision {choice} builds an ONNX Runtime engine (MatMulNBits), not a {'/'.join(backends)} one",
                         "build it with --backend onnx and the default --onnx-flavour ort")
    cheaper = {"none": ("int8", "int4"), "int8": ("int4",), "native": ("native4",)}
    if choice not in cheaper.get(args.quantize, ()):
        raise UsageError(f"--draft-precision {choice} is not a cheaper precision of this --quantize {args.quantize} bundle",
                         "use int8 or int4 on a float bundle, int4 on an int8 one, native4 on a GGUF-exact (--quantize native) one")
    if choice == "native4" and args.quant_accuracy == 4:
        raise UsageError("--draft-precision native4 would draft at the precision the bundle already runs (accuracy 4)",
                         "build with --quant-accuracy 1 (the exact engines) to draft at accuracy 4")
    return choice


def run_build(args: argparse.Namespace) -> dict[str, Any]:
    backends = parse_backends(args.backend)
    check_exit_adapter_option(args)
    register_backends(backends, args)
    output = Path(args.output)
    protect = tuple(Path(p) for p in (args.model, getattr(args, "calib", None), getattr(args, "routers", None),
                                       getattr(args, "exit_adapter", None)) if p and p not in ("smollm2", "train", "fit", "none"))
    check_output_dir(output, args.force, protect)  # fail fast, before minutes of loading and export
    args.quantize, native_source = resolve_quantize(args.quantize, args.model, backends, getattr(args, "onnx_flavour", "ort"))
    if args.quantize != "none":
        from exporter.quantize import validate_options

        validate_options(args.quant_block, args.quant_accuracy)  # before minutes of loading and export
    if getattr(args, "calib", None) and (args.routers or args.speculate):
        from exporter.cli import read_prompts

        read_prompts(args.calib)  # a bad calibration file fails before minutes of loading
    draft_precision = check_draft_precision(args, backends)
    loaded = load_model(args.model)
    parts = ModelParts(loaded.hf_model, loaded.spec)
    plan = BuildPlan(num_layers=loaded.spec.num_layers, precision_draft=draft_precision)
    speculation, calibration, extra_files = None, {}, {}
    if args.routers:
        from calibration.router_pipeline import plan_routers

        parts.routers, configs, calibration["routers"], extra_files = plan_routers(args, loaded)
        plan = BuildPlan(num_layers=loaded.spec.num_layers, configs=configs, routers=True, precision_draft=draft_precision)
        calibration["configs"] = calibration["routers"].pop("configs")
    if args.speculate:
        from calibration.speculation import plan_speculation

        plan.exit, speculation, measured, adapter_files = plan_speculation(args.speculate, loaded, parts, args)
        calibration.update(measured)
        extra_files = {**extra_files, **adapter_files}
    after_export = None
    if args.speculate == "auto":
        from calibration.speculation import finalize_with_latencies

        from calibration.measure import calibration_prompts

        prompts = calibration_prompts(getattr(args, "calib", None)) if draft_precision else None

        def after_export(root: Path, manifest: dict[str, Any]) -> None:
            finalize_with_latencies(root, manifest, calibration, prompts)
    options = BuildOptions(speculation=speculation, calibration=calibration or None, extra_files=extra_files,
                           router_threshold=THRESHOLD if args.routers else 0.5, output=output, backends=backends, max_len=args.max_len,
                           force=args.force, quantize=args.quantize, onnx_flavour=getattr(args, "onnx_flavour", "ort"), native_source=native_source, after_export=after_export,
                           quant_options={"block_size": args.quant_block, "accuracy_level": args.quant_accuracy} if args.quantize != "none" else {})
    return build_bundle(loaded, plan, options, parts)
