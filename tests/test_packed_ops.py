"""The engine op library (kernels/): MatMulPacked and GatherPacked over GGUF rows, run by the
installed onnxruntime through the library's own declarations of its C API.

Every format is checked against gguf's dequantization on random and extreme blocks in both
activation modes, on each instruction-set path this CPU has (generic, AVX2, AVX-512 VNNI); the
fp32 mode against the dequantized model, the int8 mode against the same quantization of the
activations done in numpy. Hostile shapes, truncated rows and unknown types run in a child
process: each must be an ONNX Runtime error, never a crash."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from adaptive_export.runtimes import packed_ops  # noqa: E402
from tests.test_gguf_native import FP16_FIELDS, random_blocks  # noqa: E402

ROOT = Path(__file__).parents[1]
FORMATS = [name for _, (name, *_) in sorted(packed_ops.GGML_TYPES.items())]
LIBRARY = packed_ops.library_path()
needs_library = pytest.mark.skipif(
    LIBRARY is None,
    reason="the package was built without its C++ op library (pip install -e . with a C++ compiler builds it)",
)


def matmul_model(type_id: int, k: int, n: int, accuracy: int, **extra: object) -> bytes:
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, None)
    b = helper.make_tensor_value_info("B", TensorProto.UINT8, None)
    attributes = {"packed_type": type_id, "K": k, "N": n, "accuracy_level": accuracy, **extra}
    node = helper.make_node("MatMulPacked", ["A", "B"], ["Y"], domain=packed_ops.PACKED_DOMAIN, **attributes)
    graph = helper.make_graph([node], "g", [a, b], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(packed_ops.PACKED_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def gather_model(type_id: int, k: int, index_type: int = TensorProto.INT64) -> bytes:
    data = helper.make_tensor_value_info("data", TensorProto.UINT8, None)
    ids = helper.make_tensor_value_info("ids", index_type, None)
    node = helper.make_node(
        "GatherPacked", ["data", "ids"], ["Y"], domain=packed_ops.PACKED_DOMAIN, packed_type=type_id, K=k
    )
    graph = helper.make_graph([node], "g", [data, ids], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(packed_ops.PACKED_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(LIBRARY))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def dequantized(type_name: str, rows: np.ndarray, k: int) -> np.ndarray:
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[type_name]).reshape(len(rows), k)


def extreme_blocks(rng: np.random.Generator, type_name: str, n: int, k: int) -> np.ndarray:
    """Every code at its largest or smallest value, fp16 scales subnormal, zero, negative or near
    fp16's largest (65504): the ends of each field's range."""
    rows = random_blocks(rng, type_name, n, k)
    qk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rows.reshape(-1, size)
    codes = np.setdiff1d(np.arange(size), [o + i for o in FP16_FIELDS[type_name] for i in (0, 1)])
    blocks[0::2, codes] = 0xFF
    blocks[1::2, codes] = 0x00
    scales = np.array([6e-8, -6e-8, 0.0, -0.0, 1e-3, -2.5, 60000.0, -60000.0], np.float16)
    for offset in FP16_FIELDS[type_name]:
        picked = scales[rng.integers(0, len(scales), len(blocks))]
        blocks[:, offset : offset + 2] = picked.reshape(-1, 1).view(np.uint8)
    return blocks.reshape(n, -1)


def int8_reference(type_name: str, weights: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 mode's definition in numpy: x quantized per block of 32 (per 256 for K-quants) to
    round(x / d), d = max |x| / 127 in fp32, times the dequantized weights in float64.
    Returns (reference, the bound its float rounding may reach)."""
    block = 256 if type_name.endswith("_K") else 32
    t, k = x.shape
    blocks = x.reshape(t, k // block, block).astype(np.float32)
    scale = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse)  # ties to even, as the kernel's nearbyint
    xq = (q.astype(np.float64) * scale).reshape(t, k)
    w = weights.astype(np.float64)
    return xq @ w.T, np.abs(xq) @ np.abs(w).T


FLOAT_PANEL_ROWS = 32  # kernels/packed_matmul.h kFloatPanelRows


def fp32_panels(type_name: str, rows: int) -> bool:
    """Whether the int8 mode computes this pass in fp32 (packed_matmul.h uses_float_panels):
    passes of 32 rows or more of a 32-element format, on the SIMD paths."""
    return rows >= FLOAT_PANEL_ROWS and not type_name.endswith("_K") and kernel_isa() != "generic"


