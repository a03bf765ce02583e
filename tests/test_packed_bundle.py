"""The packed weight form of `--quantize native` bundles (`--native-form packed`): every quantized
linear reads the GGUF's rows as stored through MatMulPacked, the embedding through GatherPacked
(exporter/packed_native.py), each node checked at load (runtimes/graph_policy.py) and run by the
package's op library (runtimes/packed_ops.py).

Fast tests rewrite one-node graphs over the synthetic GGUF of tests/test_gguf_native.py and run
them with the op library; the slow ones build the packaged SmolLM2 and Gemma 3 in this form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

gguf = pytest.importorskip("gguf")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from adaptive_export.exporter.check_precision import engine_precision  # noqa: E402
from adaptive_export.exporter.native_quant import EMBEDDING, NativeWeights, apply_native  # noqa: E402
from adaptive_export.exporter.packed_native import apply_packed  # noqa: E402
from adaptive_export.loading.gguf_tensors import MappedGGUF  # noqa: E402
from adaptive_export.runtimes import graph_policy, packed_ops  # noqa: E402
from adaptive_export.runtimes.errors import UsageError  # noqa: E402
from adaptive_export.runtimes.manifest_backends import BackendEntry, TensorEntry  # noqa: E402
from tests import test_gguf_native  # noqa: E402
from tests.conftest import cli, needs_gemma3, needs_smollm2  # noqa: E402
from tests.test_gguf_native import K, N, assert_bits_equal, ggml_dequantized, random_blocks, write_gguf  # noqa: E402

synthetic = test_gguf_native.synthetic  # the synthetic GGUF fixture (every format), shared

ROOT = Path(__file__).parents[1]
DOMAIN = packed_ops.PACKED_DOMAIN
needs_op_library = pytest.mark.skipif(
    packed_ops.library_path() is None,
    reason="built without the op library: pip install -e . with a C++ compiler builds it",
)
READ_TYPES = list(packed_ops.TYPE_IDS)  # Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K


def gguf_path(reader: Any) -> Path:
    return Path(reader.data.filename)  # gguf's reader maps the file it was given


def weights_of(path: Path, sources: dict[str, list[str]]) -> NativeWeights:
    """NativeWeights over the GGUF at `path`: graph initializer -> the GGUF tensors it stacks."""
    reader = MappedGGUF(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    return NativeWeights(reader, sources, {n: tuple(kinds[g] for g in gs) for n, gs in sources.items()})


def linear_model(k: int, n: int, weight: str = "lin.weight_t", rank: int = 3) -> onnx.ModelProto:
    """y = x @ W for a float placeholder W [K, N] (the fused graphs' transposed layout)."""
    x_shape = [1, None, k] if rank == 3 else [None, k]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", weight], ["y"], name="lin")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((k, n), np.float32), weight)],
    )
    return _model(graph)


def tied_model(k: int, rows: int) -> onnx.ModelProto:
    """The embedding gather and the tied LM head's Gemm over one float table [rows, K]."""
    graph = helper.make_graph(
        [
            helper.make_node("Gather", [EMBEDDING, "ids"], ["rows"], name="embed", axis=0),
            helper.make_node(
                "Gemm", ["h", EMBEDDING], ["logits"], name="head", alpha=1.0, beta=1.0, transA=0, transB=1
            ),
        ],
        "g",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, None]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [None, k]),
        ],
        [
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, None),
        ],
        [numpy_helper.from_array(np.zeros((rows, k), np.float32), EMBEDDING)],
    )
    return _model(graph)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(packed_ops.require_library()))
    engine = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return engine.run(None, feeds)


def identity(k: int, rank: int = 3) -> np.ndarray:
    """One-hot activations: x @ W^T is then W^T itself, so the products show the weights exactly."""
    eye = np.eye(k, dtype=np.float32)
    return eye[None] if rank == 3 else eye


def relative_error(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def packed_inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == TensorProto.UINT8}


# ----------------------------------------------------------------- the rewrite, run


