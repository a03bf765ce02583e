// The few entries of ONNX Runtime's C API this library calls, declared by the project itself
// (the onnxruntime wheel ships no headers). Facts from ORT's public onnxruntime_c_api.h:
//  - OrtApiBase is {GetApi(version), GetVersionString()};
//  - OrtApi is a table of function pointers that only grows at its end ("DO NOT MODIFY ABOVE",
//    held by ORT's static_asserts), so an entry's slot index never changes once released;
//  - OrtCustomOp's fields are read up to its `version`: 16 adds CreateKernelV2/KernelComputeV2,
//    which return a status, so a bad input is an error and never a crash.
// tests/test_packed_ops.py runs every entry listed here against the installed onnxruntime.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ort_abi {

struct Status;  // OrtStatus
struct Value;   // OrtValue
struct TensorInfo;
struct KernelInfo;
struct KernelContext;
struct SessionOptions;
struct CustomOpDomain;
struct Api;  // OrtApi: used only through the slots below

enum ErrorCode : int { kOk = 0, kFail = 1, kInvalidArgument = 2, kRuntimeException = 6 };
enum ElementType : int { kUndefined = 0, kFloat = 1, kUint8 = 2, kInt32 = 6, kInt64 = 7 };
enum Characteristic : int { kRequired = 0, kOptional = 1 };

struct ApiBase {
  const Api* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// API 17 is the first with KernelContext_ParallelFor (ONNX Runtime 1.17).
constexpr uint32_t kApiVersion = 17;
constexpr uint32_t kCustomOpVersion = 16;

// Slot indices in OrtApi and each entry's signature.
template <int Index, typename Signature>
struct Slot {
  static Signature get(const Api* api) { return reinterpret_cast<Signature const*>(api)[Index]; }
};

using CreateStatus = Slot<0, Status* (*)(ErrorCode, const char*)>;
using CreateCustomOpDomainFn = Slot<26, Status* (*)(const char*, CustomOpDomain**)>;
using CustomOpDomainAdd = Slot<27, Status* (*)(CustomOpDomain*, const void* op)>;
using AddCustomOpDomain = Slot<28, Status* (*)(SessionOptions*, CustomOpDomain*)>;
using GetTensorMutableData = Slot<51, Status* (*)(Value*, void**)>;
using GetTensorElementType = Slot<60, Status* (*)(const TensorInfo*, ElementType*)>;
using GetDimensionsCount = Slot<61, Status* (*)(const TensorInfo*, size_t*)>;
using GetDimensions = Slot<62, Status* (*)(const TensorInfo*, int64_t*, size_t)>;
using GetTensorShapeElementCount = Slot<64, Status* (*)(const TensorInfo*, size_t*)>;
using GetTensorTypeAndShape = Slot<65, Status* (*)(const Value*, TensorInfo**)>;
using KernelInfoGetAttributeInt64 = Slot<86, Status* (*)(const KernelInfo*, const char*, int64_t*)>;
using KernelInfoGetAttributeString = Slot<87, Status* (*)(const KernelInfo*, const char*, char*, size_t*)>;
using KernelContextGetInputCount = Slot<88, Status* (*)(const KernelContext*, size_t*)>;
using KernelContextGetInput = Slot<90, Status* (*)(const KernelContext*, size_t, const Value**)>;
using KernelContextGetOutput = Slot<91, Status* (*)(KernelContext*, size_t, const int64_t*, size_t, Value**)>;
using ReleaseStatus = Slot<93, void (*)(Status*)>;
using ReleaseTensorInfo = Slot<99, void (*)(TensorInfo*)>;
using KernelContextParallelFor =
    Slot<274, Status* (*)(const KernelContext*, void (*)(void*, size_t), size_t total, size_t num_batch, void*)>;

// OrtCustomOp as read at version 16: every field up to KernelComputeV2.
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const Api*, const KernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  ElementType (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  ElementType (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, KernelContext*);
  void (*KernelDestroy)(void*);
  Characteristic (*GetInputCharacteristic)(const CustomOp*, size_t);
  Characteristic (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);  // OrtMemTypeDefault = 0
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  Status* (*CreateKernelV2)(const CustomOp*, const Api*, const KernelInfo*, void** kernel);
  Status* (*KernelComputeV2)(void*, KernelContext*);
};

}  // namespace ort_abi
