// GGUF block formats, read exactly as the file stores them.
//
// Every format here is a sequence of blocks of QK weights; a weight row of K elements is
// K / QK blocks laid end to end (`row_bytes = K / QK * block_bytes`). Two readings:
//  - dequantize_row: the fp32 weights, computed with the same fp32 expressions (and the same
//    rounding, no fused multiply-add) as gguf's numpy dequantization, so the fp32-activation
//    mode computes exactly the dequantized model;
//  - unpack_row: integer codes plus per-32 scales and mins, for the int8-activation mode:
//    w[32 j + i] = scale[j] * code[32 j + i] (* sub[16-block] for Q6_K) + min[j].
#pragma once

#include <cstddef>
#include <cstdint>

namespace adaptive_export {

// ggml's type ids, the `packed_type` attribute of MatMulPacked and GatherPacked.
enum class GgmlType : int64_t {
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
};

struct FormatInfo {
  GgmlType type;
  const char* name;
  int64_t block_elements;  // QK
  int64_t block_bytes;
  bool has_min;      // codes are unsigned and min[j] is added (Q4_1, Q4_K, Q5_K)
  bool sub_scales;   // per-16 int8 scales multiply the codes (Q6_K)
};

// The format of a ggml type id, or nullptr when the id is not one this op reads.
const FormatInfo* find_format(int64_t type_id);

// fp32 weights of one row (k elements) from row_bytes = k / QK * block_bytes bytes.
void dequantize_row(const FormatInfo& format, const uint8_t* row, int64_t k, float* out);

// The int8-path view of one row: codes (k bytes, signed or unsigned per has_min), scale and
// min per 32 elements (k / 32 each), and for Q6_K the per-16 int8 scales as int16 (k / 16).
struct UnpackedRow {
  int8_t* codes;
  float* scale;
  float* min;
  int16_t* sub;
};
void unpack_row(const FormatInfo& format, const uint8_t* row, int64_t k, const UnpackedRow& out);

float half_to_float(uint16_t h);

}  // namespace adaptive_export
