"""Builds the engine op library (kernels/: MatMulPacked and GatherPacked over GGUF rows) with the
machine's C++ compiler. Everything else about the package is in pyproject.toml.

The library is a plain shared object that ONNX Runtime loads (`RegisterCustomOps`); Python never
imports it. It is optional: without a compiler the package installs without it, and `build` and
`inspect` say so."""

from setuptools import Extension, setup

SOURCES = ["gguf_formats.cc", "packed_matmul.cc", "packed_matmul_x86.cc", "packed_ops.cc"]

setup(
    ext_modules=[
        Extension(
            "adaptive_export.kernels._packed_ops",
            sources=[f"kernels/{name}" for name in SOURCES],
            depends=[
                f"kernels/{name}" for name in ("gguf_formats.h", "packed_matmul.h", "packed_matmul_isa.h", "ort_abi.h")
            ],
            language="c++",
            # -ffp-contract=off: the fp32 mode rebuilds each weight with gguf's own two roundings
            extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden", "-Wall"],
            optional=True,
        )
    ]
)
