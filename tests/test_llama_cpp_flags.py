"""benchmarks/llama_cpp_flags.py: the CMAKE_ARGS string from /proc/cpuinfo's flags."""

from __future__ import annotations

from benchmarks.llama_cpp_flags import cmake_args

COMMON = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat sse sse2 ht syscall nx mmxext lm"
BASE = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
NO_AMX = "-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF"


def cpuinfo(model: str, flags: str) -> str:
    block = f"processor\t: 0\nvendor_id\t: X\nmodel name\t: {model}\nflags\t\t: {COMMON} {flags}\nbogomips\t: 4000\n"
    return block + "\n" + block.replace("processor\t: 0", "processor\t: 1")


def test_zen3_avx2_only() -> None:
    info = cpuinfo("AMD EPYC 7B13", "sse4_1 sse4_2 avx f16c fma avx2 bmi2 vaes vpclmulqdq")
    assert cmake_args(info) == f"{BASE} {NO_AMX}"


def test_zen4_avx512_vnni_bf16() -> None:
    flags = "avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni"
    assert cmake_args(cpuinfo("AMD EPYC 9R14", flags)) == (
        f"{BASE} -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON {NO_AMX}"
    )


def test_intel_avx_vnni_and_amx_keeps_amx_off() -> None:
    flags = (
        "avx f16c fma avx2 avx_vnni avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 "
        "amx_bf16 amx_tile amx_int8 avx512_fp16"
    )
    assert cmake_args(cpuinfo("Intel(R) Xeon(R) Platinum 8481C", flags)) == (
        f"{BASE} -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON {NO_AMX}"
    )


def test_no_flags_line_gives_the_base() -> None:
    assert cmake_args("processor\t: 0\n") == f"{BASE} {NO_AMX}"
