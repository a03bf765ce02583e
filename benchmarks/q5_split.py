"""A Q5_0 linear of Qwen2.5-Coder-0.5B as MatMulNBits: 8-bit codes (today's bundle) against an
exact split into a 4-bit MatMulNBits of the low bits plus a 2-bit one of the high bit (issue #36 item 3).

    python -m benchmarks.q5_split [--tensor blk.0.ffn_gate.weight] [--threads 2] [--tokens 1]

A Q5_0 weight is d * (q - 16) with q = lo + 16 * hi (lo 4 bits, hi 1 bit, d the block's fp16
scale). So x @ W^T = MatMulNBits4(lo; scale d, zero point 8) + MatMulNBits2(c = 2 * hi + 1;
scale 8d, zero point 2), both exact: d * (lo - 8) + 8d * (2 * hi - 1) = d * (q - 16). Bytes per
weight with fp32 scales: 8-bit 8 + 1 = 9; the split 4 + 1 + 2 + 1 = 8; the GGUF 5.5.
Reports median microseconds per run (contenders interleaved) and the max relative error against
x @ W^T with W the GGUF's own dequantized weights, at accuracy levels 1 and 4, for 1 and 2 rows.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from benchmarks.common import pin_threads, print_table
from benchmarks.gguf_native_linear import linear_session, time_sessions

BLOCK = 32


def q5_0_codes(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, K] in 0..31, d [N, K/32] float32) of a Q5_0 tensor's raw blocks."""
    rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 22)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    qh = blocks[:, 2:6].copy().view(np.uint32)[:, 0]
    qs = blocks[:, 6:22]
    lo = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    hi = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = lo | (hi << 4)
    return q.reshape(rows, -1), d.reshape(rows, -1)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B: [N, K/32, 32 * bits / 8], low bits first within each byte."""
    n, k = codes.shape
    per_byte = 8 // bits
    grouped = codes.reshape(n, k // BLOCK, BLOCK // per_byte, per_byte).astype(np.uint8)
    shifts = (np.arange(per_byte) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


def nbits_node(name: str, out: str, k: int, n: int, bits: int, level: int) -> Any:
    from onnx import helper

    return helper.make_node(
        "MatMulNBits",
        ["x", f"{name}.q", f"{name}.s"],
        [out],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=BLOCK,
        accuracy_level=level,
    )


def contenders(q: np.ndarray, d: np.ndarray, level: int) -> dict[str, tuple[list, list]]:
    from onnx import helper, numpy_helper

    n, k = q.shape
    eight = [numpy_helper.from_array(pack(q + 112, 8), "w8.q"), numpy_helper.from_array(d, "w8.s")]
    low, high = q & 0x0F, 2 * (q >> 4) + 1
    split = [
        numpy_helper.from_array(pack(low, 4), "lo.q"),
        numpy_helper.from_array(d, "lo.s"),
        numpy_helper.from_array(pack(high, 2), "hi.q"),
        numpy_helper.from_array((8 * d).astype(np.float32), "hi.s"),
    ]
    split_nodes = [
        nbits_node("lo", "y_lo", k, n, 4, level),
        nbits_node("hi", "y_hi", k, n, 2, level),
        helper.make_node("Add", ["y_lo", "y_hi"], ["y"]),
    ]
    return {
        "8-bit codes (today)": ([nbits_node("w8", "y", k, n, 8, level)], eight),
        "4-bit low + 2-bit high (exact split)": (split_nodes, split),
        "4-bit low alone (timing only, wrong)": ([nbits_node("lo", "y", k, n, 4, level)], split[:2]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", default="blk.0.ffn_gate.weight", help="a Q5_0 tensor of the 0.5B GGUF")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1, help="activation rows T")
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    pin_threads(args.threads)
    import gguf

    from adaptive_export.loading.packaged import PACKAGED

    reader = gguf.GGUFReader(PACKAGED["qwen2.5-coder-0.5b"].gguf_path())
    tensor = next(t for t in reader.tensors if t.name == args.tensor)
    if tensor.tensor_type != gguf.GGMLQuantizationType.Q5_0:
        raise SystemExit(f"{args.tensor} is {tensor.tensor_type.name}: pick a Q5_0 tensor")
    q, d = q5_0_codes(tensor)
    w = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(q.shape)
    assert np.array_equal(w, np.repeat(d, BLOCK, axis=1) * (q.astype(np.float32) - 16)), "decoded codes"
    x = np.random.default_rng(0).standard_normal((1, args.tokens, q.shape[1])).astype(np.float32)
    reference = x.astype(np.float64) @ w.astype(np.float64).T
    rows = []
    for level in (1, 4):
        forms = contenders(q, d, level)
        sessions = {
            name: linear_session(nodes, inits, q.shape[1], args.threads) for name, (nodes, inits) in forms.items()
        }
        samples = time_sessions(sessions, x, args.runs, args.rounds)
        for name, sess in sessions.items():
            y = sess.run(None, {"x": x})[0]
            error = float(np.abs(y - reference).max() / np.abs(reference).max())
            rows.append(
                {
                    "accuracy": level,
                    "form": name,
                    "median_us": float(np.median(samples[name]) * 1e6),
                    "max_rel_error": error,
                }
            )
    print(f"{args.tensor} ({q.shape[0]}x{q.shape[1]}, Q5_0), T={args.tokens}, {args.threads} threads")
    print_table(rows, ["accuracy", "form", "median_us", "max_rel_error"])


if __name__ == "__main__":
    main()
