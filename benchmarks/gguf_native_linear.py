"""One SmolLM2 Q4_1 linear as MatMulNBits, exact and not: what the block-sum correction costs.

    python -m benchmarks.gguf_native_linear [--tensor blk.0.ffn_gate.weight] [--threads 2] [--tokens 1]

Contenders (each a one-linear ONNX graph, x [1, T, K]):
  symmetric, no correction   the fast kernel alone: wrong for Q4_1 (its mins are dropped)
  symmetric + block sums     MatMulNBits(x) + blocksum(x) @ (m + 8d), exporter/gguf_native.py's form
  uint8 zero point 0 + sums  explicit zero points (gguf_native's exactness fallback)
  float zero points          z = -m/d as float zero points: exact, no fast kernel
Reports median / p10 microseconds per run and the max relative error against x @ W^T with W
the GGUF's own dequantized weights, at accuracy levels 1 (fp32) and 4 (int8 activations).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np

from benchmarks.common import pin_threads, print_table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", default="blk.0.ffn_gate.weight", help="a Q4_1 tensor of the SmolLM2 GGUF")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1, help="activation rows T")
    parser.add_argument("--runs", type=int, default=4000, help="timed runs per contender (float zero points: a tenth)")
    parser.add_argument("--rounds", type=int, default=20)
    return parser


def linear_session(nodes: list, inits: list, k: int, threads: int, packed_ops: bool = False) -> Any:
    """An ONNX Runtime session of a one-linear graph x [1, T, k] -> y (with `packed_ops`, the
    package's MatMulPacked/GatherPacked domain imported and its op library registered)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from adaptive_export.exporter import gguf_native as gn

    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=gn.unique_initializers(inits),
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(gn.MS_DOMAIN, 1)]
    options = ort.SessionOptions()
    if packed_ops:
        from adaptive_export.runtimes.packed_ops import PACKED_DOMAIN, require_library

        opsets.append(helper.make_opsetid(PACKED_DOMAIN, 1))
        options.register_custom_ops_library(str(require_library()))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def contender_graphs(nl: Any, zp0: Any, float_zp: np.ndarray, level: int) -> dict[str, tuple[list, list]]:
    """(nodes, initializers) of each form of the linear at this accuracy level."""
    from onnx import helper, numpy_helper

    from adaptive_export.exporter import gguf_native as gn

    bs_nodes, bs_inits = gn.blocksum_nodes("x", "x_bs", nl.k, "bs")
    plain = gn.matmul_nbits_nodes("x", "y", "w", dataclasses.replace(nl, correction=None), level, None)
    exact = gn.matmul_nbits_nodes("x", "y", "w", nl, level, "x_bs")
    zero = gn.matmul_nbits_nodes("x", "y", "w", zp0, level, "x_bs")
    float_node = helper.make_node(
        "MatMulNBits",
        ["x", "w.qweight", "w.scales", "zpf"],
        ["y"],
        domain=gn.MS_DOMAIN,
        K=nl.k,
        N=nl.n,
        bits=4,
        block_size=32,
        accuracy_level=level,
    )
    return {
        "symmetric, no correction": plain,
        "symmetric + block sums": (bs_nodes + exact[0], bs_inits + exact[1]),
        "uint8 zero point 0 + sums": (bs_nodes + zero[0], bs_inits + zero[1]),
        "float zero points": ([float_node], plain[1] + [numpy_helper.from_array(float_zp, "zpf")]),
    }


def time_sessions(sessions: dict[str, Any], x: np.ndarray, runs: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per run of each session, after 200 warm-up runs each."""
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for sess in sessions.values():
        for _ in range(200):
            sess.run(None, {"x": x})
    # contenders interleaved in rounds, so load from other jobs hits them alike
    for _ in range(rounds):
        for name, sess in sessions.items():
            per_round = runs // rounds if "float" not in name else max(runs // rounds // 10, 5)
            for _ in range(per_round):
                start = time.perf_counter()
                sess.run(None, {"x": x})
                samples[name].append(time.perf_counter() - start)
    return samples


def main() -> None:
    args = build_parser().parse_args()
    pin_threads(args.threads)

    import gguf

    from adaptive_export.exporter import gguf_native as gn
    from adaptive_export.loading.model import smollm2_gguf_path

    reader = gguf.GGUFReader(smollm2_gguf_path())
    nl = gn.native_linear(reader, [args.tensor], [None])
    if nl.correction is None or nl.bits != 4:
        raise SystemExit(f"{args.tensor} is {nl.source_types[0]}: pick a Q4_1 tensor")
    w = gn.dequantize_native(nl)
    x = np.random.default_rng(0).standard_normal((1, args.tokens, nl.k)).astype(np.float32)
    reference = x.astype(np.float64) @ w.astype(np.float64).T
    minimum = nl.correction.T - 8 * nl.scales  # approximately m: timing only, the error column says how close
    zp0 = dataclasses.replace(
        nl,
        zero_points=np.zeros(nl.scales.shape, np.uint8),
        correction=np.ascontiguousarray(minimum.T, dtype=np.float32),
    )
    float_zp = (-minimum / nl.scales).astype(np.float32)
    rows = []
    for level in (1, 4):
        contenders = contender_graphs(nl, zp0, float_zp, level)
        sessions = {
            name: linear_session(nodes, inits, nl.k, args.threads) for name, (nodes, inits) in contenders.items()
        }
        samples = time_sessions(sessions, x, args.runs, args.rounds)
        for name, sess in sessions.items():
            y = sess.run(None, {"x": x})[0]
            error = float(np.abs(y - reference).max() / np.abs(reference).max())
            times = np.array(samples[name])
            rows.append(
                {
                    "accuracy": level,
                    "form": name,
                    "median us": f"{np.median(times) * 1e6:.1f}",
                    "p10 us": f"{np.percentile(times, 10) * 1e6:.1f}",
                    "max rel. error": f"{error:.1e}",
                }
            )
    print(f"{args.tensor}: N={nl.n} K={nl.k} T={args.tokens} threads={args.threads}")
    print_table(rows, ["accuracy", "form", "median us", "p10 us", "max rel. error"])


if __name__ == "__main__":
    main()
