// MatMulPacked and GatherPacked in the domain ai.adaptive_export: ONNX Runtime's
// com.microsoft contracts (B = the GGUF's rows verbatim, uint8 [N, row_bytes], packed_type =
// the ggml type id) with a CPU kernel. Every input's type, rank, shape and byte size is checked
// against the attributes before any read; a mismatch is an error status, never a read outside
// a buffer.
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "gguf_formats.h"
#include "ort_abi.h"
#include "packed_matmul.h"

namespace adaptive_export {
namespace {

using namespace ort_abi;

const Api* g_api = nullptr;
constexpr const char* kDomain = "ai.adaptive_export";
constexpr int64_t kMaxRank = 8;
constexpr int64_t kMaxDimension = int64_t{1} << 40;

Status* error(const std::string& message) { return CreateStatus::get(g_api)(kInvalidArgument, message.c_str()); }

// A tensor input or output: element type, shape and data, read through the API once.
struct Tensor {
  ElementType type = kUndefined;
  std::vector<int64_t> shape;
  size_t elements = 0;
  void* data = nullptr;
};

Status* describe(const Value* value, Tensor* out) {
  TensorInfo* info = nullptr;
  if (Status* s = GetTensorTypeAndShape::get(g_api)(value, &info)) return s;
  size_t rank = 0;
  Status* s = GetTensorElementType::get(g_api)(info, &out->type);
  if (!s) s = GetDimensionsCount::get(g_api)(info, &rank);
  if (!s && rank > static_cast<size_t>(kMaxRank)) s = error("a tensor of rank " + std::to_string(rank));
  if (!s) {
    out->shape.assign(rank, 0);
    s = GetDimensions::get(g_api)(info, out->shape.data(), rank);
  }
  if (!s) s = GetTensorShapeElementCount::get(g_api)(info, &out->elements);
  ReleaseTensorInfo::get(g_api)(info);
  if (s) return s;
  size_t product = 1;
  for (int64_t d : out->shape) {
    if (d < 0 || d > kMaxDimension) return error("a tensor dimension of " + std::to_string(d));
    product *= static_cast<size_t>(d);
  }
  if (product != out->elements) return error("a tensor whose element count disagrees with its shape");
  return GetTensorMutableData::get(g_api)(const_cast<Value*>(value), &out->data);
}

Status* input(KernelContext* context, size_t index, Tensor* out) {
  const Value* value = nullptr;
  if (Status* s = KernelContextGetInput::get(g_api)(context, index, &value)) return s;
  if (!value) return error("input " + std::to_string(index) + " is missing");
  return describe(value, out);
}

Status* output(KernelContext* context, const std::vector<int64_t>& shape, Tensor* out) {
  Value* value = nullptr;
  if (Status* s = KernelContextGetOutput::get(g_api)(context, 0, shape.data(), shape.size(), &value)) return s;
  if (!value) return error("no output tensor");
  return describe(value, out);
}

// The attributes both ops share: the format and the logical row length K.
struct PackedAttributes {
  const FormatInfo* format = nullptr;
  int64_t k = 0;
  int64_t row_bytes = 0;
};

Status* int_attribute(const KernelInfo* info, const char* name, int64_t* out, bool required) {
  Status* s = KernelInfoGetAttributeInt64::get(g_api)(info, name, out);
  if (!s) return nullptr;
  ReleaseStatus::get(g_api)(s);
  return required ? error(std::string("attribute ") + name + " is required") : nullptr;
}

Status* packed_attributes(const KernelInfo* info, PackedAttributes* out) {
  int64_t type_id = -1;
  if (Status* s = int_attribute(info, "packed_type", &type_id, true)) return s;
  if (Status* s = int_attribute(info, "K", &out->k, true)) return s;
  out->format = find_format(type_id);
  if (!out->format)
    return error("packed_type " + std::to_string(type_id) + " is not read here (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)");
  if (out->k <= 0 || out->k > kMaxDimension || out->k % out->format->block_elements)
    return error("K=" + std::to_string(out->k) + " is not a positive multiple of " + out->format->name + "'s " +
                 std::to_string(out->format->block_elements) + "-element blocks");
  out->row_bytes = out->k / out->format->block_elements * out->format->block_bytes;
  return nullptr;
}

// B or data: uint8 [N, row_bytes] exactly.
Status* check_rows(const Tensor& rows, const PackedAttributes& a, int64_t n, const char* name) {
  if (rows.type != kUint8 || rows.shape.size() != 2)
    return error(std::string(name) + " must be a 2-D uint8 tensor of GGUF rows");
  if ((n >= 0 && rows.shape[0] != n) || rows.shape[1] != a.row_bytes)
    return error(std::string(name) + " has shape [" + std::to_string(rows.shape[0]) + ", " +
                 std::to_string(rows.shape[1]) + "], expected [" + (n >= 0 ? std::to_string(n) : "N") + ", " +
                 std::to_string(a.row_bytes) + "] for K=" + std::to_string(a.k) + " in " + a.format->name);
  if (rows.elements && !rows.data) return error(std::string(name) + " has no data");
  return nullptr;
}

// ---------------------------------------------------------------- MatMulPacked

struct MatMulKernel {
  PackedAttributes packed;
  int64_t n = 0;
  ActivationMode mode = ActivationMode::kFloat;
};

struct MatMulTask {
  const MatMulKernel* kernel;
  const uint8_t* weights;
  Activations acts;
  float* y;
  int64_t rows_per_task;
  ActivationBuffers buffers;
};

void matmul_task(void* user, size_t index) {
  const MatMulTask& t = *static_cast<const MatMulTask*>(user);
  const int64_t begin = static_cast<int64_t>(index) * t.rows_per_task;
  const int64_t end = begin + t.rows_per_task < t.kernel->n ? begin + t.rows_per_task : t.kernel->n;
  matmul_rows(*t.kernel->packed.format, t.kernel->mode, t.weights, t.kernel->packed.row_bytes, begin, end, t.acts,
              t.y, t.kernel->n);
}

void quantize_task(void* user, size_t index) {
  const MatMulTask& t = *static_cast<const MatMulTask*>(user);
  quantize_activations(*t.kernel->packed.format, t.acts, static_cast<int64_t>(index), static_cast<int64_t>(index) + 1,
                       t.buffers);
}

Status* matmul_create(const CustomOp*, const Api*, const KernelInfo* info, void** out) {
  auto* kernel = new (std::nothrow) MatMulKernel;
  if (!kernel) return CreateStatus::get(g_api)(kFail, "out of memory");
  Status* s = packed_attributes(info, &kernel->packed);
  if (!s) s = int_attribute(info, "N", &kernel->n, true);
  if (!s && (kernel->n <= 0 || kernel->n > kMaxDimension)) s = error("N=" + std::to_string(kernel->n));
  int64_t accuracy = 1;
  if (!s) s = int_attribute(info, "accuracy_level", &accuracy, false);
  if (!s && accuracy != 1 && accuracy != 4)
    s = error("accuracy_level " + std::to_string(accuracy) + " (1: fp32 activations, 4: int8 activations)");
  if (!s) {
    char activation[16] = {0};
    size_t size = sizeof(activation);
    Status* missing = KernelInfoGetAttributeString::get(g_api)(info, "activation_type", activation, &size);
    if (missing)
      ReleaseStatus::get(g_api)(missing);
    else if (std::strcmp(activation, "none") != 0 && activation[0] != '\0')
      s = error(std::string("activation_type ") + activation + " is not supported (only none)");
  }
  if (s) {
    delete kernel;
    return s;
  }
  kernel->mode = accuracy == 4 ? ActivationMode::kInt8 : ActivationMode::kFloat;
  *out = kernel;
  return nullptr;
}

// The int8 activations of one call, kept by the calling thread between calls.
struct ActivationStorage {
  std::vector<int8_t> q;
  std::vector<float> d, s, s16;
  ActivationBuffers fit(int64_t m, int64_t k) {
    q.resize(static_cast<size_t>(m * k));
    d.resize(static_cast<size_t>(m * (k / 32)));
    s.resize(static_cast<size_t>(m * (k / 32)));
    s16.resize(static_cast<size_t>(m * (k / 16)));
    return {q.data(), d.data(), s.data(), s16.data()};
  }
};

Status* matmul_compute(void* opaque, KernelContext* context) {
  const MatMulKernel& kernel = *static_cast<const MatMulKernel*>(opaque);
  size_t inputs = 0;
  if (Status* s = KernelContextGetInputCount::get(g_api)(context, &inputs)) return s;
  if (inputs > 2) return error("MatMulPacked: global_scale is not supported by this kernel");
  Tensor a, b, y;
  if (Status* s = input(context, 0, &a)) return s;
  if (Status* s = input(context, 1, &b)) return s;
  if (a.type != kFloat || a.shape.empty() || a.shape.back() != kernel.packed.k)
    return error("MatMulPacked: A must be float [..., " + std::to_string(kernel.packed.k) + "]");
  if (Status* s = check_rows(b, kernel.packed, kernel.n, "MatMulPacked: B")) return s;
  if (a.elements && !a.data) return error("MatMulPacked: A has no data");
  std::vector<int64_t> shape(a.shape.begin(), a.shape.end() - 1);
  shape.push_back(kernel.n);
  if (Status* s = output(context, shape, &y)) return s;
  const int64_t m = static_cast<int64_t>(a.elements) / kernel.packed.k;
  if (y.type != kFloat || static_cast<int64_t>(y.elements) != m * kernel.n || (y.elements && !y.data))
    return error("MatMulPacked: the output tensor is not float [..., N]");
  if (m == 0) return nullptr;

  MatMulTask task{&kernel, static_cast<const uint8_t*>(b.data), {}, static_cast<float*>(y.data), 0, {}};
  task.acts.rows = m;
  task.acts.k = kernel.packed.k;
  task.acts.f32 = static_cast<const float*>(a.data);
  if (kernel.mode == ActivationMode::kInt8 && !uses_float_panels(*kernel.packed.format, kernel.mode, m)) {
    thread_local ActivationStorage storage;
    task.buffers = storage.fit(m, kernel.packed.k);
    if (m > 4) {
      if (Status* s = KernelContextParallelFor::get(g_api)(context, quantize_task, m, 0, &task)) return s;
    } else {
      quantize_activations(*kernel.packed.format, task.acts, 0, m, task.buffers);
    }
    task.acts.q = task.buffers.q;
    task.acts.d = task.buffers.d;
    task.acts.s = task.buffers.s;
    task.acts.s16 = task.buffers.s16;
  }
  // about 64 tasks: balanced over any pool size, a few microseconds of scheduling each
  task.rows_per_task = kernel.n / 64 > 16 ? kernel.n / 64 : 16;
  const int64_t tasks = (kernel.n + task.rows_per_task - 1) / task.rows_per_task;
  return KernelContextParallelFor::get(g_api)(context, matmul_task, static_cast<size_t>(tasks), 0, &task);
}

// ---------------------------------------------------------------- GatherPacked

struct GatherKernel {
  PackedAttributes packed;
};

Status* gather_create(const CustomOp*, const Api*, const KernelInfo* info, void** out) {
  auto* kernel = new (std::nothrow) GatherKernel;
  if (!kernel) return CreateStatus::get(g_api)(kFail, "out of memory");
  Status* s = packed_attributes(info, &kernel->packed);
  int64_t dtype = 1;
  if (!s) s = int_attribute(info, "output_dtype", &dtype, false);
  if (!s && dtype != 1) s = error("GatherPacked: output_dtype " + std::to_string(dtype) + " (this kernel writes float: 1)");
  if (s) {
    delete kernel;
    return s;
  }
  *out = kernel;
  return nullptr;
}

Status* gather_compute(void* opaque, KernelContext* context) {
  const GatherKernel& kernel = *static_cast<const GatherKernel*>(opaque);
  Tensor data, indices, y;
  if (Status* s = input(context, 0, &data)) return s;
  if (Status* s = input(context, 1, &indices)) return s;
  if (Status* s = check_rows(data, kernel.packed, -1, "GatherPacked: data")) return s;
  if (indices.type != kInt64 && indices.type != kInt32) return error("GatherPacked: indices must be int32 or int64");
  if (indices.elements && !indices.data) return error("GatherPacked: indices have no data");
  const int64_t rows = data.shape[0];
  std::vector<int64_t> shape = indices.shape;
  shape.push_back(kernel.packed.k);
  for (size_t i = 0; i < indices.elements; ++i) {  // every index checked before anything is written
    const int64_t id = indices.type == kInt64 ? static_cast<const int64_t*>(indices.data)[i]
                                              : static_cast<const int32_t*>(indices.data)[i];
    if (id < -rows || id >= rows)
      return error("GatherPacked: index " + std::to_string(id) + " outside a table of " + std::to_string(rows) + " rows");
  }
  if (Status* s = output(context, shape, &y)) return s;
  if (y.type != kFloat || y.elements != indices.elements * static_cast<size_t>(kernel.packed.k) ||
      (y.elements && !y.data))
    return error("GatherPacked: the output tensor is not float [..., K]");
  const auto* table = static_cast<const uint8_t*>(data.data);
  for (size_t i = 0; i < indices.elements; ++i) {
    int64_t id = indices.type == kInt64 ? static_cast<const int64_t*>(indices.data)[i]
                                        : static_cast<const int32_t*>(indices.data)[i];
    if (id < 0) id += rows;
    dequantize_row(*kernel.packed.format, table + id * kernel.packed.row_bytes, kernel.packed.k,
                   static_cast<float*>(y.data) + i * kernel.packed.k);
  }
  return nullptr;
}

// ---------------------------------------------------------------- the two op descriptions

template <int Inputs>
struct OpTypes {
  ElementType inputs[Inputs];
  Characteristic characteristics[Inputs];
};

const char* matmul_name(const CustomOp*) { return "MatMulPacked"; }
const char* gather_name(const CustomOp*) { return "GatherPacked"; }
const char* cpu_provider(const CustomOp*) { return "CPUExecutionProvider"; }
ElementType matmul_input(const CustomOp*, size_t i) { return i == 0 ? kFloat : i == 1 ? kUint8 : kFloat; }
size_t matmul_inputs(const CustomOp*) { return 3; }
ElementType gather_input(const CustomOp*, size_t i) { return i == 0 ? kUint8 : kUndefined; }  // int32 or int64
size_t gather_inputs(const CustomOp*) { return 2; }
ElementType float_output(const CustomOp*, size_t) { return kFloat; }
size_t one_output(const CustomOp*) { return 1; }
Characteristic matmul_characteristic(const CustomOp*, size_t i) { return i == 2 ? kOptional : kRequired; }
Characteristic required(const CustomOp*, size_t) { return kRequired; }
int default_memory(const CustomOp*, size_t) { return 0; }
int one(const CustomOp*) { return 1; }
int zero(const CustomOp*) { return 0; }
void destroy_matmul(void* kernel) { delete static_cast<MatMulKernel*>(kernel); }
void destroy_gather(void* kernel) { delete static_cast<GatherKernel*>(kernel); }

CustomOp make_op(const char* (*name)(const CustomOp*), ElementType (*input_type)(const CustomOp*, size_t),
                 size_t (*input_count)(const CustomOp*), Characteristic (*characteristic)(const CustomOp*, size_t),
                 Status* (*create)(const CustomOp*, const Api*, const KernelInfo*, void**),
                 Status* (*compute)(void*, KernelContext*), void (*destroy)(void*)) {
  CustomOp op{};
  op.version = kCustomOpVersion;
  op.GetName = name;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = float_output;
  op.GetOutputTypeCount = one_output;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = characteristic;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = zero;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = zero;
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  return op;
}

const CustomOp kMatMul = make_op(matmul_name, matmul_input, matmul_inputs, matmul_characteristic, matmul_create,
                                 matmul_compute, destroy_matmul);
const CustomOp kGather =
    make_op(gather_name, gather_input, gather_inputs, required, gather_create, gather_compute, destroy_gather);

}  // namespace
}  // namespace adaptive_export

