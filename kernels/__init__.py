"""The engine op library: MatMulPacked and GatherPacked over GGUF rows for ONNX Runtime's CPU
provider, in C++ (the sources beside this file), compiled by the package's build. Nothing here
is imported by Python code: the ONNX Runtime backend hands the compiled file to ONNX Runtime
(runtimes/packed_ops.py finds it)."""
