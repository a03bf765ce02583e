"""The project's engine ops over GGUF rows: their ONNX domain, the ggml types they read, and the
compiled library ONNX Runtime loads for them.

`MatMulPacked` (Y = A @ B^T, B the GGUF's rows verbatim, uint8 [N, row_bytes]) and `GatherPacked`
(rows of such a table, dequantized) follow com.microsoft's contracts of the same names, which have
no CPU kernel in ONNX Runtime 1.32; ours live in the domain below, so moving to ONNX Runtime's own
kernels when it ships them is a domain name. The library is the installed package's own file
(kernels/, compiled by the package's build), found by the import system and never by a path a
bundle names: a bundle only says which ops its engines use."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from adaptive_export.runtimes.errors import UsageError

PACKED_DOMAIN = "ai.adaptive_export"
PACKED_OPS = frozenset({"MatMulPacked", "GatherPacked"})
PACKED_OPSET = 1  # the version of PACKED_DOMAIN engines import
LIBRARY_MODULE = "adaptive_export.kernels._packed_ops"

# ggml type id -> (name, elements per block, bytes per block, bits of the grid check reports)
GGML_TYPES: dict[int, tuple[str, int, int, int]] = {
    2: ("Q4_0", 32, 18, 4),
    3: ("Q4_1", 32, 20, 4),
    6: ("Q5_0", 32, 22, 8),
    8: ("Q8_0", 32, 34, 8),
    12: ("Q4_K", 256, 144, 4),
    13: ("Q5_K", 256, 176, 8),
    14: ("Q6_K", 256, 210, 8),
}
TYPE_IDS = {name: type_id for type_id, (name, *_) in GGML_TYPES.items()}
ACCURACY_LEVELS = (1, 4)  # 1: fp32 activations (the dequantized model exactly), 4: int8 activations


def row_bytes(type_id: int, k: int) -> int:
    """Bytes of one row of K elements in ggml type `type_id` (K a whole number of blocks)."""
    _, block, size, _ = GGML_TYPES[type_id]
    if k <= 0 or k % block:
        raise ValueError(f"K={k} is not a positive multiple of {GGML_TYPES[type_id][0]}'s {block}-element blocks")
    return k // block * size


def library_path() -> Path | None:
    """The compiled op library of the installed package, or None when the package was built
    without it (no C++ compiler at install time)."""
    try:
        spec = importlib.util.find_spec(LIBRARY_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin)


def missing_library_error() -> UsageError:
    """The one-line refusal for a build or bundle that needs the op library this installation lacks,
    naming both ways out."""
    return UsageError(
        "this bundle's engines use the GGUF-row ops (MatMulPacked), and this installation of "
        "adaptive-export was built without them (no C++ compiler at install time)",
        "reinstall with a C++ compiler present (`pip install --force-reinstall --no-deps adaptive-export`), "
        "or build the bundle with `--native-form nbits`",
    )


def require_library() -> Path:
    """library_path(), or the one-line refusal naming both ways out."""
    path = library_path()
    if path is None:
        raise missing_library_error()
    return path


def kernel_isa() -> str | None:
    """The instruction set the op library's kernels run on this CPU ("avx512-vnni", "avx2" or
    "generic"; ADAPTIVE_EXPORT_KERNEL_ISA caps it), or None without the library."""
    path = library_path()
    if path is None:
        return None
    import ctypes

    library = ctypes.CDLL(str(path))
    library.adaptive_export_kernel_isa.restype = ctypes.c_char_p
    return str(library.adaptive_export_kernel_isa().decode())
