// Y[t, n] = sum_k A[t, k] * W[n, k] over GGUF rows read as stored (the compute of MatMulPacked).
//
// Each weight block is read and unpacked once per call for every activation row: the rows of a
// verify pass share one read of the weights, so a bandwidth-bound T-row pass costs little more
// than a one-row step.
#pragma once

#include <cstdint>

#include "gguf_formats.h"

namespace adaptive_export {

enum class ActivationMode : int64_t {
  kFloat = 0,  // fp32 activations times the exact dequantized weights
  kInt8 = 1,   // activations quantized to int8 per block of 32 (llama.cpp's Q8_0/Q8_1 way)
};

// Activations of one call. f32: [rows, k]. For kInt8 also q: int8 [rows, k], d: the scale of
// each activation block, and the block sums that carry the weights' mins and offsets in
// float: s = d * the sum of q over each 32 elements [rows, k / 32], s16 the same over each 16
// [rows, k / 16]. Activation blocks follow the weights: 32 elements for 32-element formats
// (llama.cpp's Q8_0/Q8_1 way), 256 for K-quants (its Q8_K way: one conversion to float per 256).
struct Activations {
  int64_t rows = 0;
  int64_t k = 0;
  const float* f32 = nullptr;
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const float* s = nullptr;
  const float* s16 = nullptr;
};

// The int8 buffers of one call's activations.
struct ActivationBuffers {
  int8_t* q;
  float* d;
  float* s;
  float* s16;
};

// Elements per activation scale for weights of this format: 256 for K-quants, else 32.
int64_t activation_block(const FormatInfo& format);

// Quantize rows [begin, end) of acts.f32 into out, per activation_block(format).
void quantize_activations(const FormatInfo& format, const Activations& acts, int64_t begin, int64_t end,
                          const ActivationBuffers& out);

// y[t * ldy + n] for every activation row t and weight rows n in [n_begin, n_end).
void matmul_rows(const FormatInfo& format, ActivationMode mode, const uint8_t* weights, int64_t row_bytes,
                 int64_t n_begin, int64_t n_end, const Activations& acts, float* y, int64_t ldy);

// Passes of at least this many rows (prefill) take the fp32 panel kernels: the weights
// dequantized once per call and multiplied in fp32, exact. In the fp32 mode always; in the int8
// mode for 32-element formats, where it beats per-row int8 products at that size (1.9x on a
// Q5_0 4864x896 linear at 256 rows, one thread); K-quants keep their int8 kernels, which
// sum whole 256-blocks in integers. Shorter passes (decode steps, verify passes) keep their mode.
constexpr int64_t kFloatPanelRows = 32;
bool uses_float_panels(const FormatInfo& format, ActivationMode mode, int64_t rows);

// Which kernels this CPU runs: "avx2" or "generic" (chosen once from CPUID).
const char* kernel_isa();

}  // namespace adaptive_export
