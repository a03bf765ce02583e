// The x86 kernels of packed_matmul (compiled for AVX2 + FMA and AVX-512 VNNI by target
// attributes, so the library builds with the machine's default flags and runs anywhere,
// choosing at run time).
#pragma once

#include <cstdint>

#include "packed_matmul.h"

namespace adaptive_export {

#if defined(__x86_64__) || defined(_M_X64)
bool cpu_has_avx2();
bool cpu_has_avx512_vnni();
void avx2_float_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                     int64_t n_end, const Activations& acts, float* y, int64_t ldy);
void avx2_int8_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                    int64_t n_end, const Activations& acts, float* y, int64_t ldy);
void avx512_int8_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                      int64_t n_end, const Activations& acts, float* y, int64_t ldy);
void avx2_float_panels(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                       int64_t n_end, const Activations& acts, float* y, int64_t ldy);
void avx512_float_panels(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                         int64_t n_end, const Activations& acts, float* y, int64_t ldy);
#endif

}  // namespace adaptive_export
