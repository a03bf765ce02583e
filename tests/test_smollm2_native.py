"""GGUF-exact bundles of the real SmolLM2 (Q4_1 linears, Q8_0 tied embedding): the file's own
blocks in the engines, bit for bit, and at accuracy level 1 the same tokens as HF fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_export.commands.cli import main
from tests.conftest import build_smollm2, needs_smollm2

pytestmark = [needs_smollm2, pytest.mark.slow]
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def native_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_smollm2(
        tmp_path_factory, "native", "--max-len", "512", "--quantize", "native", "--quant-accuracy", "1"
    )


def _stored(bundle: Path, name: str) -> np.ndarray:
    manifest = json.loads((bundle / "manifest.json").read_text())
    meta = manifest["backends"]["onnx"]["tensors"][name]
    raw = np.fromfile(
        bundle / manifest["backends"]["onnx"]["weights"], dtype=np.uint8, count=meta["bytes"], offset=meta["offset"]
    )
    return raw.view(np.dtype(meta["dtype"])).reshape(meta["shape"])


def test_bundle_weights_are_the_gguf_weights_bit_for_bit(native_bundle: Path) -> None:
    """Dequantizing what the bundle stores gives exactly the tensors transformers dequantizes
    from the GGUF (the fp32 reference), for packed QKV, o, packed gate/up and down."""
    from adaptive_export.exporter.gguf_native import NativeLinear, dequantize_native
    from adaptive_export.graphs.fused_graph import PackedWeights
    from adaptive_export.loading.artifacts import load_parts
    from adaptive_export.runtimes.bundle import load_bundle

    bundle = load_bundle(native_bundle)
    _, parts = load_parts(bundle, None)
    packed = PackedWeights(parts, 8)
    reference = dict(packed.named())
    for layer in (0, 29):
        for suffix in (
            "self_attn.qkv_proj.weight_t",
            "self_attn.o_proj.weight_t",
            "mlp.gate_up_proj.weight_t",
            "mlp.down_proj.weight_t",
        ):
            name = f"model.layers.{layer}.{suffix}"
            qweight = _stored(native_bundle, f"{name}.qweight")
            n, blocks = qweight.shape[:2]
            linear = NativeLinear(
                bits=4,
                block_size=32,
                n=n,
                k=blocks * 32,
                packed=qweight,
                scales=_stored(native_bundle, f"{name}.scales").reshape(n, blocks),
                correction=_stored(native_bundle, f"{name}.correction"),
                source_types=("Q4_1",),
            )
            expected = reference[name].numpy().T
            assert np.array_equal(
                dequantize_native(linear).view(np.uint32), np.ascontiguousarray(expected).view(np.uint32)
            ), name


def test_accuracy_1_is_greedy_identical_to_hf_fp32(native_bundle: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    rc = main(
        [
            "check",
            str(native_bundle),
            "--report",
            str(report),
            "--prompts",
            str(ROOT / "samples" / "eval_prompts.jsonl"),
            "--new-tokens",
            "32",
        ]
    )
    data = json.loads(report.read_text())
    assert rc == 0, [r for r in data["results"] if not r["passed"]]
    greedy = [r for r in data["results"] if r["check"].startswith("greedy") and r["engine"] == "decode_full"]
    assert len(greedy) == 10 and all("identical" in r["detail"] or "float tie" in r["detail"] for r in greedy)
    parity = [r for r in data["results"] if r["check"] == "parity"]
    assert parity and all(r["tolerance"] is not None and r["max_abs"] <= r["tolerance"] for r in parity)


def test_accuracy_1_keeps_8_bit_tables_as_exact_floats(native_bundle: Path) -> None:
    manifest = json.loads((native_bundle / "manifest.json").read_text())
    onnx_entry = manifest["backends"]["onnx"]
    assert onnx_entry["quantize"] == "native" and manifest["dtype"] == "int4"
    assert onnx_entry["weight_bytes"] < 250e6  # fp32: 538 MB; the GGUF itself: 98 MB
    # 8-bit MatMulNBits has no fp32-activation kernel, and a Q8_0 block is d * q, exact in fp32
    assert "token_embd.qweight" not in onnx_entry["tensors"] and "model.embed_tokens.weight" in onnx_entry["tensors"]


def test_default_build_is_gguf_exact_at_accuracy_4(tmp_path: Path) -> None:
    """What the README's first command builds: the GGUF's own grid, int8 activations, the tied
    Q8_0 table stored once for the embedding gather and the LM head; check gates it on quality."""
    out = tmp_path / "default"
    assert main(["build", "-o", str(out), "--max-len", "256"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    onnx_entry = manifest["backends"]["onnx"]
    assert onnx_entry["quantize"] == "native" and onnx_entry["quant_options"]["accuracy_level"] == 4
    assert "token_embd.qweight" in onnx_entry["tensors"] and not any("embed_tokens" in t for t in onnx_entry["tensors"])
    assert onnx_entry["weight_bytes"] < 130e6
    report = tmp_path / "r.json"
    assert main(["check", str(out), "--report", str(report), "--new-tokens", "24"]) == 0
    gate = [r for r in json.loads(report.read_text())["results"] if r["check"] == "quality[mean]"]
    assert len(gate) == 1 and gate[0]["passed"], gate