@needs_op_library
@pytest.mark.parametrize("name", [f"{t}.weight" for t in READ_TYPES] + ["Q4_1.wide.weight", "Q4_K.random.weight"])
def test_each_format_computes_the_gguf_dequantized_weights(synthetic: Any, name: str) -> None:
    """Accuracy 1: one-hot rows return ggml's dequantized weights exactly, random rows agree with
    float64 to fp32 rounding; accuracy 4 (int8 activations) is close. The rows are the file's bytes."""
    w = ggml_dequantized(synthetic, name)
    weights = weights_of(gguf_path(synthetic), {"lin.weight_t": [name]})
    x = np.random.default_rng(0).standard_normal((1, 5, K)).astype(np.float32)
    for level in (1, 4):
        model = linear_model(K, N)
        apply_packed(model, weights, level)
        ops = [(n.domain, n.op_type) for n in model.graph.node]
        assert ops == [(DOMAIN, "MatMulPacked")], ops
        (stored,) = packed_inits(model).values()
        raw = next(t for t in synthetic.tensors if t.name == name).data
        assert np.array_equal(stored, np.asarray(raw).reshape(N, -1))
        assert not [i for i in model.graph.initializer if i.data_type == TensorProto.FLOAT]  # the placeholder went
        (y,) = run(model, {"x": x})
        if level == 1:
            (exact,) = run(model, {"x": identity(K)})
            assert np.array_equal(exact[0], w.T), "accuracy 1 must compute the dequantized weights exactly"
            assert relative_error(y[0], x[0], w) < 1e-5
        else:
            assert relative_error(y[0], x[0], w) < 5e-2


@needs_op_library
def test_mixed_types_in_one_linear_run_per_type_and_concat(synthetic: Any) -> None:
    """Gemma's qkv (Q5_0, Q5_0, Q8_0): one MatMulPacked per run of equal types, Concat on the last axis."""
    names = ["Q5_0.weight", "Q5_0.tall.weight", "Q8_0.weight"]
    w = np.concatenate([ggml_dequantized(synthetic, n) for n in names])
    model = linear_model(K, 4 * N, "qkv")
    apply_packed(model, weights_of(gguf_path(synthetic), {"qkv": names}), 1)
    assert [n.op_type for n in model.graph.node] == ["MatMulPacked", "MatMulPacked", "Concat"]
    assert [n.attribute[0].i for n in model.graph.node if n.op_type == "Concat"] == [-1]
    attributes = [{a.name: a.i for a in n.attribute} for n in model.graph.node[:2]]
    assert [(a["packed_type"], a["N"], a["K"]) for a in attributes] == [(6, 3 * N, K), (8, N, K)]
    assert sorted(packed_inits(model)) == ["qkv.packed_0", "qkv.packed_1"]
    (exact,) = run(model, {"x": identity(K)})
    assert np.array_equal(exact[0], w.T)


@needs_op_library
def test_tied_table_is_one_initializer_for_the_gather_and_the_head(synthetic: Any) -> None:
    name = "Q8_0.tall.weight"
    table = ggml_dequantized(synthetic, name)
    weights = weights_of(gguf_path(synthetic), {EMBEDDING: [name]})
    model = tied_model(K, 2 * N)
    emitted: list[list[str]] = []

    def emit(inits: list[TensorProto]) -> list[TensorProto]:
        emitted.append([i.name for i in inits])
        return inits

    apply_packed(model, weights, 1, emit)
    assert emitted == [["token_embd.packed"]]  # converted and written once, for both uses
    assert list(packed_inits(model)) == ["token_embd.packed"]
    assert [(n.op_type, n.input[0] if n.op_type == "GatherPacked" else n.input[1]) for n in model.graph.node] == [
        ("GatherPacked", "token_embd.packed"),
        ("MatMulPacked", "token_embd.packed"),
    ]
    ids = np.array([[0, 5, 2 * N - 1, 5]], np.int64)
    rows, logits = run(model, {"ids": ids, "h": identity(K, rank=2)})
    assert_bits_equal(rows, table[ids])
    assert np.array_equal(logits, table.T)
    with pytest.raises(Exception, match="outside a table"):  # the kernel bounds-checks every index
        run(model, {"ids": np.array([[2 * N]], np.int64), "h": identity(K, rank=2)})