// The entry point ONNX Runtime's RegisterCustomOpsLibrary looks up.
extern "C" __attribute__((visibility("default"))) ort_abi::Status* RegisterCustomOps(
    ort_abi::SessionOptions* options, const ort_abi::ApiBase* base) {
  using namespace adaptive_export;
  const ort_abi::Api* api = base ? base->GetApi(ort_abi::kApiVersion) : nullptr;
  if (!api) {
    std::fprintf(stderr, "adaptive_export packed ops need ONNX Runtime >= 1.17 (C API %u); this one is %s\n",
                 ort_abi::kApiVersion, base ? base->GetVersionString() : "unknown");
    return nullptr == base ? nullptr : ort_abi::CreateStatus::get(base->GetApi(1))(
                                            ort_abi::kFail, "adaptive_export packed ops need ONNX Runtime >= 1.17");
  }
  g_api = api;
  ort_abi::CustomOpDomain* domain = nullptr;
  if (ort_abi::Status* s = ort_abi::CreateCustomOpDomainFn::get(api)(kDomain, &domain)) return s;
  if (ort_abi::Status* s = ort_abi::CustomOpDomainAdd::get(api)(domain, &kMatMul)) return s;
  if (ort_abi::Status* s = ort_abi::CustomOpDomainAdd::get(api)(domain, &kGather)) return s;
  return ort_abi::AddCustomOpDomain::get(api)(options, domain);
}

// Which kernels this CPU runs, for inspect and the benchmarks (read through ctypes by nothing
// but the installed package's own Python: adaptive_export.kernels.kernel_isa).
extern "C" __attribute__((visibility("default"))) const char* adaptive_export_kernel_isa() {
  return adaptive_export::kernel_isa();
}
