"""GGUF-exact quantization (exporter/gguf_native.py): the bundle's dequantized weights equal the
GGUF's dequantized tensors bit for bit, transformers' row order included, and the ONNX wiring
(MatMulNBits + block-sum correction, GatherBlockQuantized) computes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from onnx import TensorProto, helper  # noqa: E402

from adaptive_export.exporter import gguf_native as gn  # noqa: E402
from adaptive_export.loading.gguf_tensors import MappedGGUF  # noqa: E402
from adaptive_export.runtimes.errors import UsageError  # noqa: E402
from tests.conftest import needs_smollm2  # noqa: E402

Q = gguf.GGMLQuantizationType
# byte offsets of the fp16 fields (d, and m / dmin) inside each format's block
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
EXPECTED = {  # format -> (bits, block size, has a block-sum correction)
    "Q4_0": (4, 32, False),
    "Q4_1": (4, 32, True),
    "Q4_K": (4, 32, True),
    "Q8_0": (8, 32, False),
    "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, True),
    "Q5_K": (8, 32, True),
    "Q6_K": (8, 16, False),
}
N, K = 96, 512


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, k: int, wide: bool = False) -> np.ndarray:
    """Valid GGUF bytes [rows, bytes per row]: random codes / packed sub-scales, fp16 fields set to
    finite values (narrow: |x| < 0.05 like real weights; wide: 10^-7.5..1 with zeros, a stress test)."""
    qk, type_size = gguf.GGML_QUANT_SIZES[Q[type_name]]
    blocks = rng.integers(0, 256, (rows * k // qk, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        if wide:
            values = rng.choice([-1.0, 1.0], len(blocks)) * 10.0 ** rng.uniform(-7.5, 0, len(blocks))
            values[rng.random(len(blocks)) < 0.05] = 0
        else:
            values = rng.uniform(-0.05, 0.05, len(blocks))
        blocks[:, offset : offset + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


def realistic_q4_k(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Q4_K bytes of gaussian weights, encoded like ggml (per 32: scale = range / 15 and min as
    6-bit multiples of the super-block's fp16 d and dmin), written with ggml's packing."""
    x = (rng.standard_normal((rows * k // 256, 8, 32)) * 0.02).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    d = ((hi - lo).max(-1) / 15 / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round((hi - lo) / 15 / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = np.clip(np.round((x + (dmin.astype(np.float32)[:, None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    qs = q.reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]], heads: tuple[int, int] | None = None) -> Path:
    """A llama-architecture GGUF of these (type, bytes or floats) tensors; `heads` (q, kv) adds the
    head counts, which make transformers' loader (and ours) permute attn_q/attn_k rows."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if heads is not None:
        writer.add_head_count(heads[0])
        writer.add_head_count_kv(heads[1])
    for name, (type_name, data) in tensors.items():
        if type_name == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=Q[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> gguf.GGUFReader:
    rng = np.random.default_rng(13)
    tensors = {f"{t}.weight": (t, random_blocks(rng, t, N, K)) for t in EXPECTED}
    # random sub-scale and min codes are independent, unlike real Q4_K: use an encoder for the main one
    tensors["Q4_K.weight"] = ("Q4_K", realistic_q4_k(rng, N, K))
    tensors["Q4_K.random.weight"] = ("Q4_K", random_blocks(rng, "Q4_K", N, K))
    tensors |= {f"{t}.tall.weight": (t, random_blocks(rng, t, 2 * N, K)) for t in EXPECTED}
    tensors |= {
        f"{t}.wide.weight": (t, random_blocks(rng, t, N, K, wide=True)) for t in ("Q4_1", "Q4_K", "Q5_K", "Q8_0")
    }
    tensors["Q4_1.odd.weight"] = (
        "Q4_1",
        random_blocks(rng, "Q4_1", N, 480, wide=True),
    )  # 15 blocks: padded zero points
    tensors["Q2_K.weight"] = (
        "Q2_K",
        rng.integers(0, 256, (N, K // 256 * gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8),
    )
    tensors["norm.weight"] = ("F32", rng.standard_normal(K).astype(np.float32))
    tensors["dense.weight"] = ("F32", rng.standard_normal((N, K)).astype(np.float32))
    return gguf.GGUFReader(write_gguf(tmp_path_factory.mktemp("gguf") / "synthetic.gguf", tensors))


def tensor(reader: gguf.GGUFReader, name: str) -> gguf.ReaderTensor:
    return next(t for t in reader.tensors if t.name == name)


def ggml_dequantized(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = tensor(reader, name)
    return gguf.quants.dequantize(t.data, t.tensor_type)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    differing = int((a.view(np.uint32) != b.view(np.uint32)).sum())
    assert differing == 0, f"{differing} of {a.size} elements differ from ggml's dequantization"


# ----------------------------------------------------------------- bit exactness


@pytest.mark.parametrize("type_name", list(EXPECTED))
def test_every_format_dequantizes_bit_exactly(synthetic: gguf.GGUFReader, type_name: str) -> None:
    nl = gn.native_linear(synthetic, [f"{type_name}.weight"], [None])
    bits, block, has_correction = EXPECTED[type_name]
    assert (nl.bits, nl.block_size, nl.n, nl.k, nl.source_types) == (bits, block, N, K, (type_name,))
    assert nl.packed.dtype == np.uint8 and nl.packed.shape == (N, K // block, block * bits // 8)
    assert nl.scales.dtype == np.float32 and nl.scales.shape == (N, K // block)
    assert (nl.correction is not None) == has_correction
    if has_correction:
        assert nl.correction.dtype == np.float32 and nl.correction.shape == (K // 32, N)
    assert nl.zero_points is None, "realistic scales need no explicit zero point"
    assert_bits_equal(gn.dequantize_native(nl), ggml_dequantized(synthetic, f"{type_name}.weight"))


@pytest.mark.parametrize(
    "name", ["Q4_1.wide.weight", "Q4_K.wide.weight", "Q4_K.random.weight", "Q5_K.wide.weight", "Q8_0.wide.weight"]
)
def test_extreme_scales_stay_exact(synthetic: gguf.GGUFReader, name: str) -> None:
    """fp16 scales/mins 10^-7.5..1 apart (or Q4_K sub-scales and mins drawn independently): min +
    8 * scale is then often not an fp32 number, so those blocks of a 4-bit format with a min must
    fall back to an explicit zero point 0 to stay exact."""
    nl = gn.native_linear(synthetic, [name], [None])
    parts = gn._decode_tensor(synthetic, name)
    if nl.bits == 4:
        _, failing = gn._four_bit_correction(parts.codes, parts.scale, parts.minimum)
        assert 0 < failing.sum() < failing.size, (
            "the stress data should mix blocks the zero-point-8 form can and cannot reproduce"
        )
        np.testing.assert_array_equal(nl.zero_points, np.where(failing, 0, 8))
        # a min-less tensor packed with it keeps zero point 8 (and a -0.0 correction)
        packed = gn.native_linear(synthetic, ["Q4_0.weight", name], [None, None])
        assert (packed.zero_points[:N] == 8).all() and (packed.zero_points[N:] == nl.zero_points).all()
        assert_bits_equal(
            gn.dequantize_native(packed),
            np.concatenate([ggml_dequantized(synthetic, "Q4_0.weight"), ggml_dequantized(synthetic, name)]),
        )
    else:
        assert nl.zero_points is None
    assert_bits_equal(gn.dequantize_native(nl), ggml_dequantized(synthetic, name))


def test_mixed_formats_concatenate_losslessly(synthetic: gguf.GGUFReader) -> None:
    names = ["Q4_1.weight", "Q6_K.tall.weight", "Q4_0.weight", "Q5_K.weight"]
    rng = np.random.default_rng(3)
    perms = [rng.permutation(N), None, rng.permutation(N), None]
    nl = gn.native_linear(synthetic, names, perms)
    assert (nl.bits, nl.block_size, nl.n, nl.correction is not None) == (8, 16, 5 * N, True)
    expected = []
    for name, perm in zip(names, perms):
        w = ggml_dequantized(synthetic, name)
        expected.append(w if perm is None else w[perm])
    assert_bits_equal(gn.dequantize_native(nl), np.concatenate(expected))
    with pytest.raises(ValueError, match="permutation"):
        gn.native_linear(synthetic, ["Q4_1.weight"], [np.zeros(N, int)])


def test_float_and_unsupported_tensors_are_refused(synthetic: gguf.GGUFReader) -> None:
    with pytest.raises(gn.NotQuantizedError, match="F32"):
        gn.native_linear(synthetic, ["dense.weight"], [None])
    with pytest.raises(gn.UnsupportedGGUFTypeError, match="Q2_K"):
        gn.native_linear(synthetic, ["Q2_K.weight"], [None])


# ----------------------------------------------------------------- blocks read through the checked header


def assert_same_tensors(mapped: MappedGGUF, reader: gguf.GGUFReader) -> None:
    """The mapped file lists every tensor gguf's reader lists, with the same type, shape and bytes."""
    assert [t.name for t in mapped.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(mapped.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.tobytes() == np.asarray(theirs.data).tobytes(), ours.name
        assert not ours.data.flags.writeable


def assert_same_linear(a: gn.NativeLinear, b: gn.NativeLinear) -> None:
    assert (a.bits, a.block_size, a.source_types) == (b.bits, b.block_size, b.source_types)
    for x, y in ((a.packed, b.packed), (a.scales, b.scales), (a.zero_points, b.zero_points)):
        assert (x is None and y is None) or np.array_equal(x, y)
    assert (a.correction is None and b.correction is None) or np.array_equal(a.correction, b.correction)


def test_mapped_file_gives_the_blocks_gguf_reads(synthetic: gguf.GGUFReader) -> None:
    """NativeWeights reads blocks through the checked header (loading/gguf_tensors.py), not gguf's
    reader: the same bytes, and the same native linears from them, for every format."""
    mapped = MappedGGUF(Path(synthetic.data.filename))
    assert_same_tensors(mapped, synthetic)
    for type_name in EXPECTED:
        for name in (f"{type_name}.weight", f"{type_name}.tall.weight"):
            assert_same_linear(gn.native_linear(mapped, [name], [None]), gn.native_linear(synthetic, [name], [None]))
    with pytest.raises(gn.NotQuantizedError):
        gn.native_linear(mapped, ["dense.weight"], [None])


def test_mapped_file_is_checked_first(synthetic: gguf.GGUFReader, tmp_path: Path) -> None:
    """A file cut inside its tensor data is refused by the header check before any block is read."""
    whole = Path(synthetic.data.filename).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(UsageError, match="past the end of the file"):
        MappedGGUF(cut)


# ----------------------------------------------------------------- the real SmolLM2 file


@pytest.fixture(scope="module")
def smol_reader() -> gguf.GGUFReader:
    from adaptive_export.loading.model import smollm2_gguf_path

    return gguf.GGUFReader(smollm2_gguf_path())


@needs_smollm2
def test_smollm2_every_quantized_tensor_is_bit_exact(smol_reader: gguf.GGUFReader) -> None:
    seen = {}
    for t in smol_reader.tensors:
        if t.tensor_type.name == "F32":
            with pytest.raises(gn.NotQuantizedError):
                gn.native_linear(smol_reader, [t.name], [None])
            continue
        nl = gn.native_linear(smol_reader, [t.name], [None])
        assert nl.zero_points is None, f"{t.name} needed explicit zero points"
        assert_bits_equal(gn.dequantize_native(nl), gguf.quants.dequantize(t.data, t.tensor_type))
        seen[t.tensor_type.name] = seen.get(t.tensor_type.name, 0) + 1
    assert set(seen) == {"Q4_1", "Q8_0"} and seen["Q4_1"] == 7 * 30


@needs_smollm2
def test_smollm2_mapped_like_gguf_reader(smol_reader: gguf.GGUFReader) -> None:
    """The real file read through its checked header: the same tensors, and the same row order
    for the attention projections transformers permutes."""
    mapped = MappedGGUF(Path(smol_reader.data.filename))
    assert_same_tensors(mapped, smol_reader)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight"):
        ours, theirs = gn.transformers_row_permutation(mapped, name), gn.transformers_row_permutation(smol_reader, name)
        assert (ours is None and theirs is None) or np.array_equal(ours, theirs)
    assert gn.transformers_row_permutation(mapped, "blk.0.attn_q.weight") is not None


@pytest.fixture(scope="module")
def smol_hf(smol_transformers_model):  # type: ignore[no-untyped-def]
    return smol_transformers_model


@needs_smollm2
@pytest.mark.slow
def test_smollm2_matches_transformers_weights_bit_for_bit(smol_reader: gguf.GGUFReader, smol_hf) -> None:
    config = smol_hf.config
    names = gn.hf_to_gguf_tensor_names(config.model_type, config.num_hidden_layers, tied=config.tie_word_embeddings)
    params = dict(smol_hf.named_parameters(remove_duplicate=False))
    assert set(params) <= set(names), f"unmapped HF parameters: {sorted(set(params) - set(names))[:5]}"
    assert set(names.values()) <= {t.name for t in smol_reader.tensors}

    def hf(name: str) -> np.ndarray:
        return params[name].detach().numpy()

    def native(*hf_names: str) -> np.ndarray:
        gguf_names = [names[h] for h in hf_names]
        return gn.dequantize_native(
            gn.native_linear(
                smol_reader, gguf_names, [gn.transformers_row_permutation(smol_reader, g) for g in gguf_names]
            )
        )

    for layer in (0, 17, config.num_hidden_layers - 1):
        p = f"model.layers.{layer}."
        for proj in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            assert_bits_equal(native(p + proj + ".weight"), hf(p + proj + ".weight"))
        qkv = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        assert_bits_equal(native(*qkv), np.concatenate([hf(n) for n in qkv]))
        gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        assert_bits_equal(native(*gate_up), np.concatenate([hf(n) for n in gate_up]))
        # the permutation is needed: the file's own row order is not transformers'
        raw = gn.dequantize_native(gn.native_linear(smol_reader, [names[p + "self_attn.k_proj.weight"]], [None]))
        assert not np.array_equal(raw, hf(p + "self_attn.k_proj.weight"))
    assert gn.transformers_row_permutation(smol_reader, "blk.0.attn_v.weight") is None
    assert_bits_equal(native("model.embed_tokens.weight"), hf("model.embed_tokens.weight"))
    assert_bits_equal(native("lm_head.weight"), hf("lm_head.weight"))


def test_qk_row_permutation_is_transformers_own() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(0)
    for heads, kv_heads in ((9, 3), (4, 4)):
        processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
        for name, h in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv_heads)):
            w = rng.standard_normal((h * 8, 5)).astype(np.float32)
            expected = processor.process(w, name).weights
            np.testing.assert_array_equal(w[gn.llama_qk_row_permutation(h * 8, h)], expected)


def test_hf_names_come_from_gguf_tables() -> None:
    names = gn.hf_to_gguf_tensor_names("llama", 2)
    assert (
        names["model.layers.1.self_attn.q_proj.weight"]
        == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_Q].format(bid=1) + ".weight"
    )
    assert (
        names["lm_head.weight"]
        == names["model.embed_tokens.weight"]
        == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
    )
    assert (
        gn.hf_to_gguf_tensor_names("llama", 2, tied=False)["lm_head.weight"]
        == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"
    )
    gemma = gn.hf_to_gguf_tensor_names("gemma3_text", 1)
    assert (
        gemma["model.layers.0.self_attn.q_norm.weight"]
        == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_Q_NORM].format(bid=0) + ".weight"
    )
    assert (
        gemma["model.layers.0.pre_feedforward_layernorm.weight"]
        == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_NORM].format(bid=0) + ".weight"
    )
    with pytest.raises(ValueError, match="architecture"):
        gn.hf_to_gguf_tensor_names("no_such_model", 1)