@needs_op_library
def test_llama_q_and_k_rows_are_permuted_whole(tmp_path: Path) -> None:
    """transformers' GGUF loader un-permutes llama's attn_q/attn_k rows; the packed form moves whole
    rows, so the stored rows are the file's rows in that order and the product matches."""
    from adaptive_export.exporter.gguf_native import llama_qk_row_permutation

    rng = np.random.default_rng(7)
    k, heads, kv_heads, head_dim = 64, 4, 2, 16
    blocks = {
        "blk.0.attn_q.weight": ("Q8_0", random_blocks(rng, "Q8_0", heads * head_dim, k)),
        "blk.0.attn_k.weight": ("Q4_0", random_blocks(rng, "Q4_0", kv_heads * head_dim, k)),
        "blk.0.attn_v.weight": ("Q4_0", random_blocks(rng, "Q4_0", kv_heads * head_dim, k)),
    }
    path = write_gguf(tmp_path / "llama.gguf", blocks, heads=(heads, kv_heads))
    reader = gguf.GGUFReader(path)
    perms = [llama_qk_row_permutation(heads * head_dim, heads), llama_qk_row_permutation(kv_heads * head_dim, kv_heads)]
    perms.append(np.arange(kv_heads * head_dim))
    w = np.concatenate([ggml_dequantized(reader, n)[p] for n, p in zip(blocks, perms)])
    model = linear_model(k, w.shape[0], "qkv")
    apply_packed(model, weights_of(path, {"qkv": list(blocks)}), 1)
    stored = packed_inits(model)
    assert np.array_equal(stored["qkv.packed_0"], blocks["blk.0.attn_q.weight"][1][perms[0]])
    assert np.array_equal(
        stored["qkv.packed_1"],
        np.concatenate([blocks["blk.0.attn_k.weight"][1][perms[1]], blocks["blk.0.attn_v.weight"][1]]),
    )
    (exact,) = run(model, {"x": identity(k)})
    assert np.array_equal(exact[0], w.T)
    nbits = linear_model(k, w.shape[0], "qkv")
    apply_native(nbits, weights_of(path, {"qkv": list(blocks)}), 4)  # the other form of the same linear
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    (y_nbits,) = run(nbits, {"x": x})
    assert relative_error(y_nbits[0], x[0], w) < 5e-2


def test_the_rewrite_is_deterministic_and_imports_the_domain_once(synthetic: Any) -> None:
    weights = weights_of(gguf_path(synthetic), {EMBEDDING: ["Q8_0.tall.weight"]})
    made = []
    for _ in range(2):
        model = tied_model(K, 2 * N)
        apply_packed(model, weights, 4)
        made.append(model.SerializeToString())
    assert made[0] == made[1]
    imports = [(o.domain, o.version) for o in onnx.load_from_string(made[0]).opset_import]
    assert imports.count((DOMAIN, 1)) == 1
    plain = _model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
    )
    apply_packed(plain, weights, 4)
    assert DOMAIN not in {o.domain for o in plain.opset_import}  # nothing packed, nothing imported


def test_types_the_kernels_do_not_read_and_other_accuracy_levels_are_refused(synthetic: Any) -> None:
    weights = weights_of(gguf_path(synthetic), {"lin.weight_t": ["Q5_1.weight"]})
    with pytest.raises(UsageError, match="Q5_1") as refused:
        apply_packed(linear_model(K, N), weights, 1)
    assert "--native-form nbits" in str(refused.value) and "\n" not in str(refused.value)
    readable = weights_of(gguf_path(synthetic), {"lin.weight_t": ["Q4_0.weight"]})
    for level in (0, 2):
        with pytest.raises(UsageError, match="accuracy level 1 or 4"):
            apply_packed(linear_model(K, N), readable, level)


