"""What a bundle's engines are (fp32, int8, int4, GGUF-exact), read from the engines themselves.

`check` picks its yardstick from this, never from the manifest's `dtype`: a bundle that declares
itself int4 would otherwise be held only to the int4 quality bar. The manifest's word is compared
with the engines' and a disagreement is a failure (docs/hardening.md, "check as a CI gate").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # onnx is imported where engines are read: the CLI's parser imports PRECISION_CLASSES
    from adaptive_export.runtimes.bundle import Bundle

PRECISION_CLASSES = ("fp32", "int8", "int4", "gguf")  # what `check --expect-precision` accepts
# lower precision first: a bundle whose engines differ is as precise as its least precise engine
_DTYPE_ORDER = ("int4", "int8", "float16", "float32")
_INTEGER_OPS = ("MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "ConvInteger")
_BLOCK_OPS = ("MatMulNBits", "GatherBlockQuantized")  # ONNX Runtime's block-quantized weights
_DRAFT_DTYPES = {"int8": "int8", "int4": "int4", "native4": "int4"}  # a precision draft's declared grid


@dataclass(frozen=True)
class EnginePrecision:
    """One ONNX engine's weights: `dtype` as the manifest names it, `exact` when every
    MatMulNBits / MatMulPacked runs at accuracy level 1 (fp32 activations), `evidence` for the report."""

    dtype: str
    exact: bool
    evidence: str

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "int4")


def _attribute(node: Any, name: str, default: int) -> int:
    from onnx import helper

    for attribute in node.attribute:
        if attribute.name == name:
            return int(helper.get_attribute_value(attribute))
    return default


def engine_precision(model: Any) -> EnginePrecision:
    """Ops and initializer types of one engine, an onnx.ModelProto (external data is not read:
    the types are in the graph)."""
    import onnx

    from adaptive_export.runtimes.packed_ops import GGML_TYPES, PACKED_DOMAIN, PACKED_OPS

    nodes = list(model.graph.node)
    block = [n for n in nodes if n.op_type in _BLOCK_OPS and n.domain != PACKED_DOMAIN]
    # the GGUF's rows as stored (--native-form packed): their grid is the ggml type's
    packed = [n for n in nodes if n.domain == PACKED_DOMAIN and n.op_type in PACKED_OPS]
    integer = [n for n in nodes if n.op_type in _INTEGER_OPS]
    packed_bits = {GGML_TYPES.get(_attribute(n, "packed_type", -1), ("", 0, 0, 4))[3] for n in packed}
    bits = {_attribute(n, "bits", 4) for n in block} | packed_bits | ({8} if integer else set())
    if bits:
        linears = [n for n in block if n.op_type == "MatMulNBits"] + [n for n in packed if n.op_type == "MatMulPacked"]
        accuracy = sorted({_attribute(n, "accuracy_level", 0) for n in linears})
        dtype = "int4" if min(bits) <= 4 else "int8"
        exact = not integer and accuracy == [1]
        rows = f", {len(packed)} of them over GGUF rows" if packed else ""
        evidence = (
            f"{len(block) + len(packed)} block-quantized ops{rows} (bits {', '.join(map(str, sorted(bits)))}; "
            f"accuracy level {', '.join(map(str, accuracy)) or '-'}), {len(integer)} integer ops"
        )
        return EnginePrecision(dtype, exact, evidence)
    floats = [i for i in model.graph.initializer if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    half = sum(i.data_type == onnx.TensorProto.FLOAT16 for i in floats)
    dtype = "float16" if half * 2 > len(floats) else "float32"
    return EnginePrecision(dtype, False, f"no quantized ops, {len(floats) - half} fp32 and {half} fp16 initializers")


@dataclass(frozen=True)
class BundlePrecision:
    """The onnx engines of a bundle: the main engines' least precise `dtype`, whether they are
    GGUF-exact, and each engine's own precision (precision drafts included)."""

    dtype: str
    exact: bool
    engines: Mapping[str, EnginePrecision]

    @property
    def precision_class(self) -> str:
        """fp32, int8, int4 or gguf, as `--expect-precision` names them (fp16 for half-precision engines)."""
        if self.exact:
            return "gguf"
        return {"float32": "fp32", "float16": "fp16"}.get(self.dtype, self.dtype)

    @property
    def gated_on_quality(self) -> bool:
        """Quantized weights cannot match fp32 logits: the quality bar gates them, unless GGUF-exact."""
        return self.dtype in ("int8", "int4") and not self.exact

    def informational(self, graph: str) -> bool:
        """Whether `graph`'s parity is informational: its own engine holds quantized weights that
        are not the reference's (a GGUF-exact engine is held to fp32 tolerances)."""
        engine = self.engines.get(graph)
        if engine is None:
            return self.gated_on_quality
        return engine.quantized and not (engine.exact and self.exact)


def bundle_precision(bundle: Bundle) -> BundlePrecision:
    """Read every onnx engine once (policy-checked bytes, graphs sharing a file read once)."""
    import onnx

    from adaptive_export.runtimes.graph_policy import checked_engine_bytes

    entry = bundle.manifest.backends.get("onnx")
    if entry is None:
        return BundlePrecision("float32", False, {})
    by_file: dict[str, EnginePrecision] = {}
    engines: dict[str, EnginePrecision] = {}
    for graph, engine in entry.graphs.items():
        key = engine.file or graph
        if key not in by_file:
            by_file[key] = engine_precision(onnx.load_from_string(checked_engine_bytes(bundle, graph)))
        engines[graph] = by_file[key]
    main = [p for g, p in engines.items() if bundle.graph(g).precision is None] or list(engines.values())
    dtype = min((p.dtype for p in main), key=_DTYPE_ORDER.index, default="float32")
    quantized = [p for p in main if p.quantized]
    # the manifest's `native` can only make the gate stricter: it is believed only where the engines agree
    exact = bool(quantized) and all(p.exact for p in quantized) and entry.quantize == "native"
    return BundlePrecision(dtype, exact, engines)


def precision_problems(bundle: Bundle, precision: BundlePrecision, expected: str | None) -> list[str]:
    """Where the manifest, or the user's `--expect-precision`, disagrees with the engines."""
    if not precision.engines:  # every build writes onnx engines; without them nothing says what the weights are
        return ["the bundle has no onnx engines, so what its engines are cannot be read (every build writes them)"]
    problems = []
    if bundle.manifest.dtype != precision.dtype:
        main = next(
            (
                p
                for g, p in precision.engines.items()
                if bundle.graph(g).precision is None and p.dtype == precision.dtype
            ),
            None,
        )
        evidence = f" ({main.evidence})" if main else ""
        problems.append(
            f"the manifest declares dtype {bundle.manifest.dtype} but the engines hold {precision.dtype} weights"
            f"{evidence}"
        )
    for graph, engine in sorted(precision.engines.items()):
        declared = bundle.graph(graph).precision
        if declared is not None and _DRAFT_DTYPES.get(declared) != engine.dtype:
            problems.append(
                f"graph {graph} declares a {declared} precision draft but its engine holds {engine.dtype} weights "
                f"({engine.evidence})"
            )
    if expected is not None and expected != precision.precision_class:
        problems.append(f"--expect-precision {expected}, but the engines are {precision.precision_class}")
    return problems