def check_formats(k_values: tuple[int, ...] = (256, 768), rows: tuple[int, ...] = (1, 2, 3, 4, 5, 9, 16, 33)) -> str:
    """Every format, both modes, random and extreme blocks, each T in `rows`; raises on a mismatch.
    Run in this process for the widest kernels, and by the ISA tests in a child with
    ADAPTIVE_EXPORT_KERNEL_ISA set. Returns a summary line."""
    rng = np.random.default_rng(7)
    checked = 0
    for type_name in FORMATS:
        type_id = packed_ops.TYPE_IDS[type_name]
        for k in k_values:
            n = 37
            for blocks in (random_blocks(rng, type_name, n, k), extreme_blocks(rng, type_name, n, k)):
                w = dequantized(type_name, blocks, k)
                for accuracy in packed_ops.ACCURACY_LEVELS:
                    sess = session(matmul_model(type_id, k, n, accuracy))
                    for t in rows:
                        x = rng.standard_normal((1, t, k)).astype(np.float32)
                        x[0, 0, :32] = 0.0  # an all-zero activation block (scale 0)
                        y = sess.run(None, {"A": x, "B": blocks})[0]
                        assert y.shape == (1, t, n)
                        if accuracy == 1 or fp32_panels(type_name, t):
                            reference = x[0].astype(np.float64) @ w.astype(np.float64).T
                            bound = np.abs(x[0]).astype(np.float64) @ np.abs(w.astype(np.float64)).T
                        else:
                            reference, bound = int8_reference(type_name, w, x[0])
                        error = np.abs(y[0] - reference)
                        worst = float((error / (bound * 1e-5 + 1e-30)).max())
                        assert worst <= 1.0, f"{type_name} K={k} T={t} accuracy {accuracy}: {worst:.2f}x the bound"
                        checked += 1
    return f"{checked} cases on {kernel_isa()}"


def kernel_isa() -> str:
    isa = packed_ops.kernel_isa()
    assert isa is not None
    return isa


def run_child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_library_is_the_installed_package_file() -> None:
    if LIBRARY is None:
        assert os.environ.get("CI") != "true", "CI builds the package with a compiler: the op library must exist"
        pytest.skip("the package was built without its C++ op library (pip install -e . with a C++ compiler builds it)")
    import importlib.util

    package = importlib.util.find_spec("adaptive_export.kernels")
    assert package is not None and package.submodule_search_locations is not None
    assert LIBRARY.parent.resolve() in [Path(p).resolve() for p in package.submodule_search_locations]
    assert LIBRARY.name.startswith("_packed_ops")


@needs_library
def test_every_format_matches_gguf_dequantization_on_the_widest_kernels() -> None:
    assert "cases" in check_formats()