@needs_op_library
def test_a_reduced_draft_head_is_requantized_beside_packed_linears(synthetic: Any) -> None:
    """The native4 draft with --draft-vocab re-quantizes its reduced head (no GGUF tensor) with ONNX
    Runtime's quantizer, which must leave the packed nodes as they are."""
    from adaptive_export.exporter.quantize import quantize

    model = linear_model(K, N)
    head = np.random.default_rng(3).standard_normal((N, 64)).astype(np.float32)
    model.graph.node.append(helper.make_node("MatMul", ["y", "draft_head.weight"], ["z"], name="head"))
    model.graph.initializer.append(numpy_helper.from_array(head, "draft_head.weight"))
    model.graph.output[0].name = "z"
    apply_packed(model, weights_of(gguf_path(synthetic), {"lin.weight_t": ["Q4_K.weight"]}), 4)
    model = quantize(model, "int8", block_size=32, accuracy_level=4)
    assert sorted(n.op_type for n in model.graph.node) == ["MatMulNBits", "MatMulPacked"]
    x = np.random.default_rng(4).standard_normal((1, 2, K)).astype(np.float32)
    (z,) = run(model, {"x": x})
    y = x.astype(np.float64) @ ggml_dequantized(synthetic, "Q4_K.weight").T.astype(np.float64)
    assert np.abs(z - y @ head).max() / np.abs(y @ head).max() < 5e-2


def test_check_reads_bits_and_accuracy_from_the_packed_nodes(synthetic: Any) -> None:
    """check's precision class comes from the engines: Q4_1 rows are a 4-bit grid, Q8_0 rows 8-bit,
    and accuracy 1 everywhere makes the engine GGUF-exact."""
    for name, level, dtype, exact in (
        ("Q4_1.weight", 1, "int4", True),
        ("Q8_0.weight", 1, "int8", True),
        ("Q6_K.weight", 4, "int8", False),
    ):
        model = linear_model(K, N)
        apply_packed(model, weights_of(gguf_path(synthetic), {"lin.weight_t": [name]}), level)
        precision = engine_precision(model)
        assert (precision.dtype, precision.exact) == (dtype, exact), (name, precision)
        assert "GGUF rows" in precision.evidence


# ----------------------------------------------------------------- the load-time check


def packed_engine(op: str = "MatMulPacked", **changes: Any) -> tuple[onnx.ModelProto, BackendEntry]:
    """One packed node over an external uint8 weight, and the weight table that supplies it."""
    type_id, k, n = changes.pop("packed_type", 8), changes.pop("K", 64), changes.pop("N", 16)
    shape = changes.pop("shape", [n, packed_ops.row_bytes(8, 64)])
    dtype = changes.pop("dtype", "|u1")
    attributes = {"packed_type": type_id, "K": k}
    inputs = ["x", "rows"] if op == "MatMulPacked" else ["rows", "ids"]
    if op == "MatMulPacked":
        attributes |= {"N": n, "accuracy_level": changes.pop("accuracy_level", 1)}
    attributes |= changes.pop("attributes", {})
    inputs = changes.pop("inputs", inputs)
    assert not changes, changes
    node = helper.make_node(op, inputs, ["y"], name="p", domain=DOMAIN, **attributes)
    rows = TensorProto(name="rows", data_type=TensorProto.UINT8, dims=shape)
    rows.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(int(np.prod(shape))))):
        entry = rows.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [rows])
    size = int(np.prod(shape)) * (4 if dtype == "<f4" else 1)
    table = {"rows": TensorEntry(dtype, tuple(shape), 0, size)}
    return _model(graph), BackendEntry("onnx", {}, "onnx/weights.bin", size, table, "ort", "native")


def test_the_policy_accepts_packed_nodes_as_the_exporter_writes_them() -> None:
    for op in ("MatMulPacked", "GatherPacked"):
        model, entry = packed_engine(op)
        assert graph_policy._check_packed_nodes(model.graph, "'e.onnx'", entry) == {"rows"}
        graph_policy._check_ops(model, "'e.onnx'")  # the domain and its two ops are allowed


