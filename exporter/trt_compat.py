"""Static check that every ONNX graph of a bundle stays inside TensorRT's ONNX parser support.

The operator list is the "Y" rows of onnx-tensorrt's docs/operators.md support matrix
(the TensorRT 8.5 edition, the newest stored copy we could read: it is a subset of what
TensorRT 10 parses, so passing here is conservative). Opsets: that edition documents
opset <= 17; TensorRT 10's edition documents opset 9..22 (MAX_OPSET_TRT10), which our
opset-18 graphs need. Custom-domain ops (e.g. com.microsoft MatMulNBits from --quantize)
are never supported: TensorRT gets its precision from its own fp16/int8 flags instead.
This check runs in CI on every graph; TensorRT itself cannot be installed on CI machines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

MAX_OPSET_TRT10 = 22
SUPPORTED_OPS = frozenset(
    """
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast Ceil Celu Clip Concat
Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal
Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool
Greater GreaterOrEqual GridSample GRU HardSwish HardSigmoid Identity If ImageScaler InstanceNormalization IsNaN
LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
MeanVarianceNormalization Min Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu
QuantizeLinear RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2
ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize
ReverseSequence RNN RoiAlign Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin
Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK
Transpose Trilu Unsqueeze Upsample Where Xor
""".split()
)
# The doc's data types (FLOAT32, FLOAT16, INT8, BOOL; INT32/INT64 with limited support, cast
# down to INT32 by the parser; TensorRT 10 adds native INT64 and BF16).
SUPPORTED_DTYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.BOOL,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT64,
    }
)


@dataclass
class CompatReport:
    graph: str
    opset: int
    ops: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_model(name: str, model: onnx.ModelProto) -> CompatReport:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    report = CompatReport(graph=name, opset=opset)
    if opset > MAX_OPSET_TRT10:
        report.problems.append(f"opset {opset} is above TensorRT 10's documented maximum {MAX_OPSET_TRT10}")
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        report.ops[key] = report.ops.get(key, 0) + 1
    for op in sorted(report.ops):
        if op not in SUPPORTED_OPS:
            report.problems.append(f"operator {op} is not in TensorRT's ONNX parser support matrix")
    tensors = list(model.graph.initializer) + [v for v in (*model.graph.input, *model.graph.output)]
    for tensor in tensors:
        dtype = tensor.data_type if isinstance(tensor, onnx.TensorProto) else tensor.type.tensor_type.elem_type
        if dtype not in SUPPORTED_DTYPES:
            report.problems.append(
                f"tensor {tensor.name} has data type {onnx.TensorProto.DataType.Name(dtype)}, unsupported by TensorRT"
            )
    return report


def check_bundle(root: Path, onnx_entry: dict) -> list[CompatReport]:
    return [
        check_model(name, onnx.load(str(root / engine["file"]), load_external_data=False))
        for name, engine in onnx_entry["graphs"].items()
    ]
