"""One linear of a packaged model per GGUF type: MatMulPacked over its rows against MatMulNBits
over the same weights (the bundle's two weight forms), at T activation rows.

    python -m benchmarks.packed_linear [--model qwen2.5-coder-0.5b] [--threads 2] [--rows 1,2,4,8,16,256]

For each ggml type in the model's file, its largest 2-D tensor becomes two one-node graphs:
MatMulNBits (exporter/gguf_native.py's form: plus the block-sum correction where the format has
mins) and the project's MatMulPacked (kernels/). Both at accuracy 4 (int8 activations, the default
build) and 1 (fp32). Runs are interleaved in rounds, medians reported, with the bytes each form
reads per call, the CPU and the kernels' instruction set.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks.common import bench_parser, cpu_model, parse_and_pin, print_table
from benchmarks.gguf_native_linear import linear_session


def build_parser() -> Any:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a packaged model name")
    parser.add_argument("--rows", default="1,2,4,8,16,256", help="activation rows T, comma-separated")
    parser.add_argument("--seconds", type=float, default=0.6, help="timed seconds per contender, T and round")
    parser.add_argument("--rounds", type=int, default=5)
    return parser


def largest_tensor_per_type(reader: Any) -> dict[str, Any]:
    from adaptive_export.runtimes.packed_ops import TYPE_IDS

    best: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name in TYPE_IDS and len(tensor.shape) == 2:
            if name not in best or int(np.prod(tensor.shape)) > int(np.prod(best[name].shape)):
                best[name] = tensor
    return best


def forms(reader: Any, tensor: Any, level: int) -> dict[str, tuple[list, list, int]]:
    """(nodes, initializers, bytes read per call) of each weight form of `tensor`."""
    from onnx import helper, numpy_helper

    from adaptive_export.exporter import gguf_native as gn
    from adaptive_export.runtimes.packed_ops import PACKED_DOMAIN, TYPE_IDS

    k, n = (int(s) for s in tensor.shape)
    nl = gn.native_linear(reader, [tensor.name], [None])
    nodes, inits = gn.matmul_nbits_nodes("x", "y", "w", nl, level, "x_bs" if nl.correction is not None else None)
    if nl.correction is not None:
        sums, sum_inits = gn.blocksum_nodes("x", "x_bs", k, "bs", rank=3)
        nodes, inits = sums + nodes, sum_inits + inits
    nbits_bytes = sum(numpy_helper.to_array(i).nbytes for i in inits if not i.name.startswith("blocksum"))
    rows = np.asarray(tensor.data).reshape(n, -1)
    packed = helper.make_node(
        "MatMulPacked",
        ["x", "rows"],
        ["y"],
        domain=PACKED_DOMAIN,
        packed_type=TYPE_IDS[tensor.tensor_type.name],
        K=k,
        N=n,
        accuracy_level=level,
    )
    return {
        "MatMulNBits": (nodes, inits, nbits_bytes),
        "MatMulPacked": ([packed], [numpy_helper.from_array(np.ascontiguousarray(rows), "rows")], rows.nbytes),
    }


def time_interleaved(sessions: dict[str, Any], x: np.ndarray, seconds: float, rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for sess in sessions.values():
        sess.run(None, {"x": x})
    for _ in range(rounds):
        for name, sess in sessions.items():
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                sess.run(None, {"x": x})
                samples[name].append(time.perf_counter() - start)
    return {name: float(np.median(s)) * 1e3 for name, s in samples.items()}


def main() -> None:
    args = parse_and_pin(build_parser())
    from adaptive_export.loading.gguf_tensors import MappedGGUF
    from adaptive_export.loading.packaged import PACKAGED
    from adaptive_export.runtimes.packed_ops import kernel_isa

    reader = MappedGGUF(PACKAGED[args.model].gguf_path())
    rows_list = [int(r) for r in args.rows.split(",")]
    table = []
    rng = np.random.default_rng(0)
    for type_name, tensor in sorted(largest_tensor_per_type(reader).items()):
        k, n = (int(s) for s in tensor.shape)
        for level in (4, 1):
            built = forms(reader, tensor, level)
            sessions = {
                name: linear_session(nodes, inits, k, args.threads, True) for name, (nodes, inits, _) in built.items()
            }
            for t in rows_list:
                x = rng.standard_normal((1, t, k)).astype(np.float32)
                ms = time_interleaved(sessions, x, args.seconds, args.rounds)
                table.append(
                    {
                        "type": type_name,
                        "tensor": f"{tensor.name} {k}x{n}",
                        "accuracy": level,
                        "T": t,
                        "MB nbits/packed": f"{built['MatMulNBits'][2] / 1e6:.1f}/{built['MatMulPacked'][2] / 1e6:.1f}",
                        "nbits ms": f"{ms['MatMulNBits']:.3f}",
                        "packed ms": f"{ms['MatMulPacked']:.3f}",
                        "packed/nbits": f"{ms['MatMulPacked'] / ms['MatMulNBits']:.2f}",
                    }
                )
    print(f"{cpu_model()}, {args.threads} threads, kernels {kernel_isa()}, model {args.model}")
    print_table(table, list(table[0]))


if __name__ == "__main__":
    main()