@pytest.mark.parametrize(
    "op, changes, fragment",
    [
        ("MatMulPacked", {"shape": [16, 35]}, "[16, 35]"),
        ("MatMulPacked", {"N": 17, "shape": [16, 68]}, "[17, 68]"),
        ("GatherPacked", {"shape": [16, 34]}, "[16, 34]"),
        ("MatMulPacked", {"dtype": "<f4", "shape": [16, 68]}, "<f4"),
        ("MatMulPacked", {"packed_type": 7}, "packed_type 7"),
        ("GatherPacked", {"packed_type": 99}, "packed_type 99"),
        ("MatMulPacked", {"K": 48}, "K=48"),
        ("MatMulPacked", {"accuracy_level": 0}, "accuracy_level 0"),
        ("MatMulPacked", {"accuracy_level": 2}, "accuracy_level 2"),
        ("MatMulPacked", {"inputs": ["x", "rows", "scale"]}, "3 inputs"),
        ("MatMulPacked", {"inputs": ["rows"]}, "1 inputs"),
        ("GatherPacked", {"inputs": ["rows", "ids", "ids"]}, "3 inputs"),
        ("MatMulPacked", {"inputs": ["x", "x"]}, "not a weight"),
        ("MatMulPacked", {"attributes": {"bits": 4}}, "'bits'"),
    ],
)
def test_the_policy_refuses_packed_nodes_the_exporter_never_writes(op: str, changes: dict, fragment: str) -> None:
    model, entry = packed_engine(op, **changes)
    with pytest.raises(UsageError) as refused:
        graph_policy._check_packed_nodes(model.graph, "'e.onnx'", entry)
    message = str(refused.value)
    assert "is refused" in message and fragment in message and "\n" not in message, message


# ----------------------------------------------------------------- build options


def test_auto_chooses_packed_where_its_rows_read_fewer_bytes_and_packed_is_refused_where_it_cannot_be_built() -> None:
    from adaptive_export.commands.build import AUTO_PACKED_BYTES, packed_share, resolve_native_form

    q4_k_m = [("Q4_K", 1536 * 8960 * 30), ("Q6_K", 1536 * 8960 * 8), ("Q5_0", 896 * 4864 * 4)]
    q4_1 = [("Q4_1", 576 * 1536 * 90), ("Q8_0", 576 * 49152)]
    assert packed_share(q4_k_m) <= AUTO_PACKED_BYTES < packed_share(q4_1)
    assert resolve_native_form("auto", True, q4_k_m) == "packed"
    for available in (True, False):
        assert resolve_native_form("auto", available, q4_1) == "nbits"
        assert resolve_native_form("auto", available, [("Q5_1", 1024)]) == "nbits"
        assert resolve_native_form("nbits", available, [("Q5_1", 1024)]) == "nbits"
    assert resolve_native_form("auto", False, q4_k_m) == "nbits"  # no library: the portable form
    assert resolve_native_form("auto", True, q4_k_m + [("Q5_1", 1024)]) == "nbits"
    assert resolve_native_form("packed", True, [("Q4_1", 1024)]) == "packed"
    with pytest.raises(UsageError, match="built without them") as missing:
        resolve_native_form("packed", False, [("Q4_1", 1024)])
    assert "--native-form nbits" in str(missing.value) and "reinstall" in str(missing.value)
    with pytest.raises(UsageError, match="Q5_1"):
        resolve_native_form("packed", True, [("Q4_1", 1024), ("Q5_1", 1024)])


