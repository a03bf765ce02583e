// The portable kernels and the run-time choice of the x86 ones (packed_matmul.h).
#include "packed_matmul.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "packed_matmul_isa.h"

namespace adaptive_export {
namespace {

// Scratch of one thread: one unpacked (or dequantized) weight row.
struct RowScratch {
  std::vector<float> weights, scale, min;
  std::vector<int8_t> codes;
  std::vector<int16_t> sub;
  void fit(int64_t k) {
    if (static_cast<int64_t>(weights.size()) < k) {
      weights.resize(k);
      codes.resize(k);
      scale.resize(k / 32);
      min.resize(k / 32);
      sub.resize(k / 16);
    }
  }
};

RowScratch& scratch(int64_t k) {
  thread_local RowScratch s;
  s.fit(k);
  return s;
}

void generic_float_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                        int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
  const int64_t k = acts.k;
  RowScratch& s = scratch(k);
  for (int64_t n = n_begin; n < n_end; ++n) {
    dequantize_row(format, weights + n * row_bytes, k, s.weights.data());
    for (int64_t t = 0; t < acts.rows; ++t) {
      const float* x = acts.f32 + t * k;
      float sum = 0.0f;
      for (int64_t i = 0; i < k; ++i) sum += s.weights[i] * x[i];
      y[t * ldy + n] = sum;
    }
  }
}

void generic_int8_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                       int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
  const int64_t k = acts.k, blocks = k / 32, per_scale = activation_block(format) / 32;
  RowScratch& s = scratch(k);
  const UnpackedRow row{s.codes.data(), s.scale.data(), s.min.data(), s.sub.data()};
  for (int64_t n = n_begin; n < n_end; ++n) {
    unpack_row(format, weights + n * row_bytes, k, row);
    for (int64_t t = 0; t < acts.rows; ++t) {
      const int8_t* xq = acts.q + t * k;
      const float* xd = acts.d + t * (blocks / per_scale);
      float sum = 0.0f;
      for (int64_t j = 0; j < blocks; ++j) {
        int32_t dot = 0;
        for (int h = 0; h < 2; ++h) {
          int32_t half = 0;
          for (int i = 16 * h; i < 16 * h + 16; ++i) {
            const int32_t w = format.has_min ? static_cast<uint8_t>(row.codes[32 * j + i]) : row.codes[32 * j + i];
            half += w * xq[32 * j + i];
          }
          dot += format.sub_scales ? half * row.sub[2 * j + h] : half;
        }
        const float dx = xd[j / per_scale];
        sum += row.scale[j] * dx * static_cast<float>(dot);
        if (format.has_min) {
          sum += row.min[j] * acts.s[t * blocks + j];
        }
      }
      y[t * ldy + n] = sum;
    }
  }
}

// The widest kernels this CPU runs, capped by ADAPTIVE_EXPORT_KERNEL_ISA (generic, avx2 or
// avx512: the tests and benchmarks compare the paths on one machine).
enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detect_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  Isa isa = cpu_has_avx512_vnni() ? Isa::kAvx512 : cpu_has_avx2() ? Isa::kAvx2 : Isa::kGeneric;
#else
  Isa isa = Isa::kGeneric;
#endif
  const char* cap = std::getenv("ADAPTIVE_EXPORT_KERNEL_ISA");
  if (cap && std::strcmp(cap, "generic") == 0) isa = Isa::kGeneric;
  if (cap && std::strcmp(cap, "avx2") == 0 && isa == Isa::kAvx512) isa = Isa::kAvx2;
  return isa;
}

Isa isa() {
  static const Isa chosen = detect_isa();
  return chosen;
}

}  // namespace

int64_t activation_block(const FormatInfo& format) { return format.block_elements == 256 ? 256 : 32; }

void quantize_activations(const FormatInfo& format, const Activations& acts, int64_t begin, int64_t end,
                          const ActivationBuffers& out) {
  const int64_t k = acts.k, block = activation_block(format), scales = k / block;
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t j = 0; j < scales; ++j) {
      const float* x = acts.f32 + t * k + block * j;
      int8_t* q = out.q + t * k + block * j;
      float amax = 0.0f;
      for (int64_t i = 0; i < block; ++i) amax = std::fmax(amax, std::fabs(x[i]));
      const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
      for (int64_t i = 0; i < block; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
      out.d[t * scales + j] = scale;
      int32_t first_half = 0;
      for (int64_t g = 0; g < block / 16; ++g) {
        int32_t sum16 = 0;
        for (int i = 0; i < 16; ++i) sum16 += q[16 * g + i];
        const int64_t sixteen = t * (k / 16) + j * (block / 16) + g;
        out.s16[sixteen] = scale * static_cast<float>(sum16);
        if (g % 2 == 0) first_half = sum16;
        else out.s[sixteen / 2] = scale * static_cast<float>(first_half + sum16);
      }
    }
  }
}

void matmul_rows(const FormatInfo& format, ActivationMode mode, const uint8_t* weights, int64_t row_bytes,
                 int64_t n_begin, int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
#if defined(__x86_64__) || defined(_M_X64)
  if (uses_float_panels(format, mode, acts.rows)) {
    if (isa() == Isa::kAvx512)
      avx512_float_panels(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
    else
      avx2_float_panels(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
    return;
  }
  if (isa() != Isa::kGeneric) {
    if (mode == ActivationMode::kFloat)
      avx2_float_rows(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
    else if (isa() == Isa::kAvx512)
      avx512_int8_rows(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
    else
      avx2_int8_rows(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
    return;
  }
#endif
  if (mode == ActivationMode::kFloat)
    generic_float_rows(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
  else
    generic_int8_rows(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
}

bool uses_float_panels(const FormatInfo& format, ActivationMode mode, int64_t rows) {
  if (rows < kFloatPanelRows || isa() == Isa::kGeneric) return false;
  return mode == ActivationMode::kFloat || format.block_elements == 32;
}

const char* kernel_isa() {
  switch (isa()) {
    case Isa::kAvx512: return "avx512-vnni";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

}  // namespace adaptive_export
