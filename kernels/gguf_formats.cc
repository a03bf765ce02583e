// GGUF block formats: exact fp32 dequantization and the int8 path's codes (gguf_formats.h).
// Compiled with -ffp-contract=off: every product and sum rounds as gguf's numpy does.
#include "gguf_formats.h"

#include <cstring>

namespace adaptive_export {
namespace {

const FormatInfo kFormats[] = {
    {GgmlType::Q4_0, "Q4_0", 32, 18, false, false},  {GgmlType::Q4_1, "Q4_1", 32, 20, true, false},
    {GgmlType::Q5_0, "Q5_0", 32, 22, false, false},  {GgmlType::Q8_0, "Q8_0", 32, 34, false, false},
    {GgmlType::Q4_K, "Q4_K", 256, 144, true, false}, {GgmlType::Q5_K, "Q5_K", 256, 176, true, false},
    {GgmlType::Q6_K, "Q6_K", 256, 210, false, true},
};

uint16_t read_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
float read_half(const uint8_t* p) { return half_to_float(read_u16(p)); }

// Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// The integer code of element e of one block, as the format stores it (before any offset).
// Q4_0/Q4_1: nibbles, element e < 16 the low one of byte e, e >= 16 the high one of byte e-16.
int nibble32(const uint8_t* qs, int e) { return e < 16 ? (qs[e] & 0x0F) : (qs[e - 16] >> 4); }

int q5_0_code(const uint8_t* b, int e) {
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  return nibble32(b + 6, e) | static_cast<int>(((qh >> e) & 1u) << 4);
}

// Q4_K/Q5_K element e of 256: sub-block s = e / 32 reads the low (s even) or high (s odd)
// nibbles of bytes 32 (s / 2) .. +31.
int k_low4(const uint8_t* qs, int e) {
  const int s = e / 32, l = e % 32;
  const uint8_t byte = qs[32 * (s / 2) + l];
  return (s % 2) ? (byte >> 4) : (byte & 0x0F);
}

int q5_k_code(const uint8_t* b, int e) {
  const int s = e / 32, l = e % 32;
  return k_low4(b + 48, e) | (((b[16 + l] >> s) & 1) << 4);
}

// Q6_K element e of 256: half h = e / 128; group g = (e % 128) / 32 reads ql's low (g < 2) or
// high nibbles of bytes 64 h + 32 (g % 2) + l, and bits 2 g of qh byte 32 h + l.
int q6_k_code(const uint8_t* b, int e) {
  const int h = e / 128, g = (e % 128) / 32, l = e % 32;
  const uint8_t low = b[64 * h + 32 * (g % 2) + l];
  const int q4 = g < 2 ? (low & 0x0F) : (low >> 4);
  const int q2 = (b[128 + 32 * h + l] >> (2 * g)) & 3;
  return (q4 | (q2 << 4)) - 32;
}

void dequantize_block(GgmlType type, const uint8_t* b, float* y) {
  switch (type) {
    case GgmlType::Q4_0: {
      const float d = read_half(b);
      for (int e = 0; e < 32; ++e) y[e] = d * static_cast<float>(nibble32(b + 2, e) - 8);
      return;
    }
    case GgmlType::Q4_1: {
      const float d = read_half(b), m = read_half(b + 2);
      for (int e = 0; e < 32; ++e) y[e] = d * static_cast<float>(nibble32(b + 4, e)) + m;
      return;
    }
    case GgmlType::Q5_0: {
      const float d = read_half(b);
      for (int e = 0; e < 32; ++e) y[e] = d * static_cast<float>(q5_0_code(b, e) - 16);
      return;
    }
    case GgmlType::Q8_0: {
      const float d = read_half(b);
      for (int e = 0; e < 32; ++e) y[e] = d * static_cast<float>(static_cast<int8_t>(b[2 + e]));
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const float d = read_half(b), dmin = read_half(b + 2);
      for (int s = 0; s < 8; ++s) {
        uint8_t sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
        for (int l = 0; l < 32; ++l) {
          const int e = 32 * s + l;
          const int q = type == GgmlType::Q4_K ? k_low4(b + 16, e) : q5_k_code(b, e);
          y[e] = ds * static_cast<float>(q) - dm;
        }
      }
      return;
    }
    case GgmlType::Q6_K: {
      const float d = read_half(b + 208);
      for (int e = 0; e < 256; ++e) {
        const float ds = d * static_cast<float>(static_cast<int8_t>(b[192 + e / 16]));
        y[e] = ds * static_cast<float>(q6_k_code(b, e));
      }
      return;
    }
  }
}

void unpack_block(GgmlType type, const uint8_t* b, int8_t* codes, float* scale, float* min, int16_t* sub) {
  switch (type) {
    case GgmlType::Q4_0:
      scale[0] = read_half(b);
      for (int e = 0; e < 32; ++e) codes[e] = static_cast<int8_t>(nibble32(b + 2, e) - 8);
      return;
    case GgmlType::Q4_1:
      scale[0] = read_half(b);
      min[0] = read_half(b + 2);
      for (int e = 0; e < 32; ++e) codes[e] = static_cast<int8_t>(nibble32(b + 4, e));
      return;
    case GgmlType::Q5_0:
      scale[0] = read_half(b);
      for (int e = 0; e < 32; ++e) codes[e] = static_cast<int8_t>(q5_0_code(b, e) - 16);
      return;
    case GgmlType::Q8_0:
      scale[0] = read_half(b);
      std::memcpy(codes, b + 2, 32);
      return;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const float d = read_half(b), dmin = read_half(b + 2);
      for (int s = 0; s < 8; ++s) {
        uint8_t sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        scale[s] = d * static_cast<float>(sc);
        min[s] = -(dmin * static_cast<float>(m));
      }
      for (int e = 0; e < 256; ++e)
        codes[e] = static_cast<int8_t>(type == GgmlType::Q4_K ? k_low4(b + 16, e) : q5_k_code(b, e));
      return;
    }
    case GgmlType::Q6_K: {
      const float d = read_half(b + 208);
      for (int s = 0; s < 8; ++s) scale[s] = d;
      for (int s = 0; s < 16; ++s) sub[s] = static_cast<int8_t>(b[192 + s]);
      for (int e = 0; e < 256; ++e) codes[e] = static_cast<int8_t>(q6_k_code(b, e));
      return;
    }
  }
}

}  // namespace

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

const FormatInfo* find_format(int64_t type_id) {
  for (const FormatInfo& f : kFormats)
    if (static_cast<int64_t>(f.type) == type_id) return &f;
  return nullptr;
}

void dequantize_row(const FormatInfo& format, const uint8_t* row, int64_t k, float* out) {
  const int64_t qk = format.block_elements;
  for (int64_t b = 0; b < k / qk; ++b) dequantize_block(format.type, row + b * format.block_bytes, out + b * qk);
}

void unpack_row(const FormatInfo& format, const uint8_t* row, int64_t k, const UnpackedRow& out) {
  const int64_t qk = format.block_elements;
  for (int64_t b = 0; b < k / qk; ++b) {
    unpack_block(format.type, row + b * format.block_bytes, out.codes + b * qk, out.scale + b * qk / 32,
                 out.min ? out.min + b * qk / 32 : nullptr, out.sub ? out.sub + b * qk / 16 : nullptr);
  }
}

}  // namespace adaptive_export