@needs_library
@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_every_format_matches_on_the_narrower_paths(isa: str) -> None:
    """The same checks with the kernels capped at `isa` (each path this CPU can run)."""
    child = run_child(
        "from tests.test_packed_ops import check_formats; print(check_formats(rows=(1, 2, 5, 40)))",
        ADAPTIVE_EXPORT_KERNEL_ISA=isa,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    summary = child.stdout.strip().splitlines()[-1]
    best = kernel_isa()
    expected = "avx2" if isa == "avx2" and best in ("avx2", "avx512-vnni") else "generic"
    assert summary.endswith(f"on {expected}"), summary


@needs_library
@pytest.mark.parametrize("type_name", FORMATS)
def test_gather_returns_the_dequantized_rows_exactly(type_name: str) -> None:
    rng = np.random.default_rng(3)
    k, n = 512, 40
    table = random_blocks(rng, type_name, n, k)
    w = dequantized(type_name, table, k)
    for index_type, dtype in ((TensorProto.INT64, np.int64), (TensorProto.INT32, np.int32)):
        ids = np.array([[0, 39, 5], [-1, 7, -40]], dtype)
        y = session(gather_model(packed_ops.TYPE_IDS[type_name], k, index_type)).run(None, {"data": table, "ids": ids})[
            0
        ]
        assert y.shape == (2, 3, k)
        assert np.array_equal(y.view(np.uint32), w[ids].view(np.uint32))


@needs_library
def test_threads_do_not_change_the_result() -> None:
    rng = np.random.default_rng(5)
    k, n = 1024, 300
    rows = random_blocks(rng, "Q4_K", n, k)
    x = rng.standard_normal((1, 6, k)).astype(np.float32)
    for accuracy in packed_ops.ACCURACY_LEVELS:
        model = matmul_model(packed_ops.TYPE_IDS["Q4_K"], k, n, accuracy)
        one, two = (session(model, threads).run(None, {"A": x, "B": rows})[0] for threads in (1, 2))
        assert np.array_equal(one, two)


HOSTILE = """
import numpy as np
from onnx import TensorProto
from tests.test_packed_ops import matmul_model as mm, gather_model as gm, session, random_blocks

rng = np.random.default_rng(0)
good = random_blocks(rng, "Q4_K", 8, 512)  # 8 rows of 288 bytes
x = np.ones((1, 2, 512), np.float32)
ids = lambda *values: np.array(values, np.int64)  # noqa: E731
cases = {  # name: (what the error must say, model, feeds)
    "truncated rows": ("[8, 287], expected [8, 288]", mm(12, 512, 8, 4), {"A": x, "B": good[:, :-1].copy()}),
    "a longer row": ("[8, 289], expected [8, 288]", mm(12, 512, 8, 1), {"A": x, "B": np.zeros((8, 289), np.uint8)}),
    "fewer rows than N": ("[7, 288], expected [8, 288]", mm(12, 512, 8, 4), {"A": x, "B": good[:7].copy()}),
    "A narrower than K": ("A must be float [..., 512]", mm(12, 512, 8, 4), {"A": x[..., :256].copy(), "B": good}),
    "a 3-D B": ("B must be a 2-D uint8 tensor", mm(12, 512, 8, 4), {"A": x, "B": good.reshape(2, 4, 288)}),
    "a 1-D B": ("B must be a 2-D uint8 tensor", mm(12, 512, 8, 4), {"A": x, "B": good.reshape(-1)}),
    "a scalar A": ("A must be float [..., 512]", mm(12, 512, 8, 4), {"A": np.array(1.0, np.float32), "B": good}),
    "type 7 (Q5_1)": ("packed_type 7 is not read here", mm(7, 512, 8, 4), {"A": x, "B": good}),
    "type 99": ("packed_type 99", mm(99, 512, 8, 4), {"A": x, "B": good}),
    "a negative type": ("packed_type -1", mm(-1, 512, 8, 4), {"A": x, "B": good}),
    "K not whole blocks": ("K=500 is not a positive", mm(12, 500, 8, 4), {"A": x[..., :500].copy(), "B": good}),
    "K negative": ("K=-512", mm(12, -512, 8, 4), {"A": x, "B": good}),
    "N zero": ("N=0", mm(12, 512, 0, 4), {"A": x, "B": good[:0].copy()}),
    "N huge": ("N=1125899906842624", mm(12, 512, 1 << 50, 4), {"A": x, "B": good}),
    "accuracy 2": ("accuracy_level 2", mm(12, 512, 8, 2), {"A": x, "B": good}),
    "an activation": ("activation_type silu", mm(12, 512, 8, 4, activation_type="silu"), {"A": x, "B": good}),
    "past the table": ("index 8 outside a table of 8 rows", gm(12, 512), {"data": good, "ids": ids(8)}),
    "before the table": ("index -9 outside", gm(12, 512), {"data": good, "ids": ids(0, -9)}),
    "int32 past the table": (
        "index 1073741824 outside",
        gm(12, 512, TensorProto.INT32),
        {"data": good, "ids": np.array([1 << 30], np.int32)},
    ),
    "a gather of short rows": ("data has shape [8, 100]", gm(12, 512), {"data": good[:, :100].copy(), "ids": ids(0)}),
}
for name, (expected, model, feeds) in cases.items():
    try:
        session(model).run(None, feeds)
    except Exception as error:  # ORT's error types: Fail, InvalidArgument, RuntimeException
        said = "refused" if expected in str(error) else "OTHER ERROR"
        print(said + ":", name, "|", str(error).splitlines()[0][:200])
    else:
        print("ACCEPTED:", name)
print("done", len(cases))
"""


@needs_library
def test_hostile_shapes_and_types_are_errors_never_crashes() -> None:
    child = run_child(HOSTILE)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    lines = child.stdout.strip().splitlines()
    assert lines[-1].startswith("done"), child.stdout
    wrong = [line for line in lines if line.startswith(("ACCEPTED", "OTHER ERROR"))]
    assert not wrong, wrong
    assert len([line for line in lines if line.startswith("refused")]) == int(lines[-1].split()[1])


@needs_library
def test_the_declared_api_entries_work_on_the_installed_onnxruntime() -> None:
    """kernels/ort_abi.h names OrtApi slots by index; a wrong index would crash or misread. The
    library asks for API 17 (KernelContext_ParallelFor) and registers its domain; a run reads
    inputs, attributes, shapes and writes outputs through every declared entry, and an error
    path makes and returns a status."""
    major, minor = (int(part) for part in ort.__version__.split(".")[:2])
    assert (major, minor) >= (1, 17)
    rows = random_blocks(np.random.default_rng(1), "Q8_0", 64, 64)
    sess = session(matmul_model(packed_ops.TYPE_IDS["Q8_0"], 64, 64, 1), threads=2)
    x = np.ones((3, 1, 64), np.float32)
    y = sess.run(None, {"A": x, "B": rows})[0]
    assert y.shape == (3, 1, 64)
    np.testing.assert_allclose(y[0, 0], dequantized("Q8_0", rows, 64).sum(1), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="expected \\[64, 68\\]"):
        sess.run(None, {"A": x, "B": rows[:, :-2].copy()})