def one_line_refusal(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    from adaptive_export.commands.cli import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix:" in lines[0], lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_packed_needs_native_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["build", "smollm2", "-o", str(tmp_path / "o"), "--quantize", "int8", "--native-form", "packed"]
    one_line_refusal(capsys, argv, "--native-form packed", "--quantize native")


@needs_smollm2
def test_packed_build_refusals_come_before_any_loading(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["build", "smollm2", "-o", str(tmp_path / "o"), "--native-form", "packed"]
    one_line_refusal(capsys, [*base, "--quant-accuracy", "0"], "accuracy level 1 or 4")
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(packed_ops, "library_path", lambda: None)  # an installation built without a compiler
    line = one_line_refusal(capsys, base, "built without them", "--native-form nbits", "reinstall")
    assert "MatMulPacked" in line and not (tmp_path / "o").exists()


# ----------------------------------------------------------------- real models (slow)


def _manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_text())


def _stored_bytes(bundle: Path, name: str) -> bytes:
    onnx_entry = _manifest(bundle)["backends"]["onnx"]
    meta = onnx_entry["tensors"][name]
    with open(bundle / onnx_entry["weights"], "rb") as f:
        f.seek(meta["offset"])
        return f.read(meta["bytes"])


def _gguf_tensor_bytes(path: Path) -> tuple[dict[str, bytes], int]:
    """Each quantized tensor's bytes, and the bytes of every tensor of the file."""
    from adaptive_export.loading.gguf_tensors import MappedGGUF

    reader = MappedGGUF(path)
    total = sum(t.data.nbytes for t in reader.tensors)
    return {t.name: t.data.tobytes() for t in reader.tensors if t.tensor_type.name in READ_TYPES}, total


@pytest.fixture(scope="module")
def smol_packed_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import build_smollm2

    return build_smollm2(
        tmp_path_factory, "smol_packed", "--max-len", "256", "--quantize", "native", "--native-form", "packed",
        "--quant-accuracy", "1",
    )  # fmt: skip


@needs_smollm2
@needs_op_library
@pytest.mark.slow
@pytest.mark.timeout(1800)
class TestSmolLM2Packed:
    def test_rows_are_the_gguf_bytes_and_the_weights_file_is_the_gguf_size(self, smol_packed_bundle: Path) -> None:
        from adaptive_export.exporter.gguf_native import llama_qk_row_permutation
        from adaptive_export.loading.model import smollm2_gguf_path

        manifest = _manifest(smol_packed_bundle)
        onnx_entry = manifest["backends"]["onnx"]
        assert onnx_entry["quant_options"]["native_form"] == "packed" and manifest["dtype"] == "int4"
        tensors = onnx_entry["tensors"]
        assert {m["dtype"] for n, m in tensors.items() if n.endswith((".packed", ".packed_0"))} == {"|u1"}
        assert "token_embd.packed" in tensors and not any(n.endswith((".qweight", ".correction")) for n in tensors)
        assert not any("embed_tokens" in n for n in tensors)  # the tied Q8_0 table once, as rows, no float copy
        file_bytes, gguf_total = _gguf_tensor_bytes(smollm2_gguf_path())
        assert _stored_bytes(smol_packed_bundle, "token_embd.packed") == file_bytes["token_embd.weight"]
        heads, kv, head_dim = (manifest["model"][k] for k in ("num_heads", "num_kv_heads", "head_dim"))
        q = np.frombuffer(file_bytes["blk.3.attn_q.weight"], np.uint8).reshape(heads * head_dim, -1)
        k = np.frombuffer(file_bytes["blk.3.attn_k.weight"], np.uint8).reshape(kv * head_dim, -1)
        v = np.frombuffer(file_bytes["blk.3.attn_v.weight"], np.uint8).reshape(kv * head_dim, -1)
        expected = np.concatenate(
            [q[llama_qk_row_permutation(len(q), heads)], k[llama_qk_row_permutation(len(k), kv)], v]
        ).tobytes()
        assert _stored_bytes(smol_packed_bundle, "model.layers.3.self_attn.qkv_proj.weight_t.packed") == expected
        gate = file_bytes["blk.3.ffn_gate.weight"] + file_bytes["blk.3.ffn_up.weight"]
        assert _stored_bytes(smol_packed_bundle, "model.layers.3.mlp.gate_up_proj.weight_t.packed") == gate
        assert onnx_entry["weight_bytes"] <= 1.02 * gguf_total, (onnx_entry["weight_bytes"], gguf_total)

    def test_weights_file_is_smaller_than_the_nbits_bundle(
        self, smol_packed_bundle: Path, smol_default_bundle: Path
    ) -> None:
        packed = _manifest(smol_packed_bundle)["backends"]["onnx"]["weight_bytes"]
        nbits = _manifest(smol_default_bundle)["backends"]["onnx"]["weight_bytes"]
        assert packed < nbits, (packed, nbits)

    def test_accuracy_1_is_greedy_identical_to_hf_fp32_and_check_calls_it_gguf(
        self, smol_packed_bundle: Path, tmp_path: Path
    ) -> None:
        report = tmp_path / "r.json"
        proc = cli(
            "check", str(smol_packed_bundle), "--model", "smollm2", "--report", str(report), "--prompts",
            str(ROOT / "samples" / "eval_prompts.jsonl"), "--new-tokens", "32", "--expect-precision", "gguf",
        )  # fmt: skip
        assert report.is_file(), proc.stderr[-4000:]
        data = json.loads(report.read_text())
        assert proc.returncode == 0, [r for r in data["results"] if not r["passed"]]
        greedy = [r for r in data["results"] if r["check"].startswith("greedy") and r["engine"] == "decode_full"]
        assert len(greedy) == 10 and all("identical" in r["detail"] or "float tie" in r["detail"] for r in greedy)
        parity = [r for r in data["results"] if r["check"] == "parity"]
        assert parity and all(r["tolerance"] is not None and r["max_abs"] <= r["tolerance"] for r in parity)
        structure = [r for r in data["results"] if r["check"] == "structure"]  # rebuilt packed, compared equal
        assert {r["engine"] for r in structure} == {"prefill", "decode_full", "configs"} and all(
            r["passed"] for r in structure
        )

    def test_inspect_shows_the_weight_form(self, smol_packed_bundle: Path) -> None:
        proc = cli("inspect", str(smol_packed_bundle))
        assert proc.returncode == 0, proc.stderr
        assert "packed rows" in proc.stdout and "op library installed" in proc.stdout
        info = json.loads(cli("inspect", str(smol_packed_bundle), "--json").stdout)
        assert (info["weight_form"], info["packed_ops_library"]) == ("packed", True)

    def test_run_without_the_library_or_on_another_provider_is_one_line(
        self, smol_packed_bundle: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from adaptive_export.runtimes.backends.onnxruntime_backend import OnnxRuntimeBackend
        from adaptive_export.runtimes.bundle import load_bundle

        backend = OnnxRuntimeBackend(load_bundle(smol_packed_bundle))
        monkeypatch.setattr(packed_ops, "library_path", lambda: None)
        with pytest.raises(UsageError, match="built without them"):
            backend.session("decode_full")
        monkeypatch.undo()
        backend.provider = "CUDAExecutionProvider"  # what --provider cuda selects, where it exists
        with pytest.raises(UsageError, match="CPU only"):
            backend.session("decode_full")

    def test_a_tampered_packed_node_is_refused_at_load(
        self, smol_packed_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from tests.test_hardening import edit_engine, expect_usage, make_bad

        def widen(model: onnx.ModelProto) -> None:
            node = next(n for n in model.graph.node if n.op_type == "MatMulPacked")
            next(a for a in node.attribute if a.name == "K").i *= 2  # rows the kernel would read past

        bad = make_bad(smol_packed_bundle, tmp_path, lambda r: edit_engine(r, "decode_full", widen))
        expect_usage(["run", str(bad), "-p", "The sea", "--max-new-tokens", "2"], capsys, "is refused", "MatMulPacked")


@needs_smollm2
@needs_op_library
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_packed_at_accuracy_4_builds_and_checks(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from tests.conftest import build_smollm2

    bundle = build_smollm2(
        tmp_path_factory, "smol_packed4", "--max-len", "256", "--quantize", "native", "--native-form", "packed",
        "--prompt-rows", "rule",
    )  # fmt: skip
    onnx_entry = _manifest(bundle)["backends"]["onnx"]
    assert onnx_entry["quant_options"] == {"block_size": 32, "accuracy_level": 4, "native_form": "packed"}
    report = tmp_path / "r.json"
    proc = cli("check", str(bundle), "--model", "smollm2", "--report", str(report), "--new-tokens", "16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(report.read_text())["results"]
    structure = [r for r in results if r["check"] == "structure"]
    assert structure and all(r["passed"] for r in structure), structure


@needs_smollm2
@needs_op_library
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_packed_native4_draft_reads_the_bundles_rows(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The native4 precision draft of a packed accuracy-1 bundle: the same uint8 rows at accuracy 4
    (nothing stored twice; its reduced head re-quantized beside them), and lossless drafting."""
    from tests.conftest import TRIMMED_VOCAB, build_smollm2

    bundle = build_smollm2(
        tmp_path_factory, "smol_packed_native4", "--max-len", "256", "--quantize", "native", "--native-form",
        "packed", "--quant-accuracy", "1", "--draft-precision", "native4", "--draft-vocab", str(TRIMMED_VOCAB),
        "--calib", str(ROOT / "samples" / "eval_prompts.jsonl"), "--prompt-rows", "rule",
    )  # fmt: skip
    manifest = _manifest(bundle)
    engines = manifest["backends"]["onnx"]["graphs"]
    draft = next(name for name, graph in manifest["graphs"].items() if graph.get("precision") == "native4")
    rows = {n for n in engines[draft]["initializers"] if ".packed" in n}
    assert rows and rows <= set(engines["decode_full"]["initializers"])  # shared, not copied
    model = onnx.load(str(bundle / engines[draft]["file"]), load_external_data=False)
    levels = {
        a.i for n in model.graph.node if n.op_type == "MatMulPacked" for a in n.attribute if a.name == "accuracy_level"
    }
    assert levels == {4} and any(n.op_type == "MatMulNBits" for n in model.graph.node)  # the reduced head
    for prompt in ("The capital of France is", "Write a haiku about the sea."):
        plain = cli("run", str(bundle), "-p", prompt, "--max-new-tokens", "24", "--json", "--mode", "ar")
        spec = cli(
            "run", str(bundle), "-p", prompt, "--max-new-tokens", "24", "--json", "--mode", "spec", "--draft",
            "precision",
        )  # fmt: skip
        assert plain.returncode == 0 and spec.returncode == 0, (plain.stderr[-2000:], spec.stderr[-2000:])
        assert json.loads(plain.stdout)["tokens"] == json.loads(spec.stdout)["tokens"]


@needs_gemma3
@needs_op_library
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gemma3_packed_mixes_types_and_decodes_as_the_nbits_bundle(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Gemma 3's Q4_K_M file: q/k/v are Q5_0, Q5_0, Q8_0 in half the layers (two runs and a Concat),
    ffn_down Q4_K or Q6_K. At accuracy 1 both weight forms are the GGUF's model: same greedy tokens."""
    from tests.conftest import build_in_child

    flags = ["--max-len", "256", "--quantize", "native", "--quant-accuracy", "1", "--prompt-rows", "rule"]
    out = tmp_path_factory.mktemp("gemma_packed")
    packed = build_in_child(out / "packed", "gemma3", *flags, "--native-form", "packed")
    nbits = build_in_child(out / "nbits", "gemma3", *flags, "--native-form", "nbits")
    engine_file = _manifest(packed)["backends"]["onnx"]["graphs"]["decode_full"]["file"]
    engine = onnx.load(str(packed / engine_file), load_external_data=False)
    types = {
        a.i for n in engine.graph.node if n.op_type == "MatMulPacked" for a in n.attribute if a.name == "packed_type"
    }
    assert {6, 8, 12, 14} <= types, types  # Q5_0, Q8_0, Q4_K, Q6_K
    assert any(n.op_type == "Concat" and n.name.endswith("qkv_proj.weight_t/Concat") for n in engine.graph.node)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    tokens = {}
    for name, bundle in (("packed", packed), ("nbits", nbits)):
        outs = []
        for prompt in prompts:
            proc = cli("run", str(bundle), "-p", prompt, "--max-new-tokens", "24", "--json")
            assert proc.returncode == 0, proc.stderr[-4000:]
            outs.append(json.loads(proc.stdout)["tokens"])
        tokens[name] = outs
    assert tokens["packed"] == tokens["nbits"]
