"""Backend registry, exporter side: the compiler of each backend the runtime knows.

Keyed by the runtime's names (runtimes/backends/__init__.py: runtime class and pip extra),
and checked against them at import, so a backend is one entry here and one there. `onnx`
is exported by exporter/build.py itself (every other backend is built from its graphs);
every other compiler runs on the staged bundle after the ONNX export.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptive_export.runtimes.backends import BACKEND_NAMES
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import Manifest

if TYPE_CHECKING:
    from adaptive_export.exporter.build import ExportOptions
    from adaptive_export.graphs.plan import BuildPlan
    from adaptive_export.graphs.span_graph import ModelParts

# (bundle_dir, provisional manifest, parts, plan, options) -> the manifest's entry for the backend (its JSON,
# which build_bundle parses with runtimes.manifest.BackendEntry.from_json)
Compile = Callable[[Path, Manifest, "ModelParts", "BuildPlan", "ExportOptions"], dict[str, Any]]


@dataclass(frozen=True)
class BackendCompiler:
    name: str
    compile: Compile | None  # None: the ONNX export every bundle has
    preflight: Callable[[], None] = lambda: None  # fails fast (before minutes of export) if its tools are missing
    portable_onnx: bool = (
        False  # builds from the ONNX graphs and parses standard ops only: the bundle's ONNX is portable
    )


def _compile_coreml(
    root: Path, manifest: Manifest, parts: ModelParts, plan: BuildPlan, options: ExportOptions
) -> dict[str, Any]:
    from adaptive_export.exporter.coreml_compile import compile_coreml

    return compile_coreml(root, manifest, parts, plan, options.coreml_precision)


def _preflight_coreml() -> None:
    from adaptive_export.exporter.coreml_compile import _import_coremltools

    _import_coremltools()


def _compile_tensorrt(
    root: Path, manifest: Manifest, parts: ModelParts, plan: BuildPlan, options: ExportOptions
) -> dict[str, Any]:
    from adaptive_export.exporter.tensorrt_compile import compile_tensorrt

    return compile_tensorrt(root, manifest, options.trt_precision)


COMPILERS: dict[str, BackendCompiler] = {
    c.name: c
    for c in (
        BackendCompiler("onnx", None),
        BackendCompiler("coreml", _compile_coreml, _preflight_coreml),
        BackendCompiler("tensorrt", _compile_tensorrt, portable_onnx=True),
    )
}
if set(COMPILERS) != set(BACKEND_NAMES):  # pragma: no cover - a registration mistake, caught by any import
    raise RuntimeError(f"exporter backends {sorted(COMPILERS)} differ from the runtime's {sorted(BACKEND_NAMES)}")


def parse_backends(text: str) -> tuple[str, ...]:
    """`--backend onnx,coreml` -> ('onnx', 'coreml'), each known to both registries."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in COMPILERS]
    if not names or unknown:
        raise UsageError(
            f"unknown backend {unknown[0] if unknown else text!r}",
            f"use a comma-separated list of: {', '.join(COMPILERS)}",
        )
    return names


def needs_portable_onnx(backends: tuple[str, ...]) -> bool:
    """Whether a backend of the build forces the portable ONNX flavour."""
    return any(COMPILERS[name].portable_onnx for name in backends)


def preflight(backends: tuple[str, ...]) -> None:
    for name in backends:
        COMPILERS[name].preflight()
