"""GGUF-exact bundles of the real SmolLM2 (Q4_1 linears, Q8_0 tied embedding): the file's own
blocks in the engines, bit for bit, and at accuracy level 1 the same tokens as HF fp32.

The accuracy-1 engines checked here are those of tests/conftest.py's trimmed_native_bundle:
the same build (--max-len 512 --quantize native --quant-accuracy 1) plus a native4 precision
draft over a trimmed vocabulary, so the accuracy-1 bundle is built once for the session, not
once here and once for tests/test_smollm2_spec.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import cli, needs_smollm2

# the first test pays the session's trimmed native build (minutes on 2 cores); the check decodes
# 10 prompts plainly and per draft source; the default build is built and checked in its test
pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).parents[1]


def accuracy_1_graphs(manifest: dict[str, Any]) -> set[str]:
    """Every graph but the precision draft (native4): the engines that run at accuracy level 1."""
    return {name for name, graph in manifest["graphs"].items() if not graph.get("precision")}


def _stored(bundle: Path, name: str) -> np.ndarray:
    manifest = json.loads((bundle / "manifest.json").read_text())
    meta = manifest["backends"]["onnx"]["tensors"][name]
    raw = np.fromfile(
        bundle / manifest["backends"]["onnx"]["weights"], dtype=np.uint8, count=meta["bytes"], offset=meta["offset"]
    )
    return raw.view(np.dtype(meta["dtype"])).reshape(meta["shape"])


def test_bundle_weights_are_the_gguf_weights_bit_for_bit(trimmed_native_bundle: Path) -> None:
    """Dequantizing what the bundle stores gives exactly the tensors transformers dequantizes
    from the GGUF (the fp32 reference), for packed QKV, o, packed gate/up and down."""
    from adaptive_export.exporter.gguf_native import NativeLinear, dequantize_native
    from adaptive_export.graphs.fused_graph import PackedWeights
    from adaptive_export.loading.artifacts import load_parts
    from adaptive_export.runtimes.bundle import load_bundle

    bundle = load_bundle(trimmed_native_bundle)
    _, parts = load_parts(bundle, "smollm2")
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
            qweight = _stored(trimmed_native_bundle, f"{name}.qweight")
            n, blocks = qweight.shape[:2]
            linear = NativeLinear(
                bits=4,
                block_size=32,
                n=n,
                k=blocks * 32,
                packed=qweight,
                scales=_stored(trimmed_native_bundle, f"{name}.scales").reshape(n, blocks),
                correction=_stored(trimmed_native_bundle, f"{name}.correction"),
                source_types=("Q4_1",),
            )
            expected = reference[name].numpy().T
            assert np.array_equal(
                dequantize_native(linear).view(np.uint32), np.ascontiguousarray(expected).view(np.uint32)
            ), name


def test_accuracy_1_is_greedy_identical_to_hf_fp32(trimmed_native_bundle: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    prompt_file = str(ROOT / "samples" / "eval_prompts.jsonl")
    proc = cli(
        "check",
        str(trimmed_native_bundle),
        "--model",
        "smollm2",
        "--report",
        str(report),
        "--prompts",
        prompt_file,
        "--new-tokens",
        "32",
    )
    assert report.is_file(), proc.stderr[-4000:]
    data = json.loads(report.read_text())
    assert proc.returncode == 0, [r for r in data["results"] if not r["passed"]]
    greedy = [r for r in data["results"] if r["check"].startswith("greedy") and r["engine"] == "decode_full"]
    assert len(greedy) == 10 and all("identical" in r["detail"] or "float tie" in r["detail"] for r in greedy)
    exact = accuracy_1_graphs(json.loads((trimmed_native_bundle / "manifest.json").read_text()))
    parity = [r for r in data["results"] if r["check"] == "parity" and r["engine"] in exact]
    assert parity and all(r["tolerance"] is not None and r["max_abs"] <= r["tolerance"] for r in parity)


def test_accuracy_1_keeps_8_bit_tables_as_exact_floats(trimmed_native_bundle: Path) -> None:
    manifest = json.loads((trimmed_native_bundle / "manifest.json").read_text())
    onnx_entry = manifest["backends"]["onnx"]
    assert onnx_entry["quantize"] == "native" and manifest["dtype"] == "int4"
    assert onnx_entry["weight_bytes"] < 250e6  # fp32: 538 MB; the GGUF itself: 98 MB
    # 8-bit MatMulNBits has no fp32-activation kernel, and a Q8_0 block is d * q, exact in fp32
    for graph in accuracy_1_graphs(manifest):
        initializers = onnx_entry["graphs"][graph]["initializers"]
        assert "token_embd.qweight" not in initializers and "model.embed_tokens.weight" in initializers, graph


def test_default_build_is_gguf_exact_at_accuracy_4(smol_default_bundle: Path, tmp_path: Path) -> None:
    """What the README's first command builds: the GGUF's own grid, int8 activations, the tied
    Q8_0 table stored once for the embedding gather and the LM head; check gates it on quality."""
    out = smol_default_bundle
    manifest = json.loads((out / "manifest.json").read_text())
    onnx_entry = manifest["backends"]["onnx"]
    assert onnx_entry["quantize"] == "native" and onnx_entry["quant_options"]["accuracy_level"] == 4
    assert "token_embd.qweight" in onnx_entry["tensors"] and not any("embed_tokens" in t for t in onnx_entry["tensors"])
    assert onnx_entry["weight_bytes"] < 130e6
    report = tmp_path / "r.json"
    proc = cli("check", str(out), "--model", "smollm2", "--report", str(report), "--new-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(report.read_text())["results"]
    gate = [r for r in results if r["check"] == "quality[mean]"]
    assert len(gate) == 1 and gate[0]["passed"], gate
    structure = [r for r in results if r["check"] == "structure"]  # equal to the engines the model defines
    assert {r["engine"] for r in structure} == {"prefill", "decode_full", "configs"}, structure
    assert all(r["passed"] and r["executed"] for r in structure), structure
    # run's default (auto) decodes this chat prompt on the rows the build measured for chat: plainly
    # on one row (an accuracy-4 verify pass does not reproduce T=1 steps), exact lookup on two (its
    # 0.95-0.98 one-row steps per token sit on the line, so the choice differs between builds)
    runs = [
        cli("run", str(out), "-p", "Name three rivers.", "--max-new-tokens", "16", "--json", *m)
        for m in ((), ("--mode", "ar"))
    ]
    default, plain = (json.loads(p.stdout) for p in runs)
    rows = manifest["prompt_rows"]
    growing = rows["chat"] == 2 and rows.get("decoders", {}).get("chat", "growing") == "growing"
    expected = "spec" if growing else "ar"  # plain steps and floor rounds are --mode ar's own loop
    assert default["stats"]["mode"] == expected and default["tokens"] == plain["tokens"], default["stats"]