# ----------------------------------------------------------------- ONNX Runtime


def run_graph(nodes, inits, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    import onnxruntime as ort

    kinds = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(k, kinds[v.dtype], list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        initializer=gn.unique_initializers(inits),
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(gn.MS_DOMAIN, 1)]
    )  # the exporter's opset
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(outputs, inputs)


def relative_error(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def linear_errors(nl: gn.NativeLinear, accuracy_level: int, seed: int = 0) -> float:
    x = np.random.default_rng(seed).standard_normal((2, 3, nl.k)).astype(np.float32)
    nodes, inits = gn.blocksum_nodes("x", "x_bs", nl.k, "bs")
    more, more_inits = gn.matmul_nbits_nodes("x", "y", "lin", nl, accuracy_level, "x_bs")
    (y,) = run_graph(nodes + more, inits + more_inits, {"x": x}, ["y"])
    return relative_error(y, x, gn.dequantize_native(nl))


@pytest.mark.parametrize("k", [64, 8960])
def test_block_sums_by_indicator_or_reshape(k: int) -> None:
    """Small K sums through the indicator MatMul, large K (with the rank known) through
    Reshape + ReduceSum: both equal numpy's block sums, and only the small one stores a matrix."""
    x = np.random.default_rng(k).standard_normal((1, 3, k)).astype(np.float32)
    nodes, inits = gn.blocksum_nodes("x", "x_bs", k, "bs", rank=3)
    ops = [n.op_type for n in nodes]
    assert ops == (["MatMul"] if k * (k // 32) * 4 <= gn.INDICATOR_MOST_BYTES else ["Reshape", "ReduceSum"])
    assert sum(i.ByteSize() for i in inits) < 2 * gn.INDICATOR_MOST_BYTES
    (sums,) = run_graph(nodes, inits, {"x": x}, ["x_bs"])
    np.testing.assert_allclose(sums, x.reshape(1, 3, k // 32, 32).sum(-1), rtol=1e-5, atol=1e-5)
    unknown_rank, _ = gn.blocksum_nodes("x", "x_bs", k, "bs")
    assert [n.op_type for n in unknown_rank] == ["MatMul"]  # any rank


@pytest.mark.parametrize(
    "name", [f"{t}.weight" for t in EXPECTED] + ["Q4_1.wide.weight", "Q4_K.random.weight", "Q4_1.odd.weight"]
)
def test_onnx_linear_matches_dequantized_weights(synthetic: gguf.GGUFReader, name: str) -> None:
    nl = gn.native_linear(synthetic, [name], [None])
    assert (nl.zero_points is None) == (name.count(".") == 1), "stress tensors should exercise explicit zero points"
    assert linear_errors(nl, 1) < 1e-4
    assert linear_errors(nl, 4) < 5e-2  # int8 activations: reported, not exact


@needs_smollm2
def test_onnx_smollm2_q4_1_linears_share_one_blocksum(
    smol_reader: gguf.GGUFReader, capsys: pytest.CaptureFixture[str]
) -> None:
    q = gn.native_linear(
        smol_reader, ["blk.3.attn_q.weight"], [gn.transformers_row_permutation(smol_reader, "blk.3.attn_q.weight")]
    )
    gate = gn.native_linear(smol_reader, ["blk.3.ffn_gate.weight", "blk.3.ffn_up.weight"], [None, None])
    x = np.random.default_rng(1).standard_normal((1, 4, q.k)).astype(np.float32)
    errors = {}
    for level in (1, 4):
        nodes, inits = gn.blocksum_nodes("x", "x_bs", q.k, "bs")
        for prefix, nl in (("q", q), ("gate_up", gate)):
            more, more_inits = gn.matmul_nbits_nodes("x", prefix, prefix, nl, level, "x_bs")
            nodes, inits = nodes + more, inits + more_inits
        assert sum(n.name.endswith("/BlockSum") for n in nodes) == 1
        yq, yg = run_graph(nodes, inits, {"x": x}, ["q", "gate_up"])
        errors[level] = max(
            relative_error(yq, x, gn.dequantize_native(q)), relative_error(yg, x, gn.dequantize_native(gate))
        )
    with capsys.disabled():
        print(
            "\nSmolLM2 Q4_1 linears via MatMulNBits + block-sum correction: "
            f"max rel. error {errors[1]:.1e} (accuracy 1), {errors[4]:.1e} (accuracy 4)"
        )
    assert errors[1] < 1e-4 and errors[4] < 5e-2
    with pytest.raises(ValueError, match="blocksum"):
        gn.matmul_nbits_nodes("x", "y", "q", q, 1, None)


def gather_and_head(nl: gn.NativeLinear, ids: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    nodes, inits = gn.gather_block_quantized_nodes("ids", "rows", "embed", nl)
    if nl.correction is not None:
        more, more_inits = gn.blocksum_nodes("h", "h_bs", nl.k, "bs")
        nodes, inits = nodes + more, inits + more_inits
    head, head_inits = gn.matmul_nbits_nodes(
        "h", "logits", "embed", nl, 1, "h_bs" if nl.correction is not None else None
    )
    rows, logits = run_graph(nodes + head, inits + head_inits, {"ids": ids, "h": hidden}, ["rows", "logits"])
    return rows, logits, gn.unique_initializers(inits + head_inits)


@needs_smollm2
def test_q8_0_tied_embedding_gathers_and_projects_from_one_copy(smol_reader: gguf.GGUFReader) -> None:
    nl = gn.native_linear(smol_reader, ["token_embd.weight"], [None])
    assert (nl.bits, nl.block_size, nl.correction) == (8, 32, None)
    table = gguf.quants.dequantize(tensor(smol_reader, "token_embd.weight").data, Q.Q8_0)
    rng = np.random.default_rng(2)
    ids = np.array([[0, 1, 49151], [17, 17, 30000]], np.int64)
    hidden = rng.standard_normal((1, 2, nl.k)).astype(np.float32)
    rows, logits, inits = gather_and_head(nl, ids, hidden)
    assert_bits_equal(rows, table[ids])
    assert relative_error(logits, hidden, table) < 1e-4
    weights = [i for i in inits if i.data_type == TensorProto.UINT8]
    assert len(weights) == 1 and tuple(weights[0].dims) == nl.packed.shape


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q6_K", "Q5_K"])
def test_gather_block_quantized_other_formats(synthetic: gguf.GGUFReader, type_name: str) -> None:
    nl = gn.native_linear(synthetic, [f"{type_name}.weight"], [None])
    table = ggml_dequantized(synthetic, f"{type_name}.weight")
    ids = np.array([[5], [0], [N - 1]], np.int64)
    hidden = np.random.default_rng(4).standard_normal((3, nl.k)).astype(np.float32)
    rows, logits, _ = gather_and_head(nl, ids, hidden)
    assert_bits_equal(rows, table[ids])
    assert relative_error(logits, hidden, table) < 1e-4


@needs_smollm2
def test_conversion_is_torch_free() -> None:
    import subprocess
    import sys

    from adaptive_export.loading.model import smollm2_gguf_path

    code = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError(f'{{name}} is blocked in this test')
sys.meta_path.insert(0, Block())
import gguf
from adaptive_export.exporter import gguf_native as gn
reader = gguf.GGUFReader({str(smollm2_gguf_path())!r})
name = 'blk.0.attn_k.weight'
nl = gn.native_linear(reader, [name], [gn.transformers_row_permutation(reader, name)])
gn.matmul_nbits_nodes('x', 'y', 'k', nl, 1, 'x_bs')
print('ok', nl.bits, nl.n, nl.k)
"""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["ok", "4", "192", "576"], result.stderr[-2000:]
