"""GGUF-exact quantization: a quantized GGUF tensor keeps its own grid in the ONNX graph.

Each supported GGUF block format is decoded (vectorised numpy, following ggml's block
layouts) into integer codes, per-block scales and, for formats with a "min", a per-32-block
additive term, and re-expressed as ONNX Runtime's ``MatMulNBits`` weights:

* Q4_0, Q4_1, Q4_K -> 4-bit blocks of 32 (implicit zero point 8);
* Q8_0, Q5_0, Q5_1, Q5_K -> 8-bit blocks of 32, Q6_K -> 8-bit blocks of 16 (implicit zero point 128).

The dequantized weight the graph represents is, element by element in fp32,

    w[n, k] = fl(fl(scales[n, k // B] * (q[n, k] - zp[n, k // B])) + correction[k // 32, n])

(``dequantize_native``), and it equals ``gguf.quants.dequantize`` of the file bit for bit.
The correction is applied without a float zero point: ``MatMulNBits(x) + blocksum(x) @
correction`` where ``blocksum(x)`` is the sum of each 32-wide block of the activation
(``blocksum_nodes``), computed once per activation and shared by every linear reading it.

Exactness: every product scale * (q - zp) is exact in fp32 (an fp16 mantissa times at most
7+6 integer bits), so the only rounding is the final addition. For 8-bit targets the codes
are stored unshifted (q + 128) and the correction is the format's own min (exact), so the
single rounding is ggml's own. For 4-bit formats with a min the implicit zero point 8 forces
correction = min + 8 * scale, which fp32 cannot always hold exactly; `_four_bit_correction`
checks every block against ggml's rounding; a block that fails gets an explicit zero point 0
(correction = min, exact), which gives its linear a uint8 zero_points input (ORT's zero-point
kernel: within noise of the symmetric one plus block sums on a 576x1536 Q4_1 linear, see
benchmarks/gguf_native_linear.py, plus one byte of zero points per two blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from adaptive_export.loading.gguf_tensors import MappedGGUF

CORRECTION_BLOCK = 32
INDICATOR_MOST_BYTES = 1 << 20  # block sums by an indicator MatMul up to this matrix size (blocksum_nodes)
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
EIGHT_BIT_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
MS_DOMAIN = "com.microsoft"


class NotQuantizedError(ValueError):
    """The GGUF tensor is stored as floats (F32/F16/BF16): there is no grid to keep."""


class UnsupportedGGUFTypeError(ValueError):
    """The GGUF tensor uses a block format this module does not convert."""


@dataclass
class NativeLinear:
    """One linear y = x @ W^T, W [n, k], in MatMulNBits form.

    packed: uint8 [n, k // block_size, block_size * bits // 8], MatMulNBits' B (4-bit: element
        2i in the low nibble, 2i + 1 in the high nibble of byte i of its block).
    scales: float32 [n, k // block_size], MatMulNBits' scales.
    zero_points: None (every block uses MatMulNBits' implicit zero point 2**(bits-1): no
        zero_points input) or uint8 [n, k // block_size], one zero point per block (8, or 0 for a
        4-bit block whose min + 8 * scale is not an fp32 number), emitted as a packed zero_points input.
    correction: float32 [k // 32, n] or None; w[n, k] = scale * (q - zp) + correction[k // 32, n].
    source_types: the GGUF type name of each concatenated tensor, in order.
    """

    bits: int
    block_size: int
    n: int
    k: int
    packed: np.ndarray
    scales: np.ndarray
    correction: np.ndarray | None
    source_types: tuple[str, ...]
    zero_points: np.ndarray | None = None

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None

    def block_zero_points(self) -> np.ndarray:
        """uint8 [n, k // block_size]: the zero point of every block."""
        if self.zero_points is not None:
            return self.zero_points
        return np.full((self.n, self.k // self.block_size), 1 << (self.bits - 1), np.uint8)


@dataclass
class _Decoded:
    """w = scale[n, k // bs] * codes[n, k] + (minimum[n, k // 32] if minimum is not None)."""

    codes: np.ndarray  # int16 [n, k]
    scale: np.ndarray  # float32 [n, k // bs]
    block_size: int
    minimum: np.ndarray | None  # float32 [n, k // 32]
    bits: int  # 4 when the codes (shifted by the implicit zero point) fit 4 bits
    type_name: str


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[b, 16] bytes -> [b, 32] codes: element j is the low nibble of byte j, j + 16 the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> ([b, 8], [b, 8]) uint8 (ggml get_scale_min_k4)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[b, 128] bytes -> [b, 8, 32]: 64-element chunk j: low nibbles = sub-block 2j, high = 2j + 1."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)


def _decode_blocks(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None, int]:
    """blocks: uint8 [b, type_size] -> (codes int16 [b, qk], scale f32 [b, qk // bs], bs,
    min f32 [b, qk // 32] | None, bits)."""
    b = blocks.shape[0]
    if type_name == "Q4_0":
        d = _f16(blocks[:, 0:2])
        return _nibbles_32(blocks[:, 2:18]).astype(np.int16) - 8, d, 32, None, 4
    if type_name == "Q4_1":
        d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        return _nibbles_32(blocks[:, 4:20]).astype(np.int16), d, 32, m, 4
    if type_name in ("Q5_0", "Q5_1"):
        off = 2 if type_name == "Q5_0" else 4
        qh = np.ascontiguousarray(blocks[:, off : off + 4]).view(np.uint32)  # [b, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        q = (_nibbles_32(blocks[:, off + 4 : off + 20]) | high).astype(np.int16)
        if type_name == "Q5_0":
            return q - 16, _f16(blocks[:, 0:2]), 32, None, 8
        return q, _f16(blocks[:, 0:2]), 32, _f16(blocks[:, 2:4]), 8
    if type_name == "Q8_0":
        d = _f16(blocks[:, 0:2])
        return np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.int16), d, 32, None, 8
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)  # exact: 11-bit mantissa x 6-bit integer
        minimum = -(dmin * mn.astype(np.float32))  # exact; ggml computes d*sc*q - dmin*m
        if type_name == "Q4_K":
            return _k_low_nibbles(blocks[:, 16:144]).reshape(b, 256).astype(np.int16), scale, 32, minimum, 4
        qh = blocks[:, 16:48].reshape(b, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _k_low_nibbles(blocks[:, 48:176]) | ((qh & 1) << 4)
        return q.reshape(b, 256).astype(np.int16), scale, 32, minimum, 8
    if type_name == "Q6_K":
        ql, qh = blocks[:, 0:128], blocks[:, 128:192]
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        low = ql.reshape(b, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        low = (low & 0x0F).reshape(b, 8, 32)
        high = qh.reshape(b, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        high = (high & 0x03).reshape(b, 8, 32)
        q = (low | (high << 4)).astype(np.int16) - 32
        return q.reshape(b, 256), d * sc, 16, None, 8  # d * sc exact: 11 bits x 8 bits
    if type_name in FLOAT_TYPES:
        raise NotQuantizedError(f"{type_name} tensors are not quantized")
    raise UnsupportedGGUFTypeError(
        f"GGUF type {type_name} is not supported (supported: {', '.join(FOUR_BIT_TYPES + EIGHT_BIT_TYPES)})"
    )


def _tensor(reader: Any, name: str) -> Any:
    index = getattr(reader, "_native_tensor_index", None)
    if index is None:
        index = {t.name: t for t in reader.tensors}
        try:
            reader._native_tensor_index = index
        except AttributeError:
            pass
    if name not in index:
        raise KeyError(f"GGUF has no tensor {name!r}")
    return index[name]


def _decode_tensor(reader: Any, name: str, rows: Any = None) -> _Decoded:
    """The tensor's codes, scales and mins, of all rows or of `rows` (a slice or index array, in
    that order: a row permutation and a chunk are the same selection of whole rows' blocks)."""
    tensor = _tensor(reader, name)
    type_name = tensor.tensor_type.name
    if type_name in FLOAT_TYPES:
        raise NotQuantizedError(
            f"GGUF tensor {name!r} is {type_name}, not quantized: export it as floats (no native grid to keep)"
        )
    k, n = _linear_shape(tensor, name)
    import gguf

    qk, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    data = np.asarray(tensor.data).reshape(n, k // qk, type_size)
    data = data[rows] if rows is not None else data
    count = data.shape[0]
    codes, scale, bs, minimum, bits = _decode_blocks(type_name, data.reshape(count * (k // qk), type_size))
    return _Decoded(
        codes.reshape(count, k),
        scale.reshape(count, k // bs),
        bs,
        None if minimum is None else minimum.reshape(count, k // CORRECTION_BLOCK),
        bits,
        type_name,
    )


def _linear_shape(tensor: Any, name: str) -> tuple[int, int]:
    """(K, N) of a 2-D GGUF tensor (ggml order: ne0 = K, contiguous, first)."""
    shape = [int(s) for s in tensor.shape]
    if len(shape) != 2:
        raise ValueError(f"GGUF tensor {name!r} has shape {shape}; a linear weight is 2-D")
    return shape[0], shape[1]


def _bits_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.view(np.uint32) == b.view(np.uint32)


def _four_bit_correction(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-32-block c = fl32(min + 8 * scale), checked: fl(scale * (q - 8) + c) == fl(scale * q + min) bitwise
    for every code q of the block (ggml's own rounding). codes int [n, k] in 0..15, scale / minimum f32
    [n, k // 32]. Returns (c [n, k // 32], bool [n, k // 32]: the blocks where the check fails).

    The check passes whenever min + 8 * scale is exact in fp32 (then both sides round the same
    real number once); when it is not, a code whose result is smaller than c sees c's rounding
    error (up to half an ulp of c) unrounded. Trying the fp32 neighbours of c (up to 16 ulps)
    fixed none of 27k such blocks in random Q4_1/Q4_K data, so a failing block is reported and
    the caller gives it zero point 0 (correction = min, exact).
    """
    n, k = codes.shape
    c = (minimum.astype(np.float64) + 8.0 * scale.astype(np.float64)).astype(np.float32)
    failing = np.zeros(c.shape, bool)
    rows = max(1, (1 << 22) // k)  # bounded temporaries for large tables
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        q = codes[part].reshape(-1, k // 32, 32).astype(np.float32)
        target = scale[part, :, None] * q + minimum[part, :, None]
        base = scale[part, :, None] * (q - np.float32(8))
        failing[part] = ~_bits_equal(base + c[part, :, None], target).all(-1)
    return c, failing


def _pack(stored: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    n, k = stored.shape
    stored = stored.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(stored.reshape(n, k // block_size, block_size))
    return np.ascontiguousarray((stored[:, 0::2] | (stored[:, 1::2] << 4)).reshape(n, k // block_size, block_size // 2))


def _unpack(packed: np.ndarray, bits: int, n: int, k: int) -> np.ndarray:
    if bits == 8:
        return packed.reshape(n, k)
    flat = packed.reshape(n, k // 2)
    return np.stack([flat & 0x0F, flat >> 4], axis=-1).reshape(n, k)


def _negative_zeros(n: int, k: int) -> np.ndarray:
    return np.full((n, k // CORRECTION_BLOCK), -0.0, np.float32)


def _promote(
    p: _Decoded, bits: int, block_size: int, has_min: bool, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """One tensor at the shared bits and block size: (stored codes, scales, correction, zero points)."""
    zero_point = 1 << (bits - 1)
    scale = np.repeat(p.scale, p.block_size // block_size, axis=1) if p.block_size != block_size else p.scale
    # -0.0, not 0.0: -0.0 + w == w for every w, ggml's -0.0 products included
    minimum = p.minimum if p.minimum is not None else (_negative_zeros(p.codes.shape[0], k) if has_min else None)
    zp = np.full(scale.shape, zero_point, np.uint8)
    if bits == 8 or p.minimum is None:
        # codes are already centred for the zero point (or carry an exact min: stored unshifted)
        return p.codes + zero_point, scale, minimum, zp
    # 4-bit with a min: codes 0..15 stored as they are, correction = min + 8 * scale
    c, failing = _four_bit_correction(p.codes, p.scale, p.minimum)
    if failing.any():  # exact instead with zero point 0 and correction = min
        c = np.where(failing, p.minimum, c)
        zp[failing] = 0
    return p.codes, scale, c, zp


# the grid each GGUF type converts to: (bits, block size, has a per-block min)
TYPE_GRIDS = {
    "Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q4_K": (4, 32, True),
    "Q5_0": (8, 32, False), "Q5_1": (8, 32, True), "Q5_K": (8, 32, True),
    "Q8_0": (8, 32, False), "Q6_K": (8, 16, False),
}  # fmt: skip
CHUNK_ELEMENTS = 1 << 24  # rows are converted in chunks of about this many weights (int16 codes: 32 MB)


@dataclass(frozen=True)
class _Part:
    """One tensor of a stacked linear, read from its header: name, GGUF type, rows N, row order."""

    name: str
    type_name: str
    n: int
    rows: np.ndarray | None


def native_linear(
    reader: Any, tensor_names: list[str], row_permutations: list[np.ndarray | None] | None = None
) -> NativeLinear:
    """Convert GGUF tensors (concatenated along N, each rows permuted as W[perm]) to one NativeLinear.

    All tensors must share K. Mixed formats are promoted losslessly: bits = the widest, block
    size = the smallest (a 32-block scale repeats over two 16-blocks), and a tensor without a
    min gets a zero correction when another has one. Raises NotQuantizedError for F32/F16/BF16
    tensors and UnsupportedGGUFTypeError for other formats (Q2_K, Q3_K, IQ*...). Rows are
    converted in chunks into the preallocated result, so a 151,936-row table costs its result
    plus one chunk, not several int16 copies of itself.
    """
    parts, k = _parts(reader, tensor_names, row_permutations)
    grids = [TYPE_GRIDS[p.type_name] for p in parts]
    bits, block_size = max(g[0] for g in grids), min(g[1] for g in grids)
    has_min = any(g[2] for g in grids)
    total = sum(p.n for p in parts)
    packed = np.empty((total, k // block_size, block_size * bits // 8), np.uint8)
    scales = np.empty((total, k // block_size), np.float32)
    zero_points = np.empty((total, k // block_size), np.uint8)
    correction = np.empty((k // CORRECTION_BLOCK, total), np.float32) if has_min else None
    chunk, start = max(1, CHUNK_ELEMENTS // k), 0
    for part in parts:
        for first in range(0, part.n, chunk):
            selected = (
                np.arange(first, min(first + chunk, part.n)) if part.rows is None else part.rows[first : first + chunk]
            )
            decoded = _decode_tensor(reader, part.name, selected)
            stored, scale, corr, zp = _promote(decoded, bits, block_size, has_min, k)
            if stored.min() < 0 or stored.max() >= (1 << bits):
                raise AssertionError("internal: codes out of range for the chosen bit width")
            rows = slice(start + first, start + first + len(selected))
            packed[rows], scales[rows], zero_points[rows] = _pack(stored, bits, block_size), scale, zp
            if correction is not None:
                correction[:, rows] = corr.T
        start += part.n
    zero_point = 1 << (bits - 1)
    return NativeLinear(
        bits=bits,
        block_size=block_size,
        n=total,
        k=k,
        packed=packed,
        scales=scales,
        correction=correction,
        source_types=tuple(p.type_name for p in parts),
        zero_points=None if (zero_points == zero_point).all() else zero_points,
    )


def _parts(
    reader: Any, tensor_names: list[str], row_permutations: list[np.ndarray | None] | None
) -> tuple[list[_Part], int]:
    """The stacked tensors' types, row counts and row orders, checked, and their shared K."""
    if row_permutations is None:
        row_permutations = [None] * len(tensor_names)
    if len(row_permutations) != len(tensor_names) or not tensor_names:
        raise ValueError("native_linear needs one row permutation (or None) per tensor name")
    parts, widths = [], set()
    for name, perm in zip(tensor_names, row_permutations):
        tensor = _tensor(reader, name)
        type_name = tensor.tensor_type.name
        if type_name in FLOAT_TYPES:
            raise NotQuantizedError(
                f"GGUF tensor {name!r} is {type_name}, not quantized: export it as floats (no native grid to keep)"
            )
        if type_name not in TYPE_GRIDS:
            raise UnsupportedGGUFTypeError(
                f"GGUF type {type_name} is not supported (supported: {', '.join(FOUR_BIT_TYPES + EIGHT_BIT_TYPES)})"
            )
        k, n = _linear_shape(tensor, name)
        widths.add(k)
        if perm is not None:
            perm = np.asarray(perm)
            if sorted(perm.tolist()) != list(range(n)):
                raise ValueError(f"row permutation for {name!r} is not a permutation of its {n} rows")
        parts.append(_Part(name, type_name, n, perm))
    if len(widths) != 1:
        raise ValueError(f"tensors {tensor_names} do not share the input dimension K")
    return parts, widths.pop()


def dequantize_native(nl: NativeLinear) -> np.ndarray:
    """The fp32 weight [n, k] the graph represents: fl(fl(scale * (q - zp)) + correction), elementwise
    (q - zp and the product are exact, so the addition is the only rounding)."""
    q = _unpack(nl.packed, nl.bits, nl.n, nl.k).reshape(nl.n, nl.k // nl.block_size, nl.block_size).astype(np.float32)
    q = q - nl.block_zero_points()[..., None].astype(np.float32)
    w = (q * nl.scales[..., None]).reshape(nl.n, nl.k)
    if nl.correction is not None:
        w = (w.reshape(nl.n, nl.k // 32, 32) + nl.correction.T[..., None]).reshape(nl.n, nl.k)
    return w


# ---------------------------------------------------------------- transformers' row order


def llama_qk_row_permutation(n_rows: int, n_head: int) -> np.ndarray:
    """perm with transformers' ``_reverse_permute_weights(W, n_head)`` == W[perm] (llama.cpp's
    convert script interleaves each head's rotary halves; transformers undoes it)."""
    if n_rows % (2 * n_head):
        raise ValueError(f"{n_rows} rows do not split into {n_head} heads of two rotary halves")
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1).reshape(n_rows)


def transformers_row_permutation(reader: Any, tensor_name: str) -> np.ndarray | None:
    """The row permutation transformers' GGUF loader applies to `tensor_name` (None: rows unchanged).

    transformers (``LlamaTensorProcessor``, used for GGUF architecture "llama" only) reverses
    llama.cpp's q/k permutation: attn_q with head_count heads, attn_k with head_count_kv heads.
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama" or not (".attn_q." in tensor_name or ".attn_k." in tensor_name):
        return None
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_head_kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    if n_head is None:
        return None
    rows = int(_tensor(reader, tensor_name).shape[1])
    return llama_qk_row_permutation(rows, int(n_head if ".attn_q." in tensor_name else n_head_kv))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    if isinstance(reader, MappedGGUF):
        return reader.metadata.get(key, default)
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


# ---------------------------------------------------------------- HF <-> GGUF names

_HF_GGUF_ARCH_ALIASES = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "cohere": "command-r"}
_HF_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")
_HF_LAYER = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def hf_to_gguf_tensor_names(model_type: str, num_layers: int, tied: bool = True) -> dict[str, str]:
    """HF parameter name -> GGUF tensor name, resolved by gguf's own ``get_tensor_name_map``.

    The HF names tried are transformers' decoder names (model.embed_tokens, model.layers.{i}.
    self_attn.{q,k,v,o}_proj / q_norm / k_norm, mlp.{gate,up,down}_proj, the layer norms,
    model.norm, lm_head), each kept only where gguf maps it to a tensor of the architecture.
    With `tied`, lm_head.weight -> token_embd.weight (the GGUF stores the tied table once).
    Weights only: biases (Qwen2's q/k/v) are F32 in GGUF files and not part of the native grid.
    """
    import gguf

    name = _HF_GGUF_ARCH_ALIASES.get(model_type, model_type)
    arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == name), None)
    if arch is None:
        raise ValueError(f"gguf {gguf.__name__} knows no architecture for model_type {model_type!r}")
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    hf_names = [f"{base}.weight" for base in _HF_GLOBAL]
    hf_names += [f"model.layers.{i}.{suffix}.weight" for i in range(num_layers) for suffix in _HF_LAYER]
    result = {}
    for hf in hf_names:
        gguf_name = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            result[hf] = gguf_name
    if tied:
        result["lm_head.weight"] = result["model.embed_tokens.weight"]
    return result


# ---------------------------------------------------------------- ONNX wiring


def _zero_points(nl: NativeLinear) -> np.ndarray:
    """MatMulNBits' zero_points input: uint8 [n, ceil(blocks * bits / 8)], 4-bit ones two per byte
    (low nibble first)."""
    zp = nl.block_zero_points()
    if nl.bits == 8:
        return np.ascontiguousarray(zp)
    if zp.shape[1] % 2:
        zp = np.concatenate([zp, np.zeros((nl.n, 1), np.uint8)], axis=1)
    return np.ascontiguousarray(zp[:, 0::2] | (zp[:, 1::2] << 4))


def initializer_names(prefix: str) -> dict[str, str]:
    """Names of a NativeLinear's initializers: the same for its MatMulNBits and its GatherBlockQuantized."""
    return {
        "packed": f"{prefix}.qweight",
        "scales": f"{prefix}.scales",
        "zero_points": f"{prefix}.zero_points",
        "correction": f"{prefix}.correction",
    }


def linear_initializers(prefix: str, nl: NativeLinear) -> list[onnx.TensorProto]:
    names = initializer_names(prefix)
    inits = [numpy_helper.from_array(nl.packed, names["packed"]), numpy_helper.from_array(nl.scales, names["scales"])]
    if not nl.symmetric:
        inits.append(numpy_helper.from_array(_zero_points(nl), names["zero_points"]))
    if nl.correction is not None:
        inits.append(numpy_helper.from_array(nl.correction, names["correction"]))
    return inits


def matmul_nbits_nodes(
    x: str, out: str, prefix: str, linear: NativeLinear, accuracy_level: int, blocksum: str | None
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """out = x @ W^T for x [..., K]: MatMulNBits (implicit zero point, or an explicit zero_points
    input when linear.zero_points is set), plus ``MatMul(blocksum, correction)`` when the linear has a
    correction; `blocksum` must then name blocksum_nodes' output for `x`."""
    names = initializer_names(prefix)
    inputs = [x, names["packed"], names["scales"]] + ([] if linear.symmetric else [names["zero_points"]])
    product = out if linear.correction is None else f"{prefix}/nbits"
    nodes = [
        helper.make_node(
            "MatMulNBits",
            inputs,
            [product],
            name=f"{prefix}/MatMulNBits",
            domain=MS_DOMAIN,
            K=linear.k,
            N=linear.n,
            bits=linear.bits,
            block_size=linear.block_size,
            accuracy_level=accuracy_level,
        )
    ]
    if linear.correction is not None:
        if blocksum is None:
            raise ValueError(
                f"{prefix}: a linear with a block-sum correction ({'/'.join(linear.source_types)}) needs blocksum"
            )
        nodes.append(
            helper.make_node(
                "MatMul", [blocksum, names["correction"]], [f"{prefix}/correction_mm"], name=f"{prefix}/Correction"
            )
        )
        nodes.append(
            helper.make_node("Add", [product, f"{prefix}/correction_mm"], [out], name=f"{prefix}/AddCorrection")
        )
    return nodes, linear_initializers(prefix, linear)


def blocksum_nodes(
    x: str, out: str, k: int, prefix: str, rank: int | None = None
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """out [..., K/32] = sums of x [..., K] over each block of 32.

    Small K: ONE MatMul with a constant 0/1 block-indicator matrix [K, K/32] (any rank). In the
    fused SmolLM2 graph (K 576 and 1536: 41-295 KB) it beats Reshape + ReduceSum, whose extra
    node per activation cost 3% of a step. But the matrix grows with K squared and is read on
    every call: on the 1.5B's 8960-wide ffn_down it is 10 MB a layer, and the indicators took
    5.2 ms of a 61 ms step (Zen 4, 2 threads). So past INDICATOR_MOST_BYTES, with x's rank
    known, x is reshaped to [..., K/32, 32] (leading dims copied: shape 0) and summed. Sums of
    x * 1.0 are exact products, so the forms differ in summation order only."""
    if k % CORRECTION_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {CORRECTION_BLOCK}")
    if rank is not None and k * (k // CORRECTION_BLOCK) * 4 > INDICATOR_MOST_BYTES:
        shape_name, axis_name = f"blocksum.shape_{rank}_{k}", f"blocksum.last_axis_{rank}"
        shape = np.array([0] * (rank - 1) + [k // CORRECTION_BLOCK, CORRECTION_BLOCK], np.int64)
        nodes = [
            helper.make_node("Reshape", [x, shape_name], [f"{prefix}/blocks"], name=f"{prefix}/BlockReshape"),
            helper.make_node(
                "ReduceSum", [f"{prefix}/blocks", axis_name], [out], name=f"{prefix}/BlockSum", keepdims=0
            ),
        ]
        constants = [
            numpy_helper.from_array(shape, shape_name),
            numpy_helper.from_array(np.array([rank], np.int64), axis_name),
        ]
        return nodes, constants
    indicator = f"blocksum.indicator_{k}"
    matrix = np.kron(np.eye(k // CORRECTION_BLOCK, dtype=np.float32), np.ones((CORRECTION_BLOCK, 1), np.float32))
    inits = [numpy_helper.from_array(matrix, indicator)]
    return [helper.make_node("MatMul", [x, indicator], [out], name=f"{prefix}/BlockSum")], inits


def gather_block_quantized_nodes(
    ids: str, out: str, prefix: str, linear: NativeLinear, scope: str = "gather"
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """out [*ids.shape, K] = rows `ids` of the dequantized W [N, K] (an embedding table), read by
    com.microsoft GatherBlockQuantized from the SAME packed/scales initializers as the linear's
    MatMulNBits (names from initializer_names(prefix); add each name to the graph once).

    The packed data is used as 3-D uint8 [N, K/B, B*bits/8] with quantize_axis=2, bits=linear.bits
    and the op's default zero point 2**(bits-1); GatherBlockQuantized wants scales of the data's
    rank, so a Reshape views the [N, K/B] scales as [N, K/B, 1]. A correction, when present, is
    gathered from its [K/32, N] layout (Gather axis 1 + Transpose) and added per block of 32.
    `scope` names the nodes and values: a graph that gathers the table twice (the token embedding
    and a draft head's) gives each its own.
    """
    if not linear.symmetric:
        # GatherBlockQuantized would need its zero points as [n, k/B, 1] (one per byte), MatMulNBits
        # packs two 4-bit ones per byte: not the same initializer. No such embedding seen yet.
        raise NotImplementedError(
            "GatherBlockQuantized for a table with explicit zero points (zero_points set) is not wired"
        )
    names = initializer_names(prefix)
    ns = f"{prefix}/{scope}"  # node and value names; initializers are shared with the MatMulNBits of `prefix`
    nb = linear.k // linear.block_size
    scale_shape, flat, tail = f"{prefix}.scale_shape3d", f"{prefix}.flat", f"{prefix}.row_tail"
    inits = linear_initializers(prefix, linear) + [
        numpy_helper.from_array(np.array([linear.n, nb, 1], np.int64), scale_shape),
        numpy_helper.from_array(np.array([-1], np.int64), flat),
        numpy_helper.from_array(np.array([linear.k], np.int64), tail),
    ]
    nodes = [helper.make_node("Reshape", [names["scales"], scale_shape], [f"{ns}/scales3d"], name=f"{ns}/ScalesView")]
    gather_ids = ids
    if linear.correction is not None:
        nodes.append(helper.make_node("Reshape", [ids, flat], [f"{ns}/flat_ids"], name=f"{ns}/FlatIds"))
        gather_ids = f"{ns}/flat_ids"
    nodes.append(
        helper.make_node(
            "GatherBlockQuantized",
            [names["packed"], gather_ids, f"{ns}/scales3d"],
            [f"{ns}/rows3d"],
            name=f"{ns}/GatherBlockQuantized",
            domain=MS_DOMAIN,
            bits=linear.bits,
            block_size=linear.block_size,
            gather_axis=0,
            quantize_axis=2,
        )
    )
    rows = f"{ns}/rows3d"
    if linear.correction is not None:
        correction_nodes, correction_inits, rows = _gathered_correction(prefix, linear, rows, gather_ids, scope)
        nodes += correction_nodes
        inits += correction_inits
    nodes += [
        helper.make_node("Shape", [ids], [f"{ns}/ids_shape"], name=f"{ns}/IdsShape"),
        helper.make_node("Concat", [f"{ns}/ids_shape", tail], [f"{ns}/out_shape"], name=f"{ns}/OutShape", axis=0),
        helper.make_node("Reshape", [rows, f"{ns}/out_shape"], [out], name=f"{ns}/Rows"),
    ]
    return nodes, inits


def _gathered_correction(
    prefix: str, linear: NativeLinear, rows: str, gather_ids: str, scope: str = "gather"
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """Nodes adding the gathered rows' correction (from its [K/32, N] layout) per block of 32 to
    `rows`; returns them, their initializer and the corrected rows' name."""
    names = initializer_names(prefix)
    ns = f"{prefix}/{scope}"
    c32 = f"{prefix}.corr_shape"
    inits = [numpy_helper.from_array(np.array([-1, linear.k // 32, 32], np.int64), c32)]
    nodes = [
        helper.make_node("Reshape", [rows, c32], [f"{ns}/rows32"], name=f"{ns}/Rows32"),
        helper.make_node(
            "Gather", [names["correction"], gather_ids], [f"{ns}/corr_t"], name=f"{ns}/GatherCorrection", axis=1
        ),
        helper.make_node("Transpose", [f"{ns}/corr_t"], [f"{ns}/corr"], name=f"{ns}/CorrT", perm=[1, 0]),
        helper.make_node("Unsqueeze", [f"{ns}/corr", f"{prefix}.flat"], [f"{ns}/corr3d"], name=f"{ns}/CorrUnsq"),
        helper.make_node("Add", [f"{ns}/rows32", f"{ns}/corr3d"], [f"{ns}/rows_corr"], name=f"{ns}/AddCorrection"),
    ]
    return nodes, inits, f"{ns}/rows_corr"


def unique_initializers(inits: list[onnx.TensorProto]) -> list[onnx.TensorProto]:
    """Drop repeated initializer names (a tied embedding + LM head emit the same weights twice)."""
    seen: set[str] = set()
    return [i for i in inits if not (i.name in seen or seen.add(i.name))]


__all__ = [
    "NativeLinear",
    "NotQuantizedError",
    "UnsupportedGGUFTypeError",
    "native_linear",
    "dequantize_native",
    "llama_qk_row_permutation",
    "transformers_row_permutation",
    "hf_to_gguf_tensor_names",
    "matmul_nbits_nodes",
    "blocksum_nodes",
    "gather_block_quantized_nodes",
    "initializer_names",
    "linear_initializers",
    "unique_initializers",
]
