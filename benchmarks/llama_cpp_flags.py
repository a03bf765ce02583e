"""The CMAKE_ARGS that build llama-cpp-python for this CPU's own SIMD extensions, AMX off.

    CMAKE_ARGS="$(python -m benchmarks.llama_cpp_flags)" \\
        pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36

GGML_NATIVE=OFF with the extensions named one by one (read from /proc/cpuinfo's `flags`):
AVX2, FMA and F16C always (every x86-64 CPU the benchmarks run on has them), AVX-512F,
AVX512-VNNI, AVX512-BF16 and AVX-VNNI where the CPU reports them, and the AMX kernels always
off (on a CPU with AMX, llama-cpp-python built with them crashes). The option names
are those of llama.cpp's ggml/CMakeLists.txt (checked at ggml-org/llama.cpp 02813982, ggml
0.21.0: GGML_AVX_VNNI, GGML_AVX512, GGML_AVX512_VNNI, GGML_AVX512_BF16, GGML_AMX_TILE,
GGML_AMX_INT8, GGML_AMX_BF16 are all OFF by default there).
"""

from __future__ import annotations

import sys
from pathlib import Path

BASE = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
# /proc/cpuinfo flag -> the option it turns on
OPTIONAL = (
    ("avx512f", "-DGGML_AVX512=ON"),
    ("avx512_vnni", "-DGGML_AVX512_VNNI=ON"),
    ("avx512_bf16", "-DGGML_AVX512_BF16=ON"),
    ("avx_vnni", "-DGGML_AVX_VNNI=ON"),
)
NO_AMX = ("-DGGML_AMX_INT8=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The `flags` of /proc/cpuinfo's first processor ('Features' is the ARM spelling)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cmake_args(cpuinfo: str) -> str:
    flags = cpu_flags(cpuinfo)
    return " ".join([*BASE, *(option for flag, option in OPTIONAL if flag in flags), *NO_AMX])


def main() -> None:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        sys.exit(f"cannot read /proc/cpuinfo ({exc}): these flags are for Linux on x86-64")
    print(cmake_args(cpuinfo))


if __name__ == "__main__":
    main()
