"""How fast plain decoding can be: the bytes one step reads, against the machine's read bandwidth.

A one-row decode step of a 0.5-3B model multiplies one activation row by every weight matrix, so it
reads every weight byte once and does little arithmetic per byte: its time is bounded below by
(bytes read) / (read bandwidth). This script counts those bytes for a bundle's decode engine (every
initializer it reads whole; tables it only gathers rows from, the embedding and rotary caches,
left out) and for the GGUF the bundle was built from, as llama.cpp reads it (every tensor but
an untied token_embd), measures the machine's read bandwidth (numpy sums over 1 GiB per thread,
best of several), and prints each one's floor. Given a peers JSON from the same machine
(`benchmarks/peers.py --json`), it adds the plain decoders' measured TPOT (llama.cpp, and bundles
run `@ar/1`) and the share of the bandwidth each reaches.

    python -m benchmarks.bandwidth_floor --bundle /tmp/b15 --model qwen2.5-coder-1.5b --peers peers.json

What it answers (issue #36): whether a TPOT target is reachable with the bytes a format stores.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx.external_data_helper import ExternalDataInfo

from benchmarks.common import bench_parser, cpu_model, parse_and_pin, print_table

GIB = 1 << 30
# ops that read a few rows of a table per token, not the whole table
_GATHERS = ("Gather", "GatherBlockQuantized", "GatherPacked", "GatherElements", "GatherND")
_RESHAPES = ("Reshape", "Unsqueeze", "Squeeze", "Flatten")


@dataclass(frozen=True)
class StepBytes:
    """What one decode step reads: the weight bytes and how many tensors hold them."""

    name: str
    bytes_read: int
    tensors: int


def bundle_step_bytes(bundle: Path, engine: str = "decode_full") -> StepBytes:
    """The decode engine's initializers read whole by a T=1 step, the engine read as the runtime
    reads a bundle's files (manifest validated, paths confined, sizes and the engine's sha256 checked)."""
    from adaptive_export.runtimes import limits
    from adaptive_export.runtimes.bundle import load_bundle, read_listed

    loaded = load_bundle(bundle, verify="size")
    file = str(loaded.backend_entry("onnx").graphs[engine].file)
    graph = onnx.load_from_string(read_listed(loaded, file, limits.MAX_ENGINE_BYTES)).graph
    total, count = engine_step_bytes(graph)
    return StepBytes(f"bundle {engine} engine", total, count)


def engine_step_bytes(graph: onnx.GraphProto) -> tuple[int, int]:
    """(bytes, tensors) of the graph's initializers that a pass reads whole."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    total, count = 0, 0
    for init in graph.initializer:
        ops = _terminal_ops(init.name, consumers)
        if not ops or ops <= set(_GATHERS):
            continue  # unused, or only rows of it are gathered
        total += _initializer_bytes(init)
        count += 1
    return total, count


def _terminal_ops(value: str, consumers: dict[str, list[onnx.NodeProto]]) -> set[str]:
    """The ops that read `value`, looking through reshapes (an embedding's scales reach a Gather so)."""
    ops: set[str] = set()
    for node in consumers.get(value, []):
        if node.op_type in _RESHAPES and node.input[0] == value:
            ops |= _terminal_ops(node.output[0], consumers)
        else:
            ops.add(node.op_type)
    return ops


def _initializer_bytes(init: onnx.TensorProto) -> int:
    if init.data_location == onnx.TensorProto.EXTERNAL:
        try:
            return int(ExternalDataInfo(init).length)
        except ValueError:
            raise ValueError(f"initializer {init.name[:80]!r} records an external length that is no number") from None
    return len(init.raw_data) or onnx.numpy_helper.to_array(init).nbytes


def gguf_step_bytes(gguf_path: Path) -> StepBytes:
    """The GGUF's tensor bytes a llama.cpp step reads: all but token_embd where an output head exists."""
    from adaptive_export.loading.gguf_fast_reader import ArrayFastReader

    reader = ArrayFastReader(str(gguf_path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)  # untied: only one row per token is read
    return StepBytes("GGUF (llama.cpp)", sum(sizes.values()), len(sizes))


def read_bandwidth(threads: int, repeat: int = 5) -> float:
    """Best bytes/s of `threads` threads each summing its own 1 GiB float32 array (numpy releases the GIL)."""
    arrays = [np.ones(GIB // 4, dtype=np.float32) for _ in range(threads)]
    best = 0.0
    for _ in range(repeat):
        workers = [threading.Thread(target=a.sum) for a in arrays]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, threads * GIB / (time.perf_counter() - start))
    return best


def plain_tpots(path: Path) -> dict[str, float]:
    """Contender -> median TPOT ms of the peers JSON's plain decoders: llama.cpp, and bundles run
    with `--mode ar` on one row (a speculating contender reads the weights fewer times per token)."""
    rows = json.loads(path.read_text())["rows"]
    return {
        row["contender"]: float(row["tpot_ms"])
        for row in rows
        if row.get("tpot_ms") and (row["contender"] == "llama.cpp" or "--mode ar/1" in row.get("note", ""))
    }


def main() -> None:
    parser = bench_parser(
        __doc__,
        threads_help="threads that read memory in the bandwidth measure (default: 2, the peers runs' count)",
        bundle="bundle directory whose decode engine is counted",
    )
    parser.add_argument("--model", required=True, help="packaged name or .gguf the bundle was built from")
    parser.add_argument("--peers", type=Path, help="a peers.py --json file from this machine: adds measured TPOTs")
    args = parse_and_pin(parser)
    from adaptive_export.loading.model import resolve_model_path
    from adaptive_export.runtimes.errors import UsageError

    folder, gguf_name = resolve_model_path(args.model)
    if gguf_name is None:
        parser.error(f"{args.model} is no .gguf: nothing to compare the bundle's bytes with")
    gguf = folder / gguf_name
    try:
        counted = [gguf_step_bytes(gguf), bundle_step_bytes(Path(args.bundle))]
    except UsageError as exc:
        parser.error(f"{exc.problem}. Fix: {exc.fix}")
    except ValueError as exc:
        parser.error(f"{args.bundle}: {exc}. Fix: rebuild the bundle")
    bandwidth = read_bandwidth(args.threads)
    base = counted[0].bytes_read
    rows = [
        {
            "reads": c.name,
            "tensors": c.tensors,
            "MB per step": round(c.bytes_read / 1e6, 1),
            "x GGUF": round(c.bytes_read / base, 3),
            "floor ms": round(c.bytes_read / bandwidth * 1e3, 2),
        }
        for c in counted
    ]
    print(f"{cpu_model()}, {args.threads} threads: read bandwidth {bandwidth / 1e9:.1f} GB/s (numpy sums, best of 5)")
    print_table(rows, list(rows[0]))
    if args.peers:
        _print_measured(plain_tpots(args.peers), counted, bandwidth)


def _print_measured(tpots: dict[str, float], counted: list[StepBytes], bandwidth: float) -> None:
    """Each contender's TPOT against the floor of the bytes it reads (llama.cpp: the GGUF's)."""
    rows = []
    for name, tpot in tpots.items():
        step = counted[0] if name == "llama.cpp" else counted[1]
        reached = step.bytes_read / (tpot / 1e3)
        rows.append(
            {
                "contender": name,
                "TPOT ms": tpot,
                "reads": step.name,
                "GB/s reached": round(reached / 1e9, 1),
                "share of bandwidth": round(reached / bandwidth, 2),
            }
        )
    if rows:
        print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
