"""The precision draft's calibration: measured on the staged engines, priced by their latencies.
Its VocabTrim head (calibration/draft_vocab.py) is a feature of this source, not a source."""

from __future__ import annotations

from typing import Any

from adaptive_export.calibration.draft_sources import Candidate, MeasuredElsewhere, latency_candidate
from adaptive_export.runtimes.errors import UsageError


class PrecisionMeasure(MeasuredElsewhere):
    """Precision drafts (runtimes/drafting/precision.py) cannot be simulated on the PyTorch
    model: what differs from the verifier is exactly the engines' quantized weights and
    activations. Their acceptance is measured by running the staged engines
    (calibration/latency.py measure_precision_acceptance) into measured["precision"]."""

    name = "precision"

    @staticmethod
    def cost_candidates(measured: dict[str, Any], layers: int, head: float, adapter: float) -> list[Candidate]:
        return []  # no engines yet, so no acceptance: decided once they are built

    @staticmethod
    def latency_candidates(
        measured: dict[str, Any], latencies: dict[str, Any], exit_layer: int | None
    ) -> list[Candidate]:
        """k precision-draft calls plus one decode pass at T = k + 1 (drafts plus the bonus position)."""
        if "precision_draft_ms" not in latencies:
            return []
        step, out = latencies["decode_ms"][1], []
        for k_text, measured_k in (measured.get("precision") or {}).get("per_k", {}).items():
            k = int(k_text)
            if k + 1 not in latencies["decode_ms"]:
                continue
            round_ms = k * latencies["precision_draft_ms"] + latencies["decode_ms"][k + 1]
            tokens, acceptance = measured_k["tokens_per_round"], measured_k["acceptance"]
            fields = {"source": "precision", "draft_len": k, "tokens_per_round": tokens, "acceptance": acceptance}
            out.append(latency_candidate(fields, round_ms, step))
        return out


def check_draft_precision(options: Any, quantize: str) -> None:
    """`--draft-precision` needs ONNX Runtime's fused engines (MatMulNBits) and a cheaper grid."""
    choice = options.draft_precision or "none"
    if choice == "none":
        return
    if options.onnx_flavour != "ort" or set(options.backends) != {"onnx"}:
        raise UsageError(
            f"--draft-precision {choice} builds an ONNX Runtime engine (MatMulNBits, fused flavour), "
            f"which --backend {','.join(options.backends)} --onnx-flavour {options.onnx_flavour} does not run",
            "build it with --backend onnx and the default --onnx-flavour ort",
        )
    cheaper = {"none": ("int8", "int4"), "int8": ("int4",), "native": ("native4",)}
    if choice not in cheaper.get(quantize, ()):
        raise UsageError(
            f"--draft-precision {choice} is not a cheaper precision of this --quantize {quantize} bundle",
            "use int8 or int4 on a float bundle, int4 on an int8 one, native4 on a GGUF-exact (--quantize native) one",
        )
    if choice == "native4" and options.quant_accuracy == 4:
        raise UsageError(
            "--draft-precision native4 would draft at the precision the bundle already runs (accuracy 4)",
            "build with --quant-accuracy 1 (the exact engines) to draft at accuracy 4",
        )


def check_draft_vocab_option(size: int, precision_asked: bool) -> None:
    """`--draft-vocab N` trims a precision draft's head, so it needs one."""
    if size and not precision_asked:
        raise UsageError(
            f"--draft-vocab {size} trims the precision draft's LM head, and this build has no precision draft",
            "add --draft-precision (int8/int4 on a float bundle, native4 on a GGUF-exact one), or drop --draft-vocab",
        )


def precision_asked(options: Any) -> bool:
    """Whether the build asks for a precision draft (`--draft-precision`, `none` or empty: not)."""
    return (options.draft_precision or "none") != "none"


def check_options(options: Any, quantize: str) -> None:
    """The build options that shape the precision draft (commands/options.py BuildOptions),
    checked before minutes of loading; `quantize` is the bundle's resolved precision."""
    check_draft_precision(options, quantize)
    check_draft_vocab_option(options.draft_vocab, precision_asked(options))


MEASURE = PrecisionMeasure
