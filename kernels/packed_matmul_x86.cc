// x86 kernels of packed_matmul (AVX2 + FMA, and AVX-512 VNNI where the CPU has it): each
// format's codes unpacked into registers, 32 or 64 at a time, and used for a tile of up to four
// activation rows before the next ones are read.
//
// int8 mode: 32-element formats multiply each block by its own fp16 scale and the activation
// block's (llama.cpp's Q8_0 way); K-quants sum the eight sub-blocks of 256 in integers with
// their 6- or 8-bit scales and take mins and offsets from the activations' integer block sums
// (llama.cpp's Q8_K way), so a 256-block costs one conversion to float per activation row.
// fp32 mode: each weight rebuilt exactly as gguf_formats.cc does (one product, then the min
// added: the same two roundings), so both paths compute the same dequantized model.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "packed_matmul_isa.h"

#define AE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define AE_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace adaptive_export {
namespace {

AE_AVX2 inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

AE_AVX2 inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

AE_AVX2 inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> low nibbles, then high ones
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(lo, 4), lo);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

AE_AVX2 inline __m256i bits32(const uint8_t* p) {  // 32 bits -> 32 bytes of 0xFF or 0x00
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1));
}

AE_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ------------------------------------------------------------ 32-element formats

// One block: 32 codes (signed, or unsigned with a min), its scale and min.
struct Block32 {
  __m256i codes;
  float scale;
  float min;
};

struct Q4_0 {
  static constexpr int kBytes = 18;
  static constexpr bool kSigned = true, kMin = false;
  AE_AVX2 static void load(const uint8_t* b, Block32& u) {
    u.scale = half(b);
    u.codes = _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
  }
};

struct Q4_1 {
  static constexpr int kBytes = 20;
  static constexpr bool kSigned = false, kMin = true;
  AE_AVX2 static void load(const uint8_t* b, Block32& u) {
    u.scale = half(b);
    u.min = half(b + 2);
    u.codes = nibbles32(b + 4);
  }
};

struct Q5_0 {
  static constexpr int kBytes = 22;
  static constexpr bool kSigned = true, kMin = false;
  AE_AVX2 static void load(const uint8_t* b, Block32& u) {
    u.scale = half(b);
    const __m256i high = _mm256_and_si256(bits32(b + 2), _mm256_set1_epi8(0x10));
    u.codes = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), high), _mm256_set1_epi8(16));
  }
};

struct Q8_0 {
  static constexpr int kBytes = 34;
  static constexpr bool kSigned = true, kMin = false;
  AE_AVX2 static void load(const uint8_t* b, Block32& u) {
    u.scale = half(b);
    u.codes = load32(b + 2);
  }
};

template <class F, int Tile>
AE_AVX2 void block32_int8(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  const int64_t k = a.k;
  __m256 acc[Tile];
  float minimum[Tile];
  for (int t = 0; t < Tile; ++t) {
    acc[t] = _mm256_setzero_ps();
    minimum[t] = 0.0f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  Block32 u;
  for (int64_t b = 0; b < nb; ++b) {
    F::load(row + b * F::kBytes, u);
    const __m256i magnitude = F::kSigned ? _mm256_sign_epi8(u.codes, u.codes) : u.codes;
    for (int t = 0; t < Tile; ++t) {
      const int64_t r = t0 + t;
      __m256i x = load32(a.q + r * k + 32 * b);
      if (F::kSigned) x = _mm256_sign_epi8(x, u.codes);
      const __m256i products = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(u.scale * a.d[r * nb + b]), acc[t]);
      if (F::kMin) minimum[t] += u.min * a.s[r * nb + b];
    }
  }
  for (int t = 0; t < Tile; ++t) y[(t0 + t) * ldy] = hsum(acc[t]) + minimum[t];
}

// Eight fp32 weights (lanes [8 c, 8 c + 8) of a block's codes) as gguf_formats.cc computes them.
AE_AVX2 inline __m256 weights8(__m256i codes, int c, float scale, const float* min) {
  const __m128i part = c < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
  const __m128i eight = (c % 2) ? _mm_srli_si128(part, 8) : part;
  const __m256 w = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)));
  return min ? _mm256_add_ps(w, _mm256_set1_ps(*min)) : w;
}

template <int Tile>
AE_AVX2 inline void float32_block(__m256i codes, float scale, const float* min, const Activations& a, int64_t t0,
                                  int64_t column, __m256* acc) {
  for (int c = 0; c < 4; ++c) {
    const __m256 w = weights8(codes, c, scale, min);
    for (int t = 0; t < Tile; ++t)
      acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a.f32 + (t0 + t) * a.k + column + 8 * c), acc[t]);
  }
}

template <class F, int Tile>
AE_AVX2 void block32_float(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  __m256 acc[Tile];
  for (int t = 0; t < Tile; ++t) acc[t] = _mm256_setzero_ps();
  Block32 u;
  for (int64_t b = 0; b < nb; ++b) {
    F::load(row + b * F::kBytes, u);
    float32_block<Tile>(u.codes, u.scale, F::kMin ? &u.min : nullptr, a, t0, 32 * b, acc);
  }
  for (int t = 0; t < Tile; ++t) y[(t0 + t) * ldy] = hsum(acc[t]);
}

// ------------------------------------------------------------ K-quants (256-element blocks)

// A K block is read in four chunks of two sub-blocks (64 elements). Its header holds what the
// chunks share: the fp16 scales, the 6-bit scales and mins (Q4_K/Q5_K, unpacked with the same
// masks as ggml's) or the 16 int8 scales (Q6_K), and the 16-bit lanes madd applies to each chunk.
struct HeaderK {
  float d;
  float dmin;         // Q4_K/Q5_K: w = d * sc * q - dmin * m
  uint8_t sc_m[16];   // Q4_K/Q5_K: 8 scales, then 8 mins
  const int8_t* sub;  // Q6_K: 16 scales; w = d * sub * (q - 32)
  __m256i scales;     // Q4_K/Q5_K: the 8 scales as int16 in both 128-bit lanes
};

// The 16-bit lanes of sub-block j's madd multiplier: its 6-bit scale in all 16 (Q4_K/Q5_K).
AE_AVX2 inline __m256i k_multiplier(const HeaderK& h, int j) {
  const __m256i pick = _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * j));
  return _mm256_shuffle_epi8(h.scales, pick);
}

AE_AVX2 inline void k_header(const uint8_t* b, HeaderK& h) {  // Q4_K/Q5_K: d, dmin, 12 scale bytes
  h.d = half(b);
  h.dmin = half(b + 2);
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
  const uint32_t mins_low = u[1] & six;
  u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
  u[2] = mins_low;
  u[0] &= six;
  std::memcpy(h.sc_m, u, 16);
  const __m128i scales = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h.sc_m)));
  h.scales = _mm256_broadcastsi128_si256(scales);
}

struct Q4_K {
  static constexpr int kBytes = 144;
  static constexpr bool kMin = true, kOffset = false;
  AE_AVX2 static void header(const uint8_t* b, HeaderK& h) { k_header(b, h); }
  AE_AVX2 static void chunk(const uint8_t* b, const HeaderK& h, int c, __m256i* codes, __m256i* mult) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bytes = load32(b + 16 + 32 * c);
    codes[0] = _mm256_and_si256(bytes, low4);
    codes[1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    mult[0] = k_multiplier(h, 2 * c);
    mult[1] = k_multiplier(h, 2 * c + 1);
  }
};

struct Q5_K {
  static constexpr int kBytes = 176;
  static constexpr bool kMin = true, kOffset = false;
  AE_AVX2 static void header(const uint8_t* b, HeaderK& h) { k_header(b, h); }
  AE_AVX2 static void chunk(const uint8_t* b, const HeaderK& h, int c, __m256i* codes, __m256i* mult) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), five = _mm256_set1_epi8(0x10);
    const __m256i bytes = load32(b + 48 + 32 * c), qh = load32(b + 16);
    for (int i = 0; i < 2; ++i) {
      const int s = 2 * c + i;
      const __m256i low = _mm256_and_si256(i ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
      codes[i] = _mm256_or_si256(low, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), five));
      mult[i] = k_multiplier(h, s);
    }
  }
};

// Q6_K chunk c: half c / 2 of the block, groups 2 (c % 2) and 2 (c % 2) + 1 of it.
struct Q6_K {
  static constexpr int kBytes = 210;
  static constexpr bool kMin = false, kOffset = true;
  AE_AVX2 static void header(const uint8_t* b, HeaderK& h) {
    h.d = half(b + 208);
    h.sub = reinterpret_cast<const int8_t*>(b + 192);
  }
  AE_AVX2 static void chunk(const uint8_t* b, const HeaderK& h, int c, __m256i* codes, __m256i* mult) {
    const int half_index = c / 2, pair = c % 2;
    const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    const __m256i qh = load32(b + 128 + 32 * half_index);
    for (int i = 0; i < 2; ++i) {
      const int g = 2 * pair + i;  // group of the half: ql byte 32 (g % 2) + l, nibble g / 2, qh bits 2 g
      const __m256i ql = load32(b + 64 * half_index + 32 * (g % 2));
      const __m256i low = _mm256_and_si256(g < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
      __m256i high;
      switch (g) {
        case 0: high = _mm256_slli_epi16(qh, 4); break;
        case 1: high = _mm256_slli_epi16(qh, 2); break;
        case 2: high = qh; break;
        default: high = _mm256_srli_epi16(qh, 2); break;
      }
      codes[i] = _mm256_or_si256(low, _mm256_and_si256(high, two));
      const int j = 4 * half_index + g;
      mult[i] = _mm256_set_m128i(_mm_set1_epi16(h.sub[2 * j + 1]), _mm_set1_epi16(h.sub[2 * j]));
    }
  }
};

// What a K block's mins (Q4_K/Q5_K: -dmin * m per 32) or offsets (Q6_K: codes are q + 32, so
// -32 * d * sub per 16) contribute, as floats to multiply with the activations' scaled sums.
struct BlockSums {
  __m256 mins;
  __m256 offsets[2];
};

template <class F>
AE_AVX2 inline BlockSums block_sums(const HeaderK& h) {
  BlockSums w{};
  if (F::kMin) {
    const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h.sc_m + 8)));
    w.mins = _mm256_mul_ps(_mm256_set1_ps(-h.dmin), _mm256_cvtepi32_ps(m));
  }
  if (F::kOffset) {
    const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h.sub));
    const __m256 scale = _mm256_set1_ps(-32.0f * h.d);
    w.offsets[0] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)));
    w.offsets[1] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sub, 8))));
  }
  return w;
}

template <class F, int Tile>
AE_AVX2 void k_int8(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  const int64_t k = a.k;
  __m256 acc[Tile];
  for (int t = 0; t < Tile; ++t) acc[t] = _mm256_setzero_ps();
  HeaderK h;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    F::header(block, h);
    __m256i sum[Tile];
    for (int t = 0; t < Tile; ++t) sum[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i codes[2], mult[2];
      F::chunk(block, h, c, codes, mult);
      for (int t = 0; t < Tile; ++t) {
        const int8_t* x = a.q + (t0 + t) * k + 256 * b + 64 * c;
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[0], load32(x)), mult[0]);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[1], load32(x + 32)), mult[1]);
        sum[t] = _mm256_add_epi32(sum[t], _mm256_add_epi32(p0, p1));
      }
    }
    const BlockSums w = block_sums<F>(h);
    for (int t = 0; t < Tile; ++t) {
      const int64_t r = t0 + t;
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_set1_ps(h.d * a.d[r * nb + b]), acc[t]);
      if (F::kMin) acc[t] = _mm256_fmadd_ps(w.mins, _mm256_loadu_ps(a.s + r * (k / 32) + 8 * b), acc[t]);
      if (F::kOffset) {
        const float* s16 = a.s16 + r * (k / 16) + 16 * b;
        acc[t] = _mm256_fmadd_ps(w.offsets[0], _mm256_loadu_ps(s16), acc[t]);
        acc[t] = _mm256_fmadd_ps(w.offsets[1], _mm256_loadu_ps(s16 + 8), acc[t]);
      }
    }
  }
  for (int t = 0; t < Tile; ++t) y[(t0 + t) * ldy] = hsum(acc[t]);
}

template <class F, int Tile>
AE_AVX2 void k_float(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  __m256 acc[Tile];
  for (int t = 0; t < Tile; ++t) acc[t] = _mm256_setzero_ps();
  HeaderK h;
  const __m256i offset = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    F::header(block, h);
    for (int c = 0; c < 4; ++c) {
      __m256i codes[2], mult[2];
      F::chunk(block, h, c, codes, mult);
      for (int i = 0; i < 2; ++i) {
        const int j = 2 * c + i;
        const int64_t column = 256 * b + 32 * j;
        if (F::kMin) {
          const float scale = h.d * static_cast<float>(h.sc_m[j]), min = -(h.dmin * static_cast<float>(h.sc_m[8 + j]));
          float32_block<Tile>(codes[i], scale, &min, a, t0, column, acc);
          continue;
        }
        const __m256i centred = _mm256_sub_epi8(codes[i], offset);  // Q6_K: 16 elements per scale d * sub
        for (int q = 0; q < 4; ++q) {
          const __m256 w = weights8(centred, q, h.d * static_cast<float>(h.sub[2 * j + q / 2]), nullptr);
          for (int t = 0; t < Tile; ++t)
            acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a.f32 + (t0 + t) * a.k + column + 8 * q), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < Tile; ++t) y[(t0 + t) * ldy] = hsum(acc[t]);
}

// ------------------------------------------------------------ AVX-512 VNNI (two sub-blocks per op)

AE_AVX512 inline __m512i join(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_zextsi256_si512(low), high, 1);
}

AE_AVX512 inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

template <class F, int Tile>
AE_AVX512 void k_int8_512(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  const int64_t k = a.k;
  __m256 acc[Tile];
  for (int t = 0; t < Tile; ++t) acc[t] = _mm256_setzero_ps();
  HeaderK h;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    F::header(block, h);
    __m512i sum[Tile];
    for (int t = 0; t < Tile; ++t) sum[t] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m256i codes[2], mult[2];
      F::chunk(block, h, c, codes, mult);
      const __m512i z = join(codes[0], codes[1]), m = join(mult[0], mult[1]);
      for (int t = 0; t < Tile; ++t) {
        const __m512i x = _mm512_loadu_si512(a.q + (t0 + t) * k + 256 * b + 64 * c);
        sum[t] = _mm512_dpwssd_epi32(sum[t], _mm512_maddubs_epi16(z, x), m);
      }
    }
    const BlockSums w = block_sums<F>(h);
    for (int t = 0; t < Tile; ++t) {
      const int64_t r = t0 + t;
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold(sum[t])), _mm256_set1_ps(h.d * a.d[r * nb + b]), acc[t]);
      if (F::kMin) acc[t] = _mm256_fmadd_ps(w.mins, _mm256_loadu_ps(a.s + r * (k / 32) + 8 * b), acc[t]);
      if (F::kOffset) {
        const float* s16 = a.s16 + r * (k / 16) + 16 * b;
        acc[t] = _mm256_fmadd_ps(w.offsets[0], _mm256_loadu_ps(s16), acc[t]);
        acc[t] = _mm256_fmadd_ps(w.offsets[1], _mm256_loadu_ps(s16 + 8), acc[t]);
      }
    }
  }
  for (int t = 0; t < Tile; ++t) y[(t0 + t) * ldy] = hsum(acc[t]);
}

// 32-element formats, two blocks per op: signed codes are offset to unsigned (c + 128) for
// VNNI's unsigned-by-signed product, and 128 * the activations' sums taken back.
template <class F, int Tile>
AE_AVX512 void block32_int8_512(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y,
                                int64_t ldy) {
  const int64_t k = a.k;
  __m512 acc[Tile];
  float minimum[Tile];
  for (int t = 0; t < Tile; ++t) {
    acc[t] = _mm512_setzero_ps();
    minimum[t] = 0.0f;
  }
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i pairs = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  Block32 u0, u1;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    F::load(row + b * F::kBytes, u0);
    F::load(row + (b + 1) * F::kBytes, u1);
    __m512i z = join(u0.codes, u1.codes);
    if (F::kSigned) z = _mm512_xor_si512(z, sign);
    const __m512 w = _mm512_insertf32x8(_mm512_zextps256_ps512(_mm256_set1_ps(u0.scale)), _mm256_set1_ps(u1.scale), 1);
    for (int t = 0; t < Tile; ++t) {
      const int64_t r = t0 + t;
      const __m512i x = _mm512_loadu_si512(a.q + r * k + 32 * b);
      __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, x);
      if (F::kSigned) p = _mm512_sub_epi32(p, _mm512_dpbusd_epi32(_mm512_setzero_si512(), sign, x));
      const __m512 dx = _mm512_permutexvar_ps(pairs, _mm512_zextps128_ps512(_mm_castpd_ps(_mm_load_sd(
                                                          reinterpret_cast<const double*>(a.d + r * nb + b)))));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w, dx), acc[t]);
      if (F::kMin) minimum[t] += u0.min * a.s[r * nb + b] + u1.min * a.s[r * nb + b + 1];
    }
  }
  if (b < nb) {  // an odd last block, at 256 bits
    F::load(row + b * F::kBytes, u0);
    const __m256i sign256 = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m256i z = F::kSigned ? _mm256_xor_si256(u0.codes, sign256) : u0.codes;
    for (int t = 0; t < Tile; ++t) {
      const int64_t r = t0 + t;
      const __m256i x = load32(a.q + r * k + 32 * b);
      __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), z, x);
      if (F::kSigned) p = _mm256_sub_epi32(p, _mm256_dpbusd_epi32(_mm256_setzero_si256(), sign256, x));
      minimum[t] += hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(u0.scale * a.d[r * nb + b])));
      if (F::kMin) minimum[t] += u0.min * a.s[r * nb + b];
    }
  }
  for (int t = 0; t < Tile; ++t) y[(t0 + t) * ldy] = _mm512_reduce_add_ps(acc[t]) + minimum[t];
}

// ------------------------------------------------------------ long passes: fp32 panels
//
// A pass of many rows (prefill) dequantizes four weight rows at a time into an fp32 panel,
// exactly as gguf_formats.cc does, and multiplies it with every activation row in an FMA
// micro-kernel (4 weight rows x 6 activation rows of accumulators): the dequantization is paid
// once per weight row for the whole pass, and each weight and activation load feeds several
// multiply-adds.

template <class F>
AE_AVX2 void dequantize_block32_rows(const uint8_t* row, int64_t nb, float* out) {
  Block32 u;
  for (int64_t b = 0; b < nb; ++b) {
    F::load(row + b * F::kBytes, u);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + 32 * b + 8 * c, weights8(u.codes, c, u.scale, F::kMin ? &u.min : nullptr));
  }
}

template <class F>
AE_AVX2 void dequantize_k_rows(const uint8_t* row, int64_t nb, float* out) {
  HeaderK h;
  const __m256i offset = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    F::header(block, h);
    for (int c = 0; c < 4; ++c) {
      __m256i codes[2], mult[2];
      F::chunk(block, h, c, codes, mult);
      for (int i = 0; i < 2; ++i) {
        const int j = 2 * c + i;
        float* w = out + 256 * b + 32 * j;
        if (F::kMin) {
          const float scale = h.d * static_cast<float>(h.sc_m[j]), min = -(h.dmin * static_cast<float>(h.sc_m[8 + j]));
          for (int q = 0; q < 4; ++q) _mm256_storeu_ps(w + 8 * q, weights8(codes[i], q, scale, &min));
        } else {
          const __m256i centred = _mm256_sub_epi8(codes[i], offset);
          for (int q = 0; q < 4; ++q)
            _mm256_storeu_ps(w + 8 * q, weights8(centred, q, h.d * static_cast<float>(h.sub[2 * j + q / 2]), nullptr));
        }
      }
    }
  }
}

template <class F, bool KQuant>
AE_AVX2 void dequantize_rows(const uint8_t* row, int64_t nb, float* out) {
  if constexpr (KQuant) dequantize_k_rows<F>(row, nb, out);
  else dequantize_block32_rows<F>(row, nb, out);
}

template <int Rows, int Cols>
AE_AVX512 void panel_512(const float* w, int64_t k, const float* x, float* y, int64_t ldy) {
  __m512 acc[Rows][Cols];
  for (int i = 0; i < Rows; ++i)
    for (int t = 0; t < Cols; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t e = 0; e < k; e += 16) {
    __m512 wv[Rows];
    for (int i = 0; i < Rows; ++i) wv[i] = _mm512_loadu_ps(w + i * k + e);
    for (int t = 0; t < Cols; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * k + e);
      for (int i = 0; i < Rows; ++i) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
    }
  }
  for (int i = 0; i < Rows; ++i)
    for (int t = 0; t < Cols; ++t) y[t * ldy + i] = _mm512_reduce_add_ps(acc[i][t]);
}

template <int Rows, int Cols>
AE_AVX2 void panel_256(const float* w, int64_t k, const float* x, float* y, int64_t ldy) {
  __m256 acc[Rows][Cols];
  for (int i = 0; i < Rows; ++i)
    for (int t = 0; t < Cols; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t e = 0; e < k; e += 8) {
    __m256 wv[Rows];
    for (int i = 0; i < Rows; ++i) wv[i] = _mm256_loadu_ps(w + i * k + e);
    for (int t = 0; t < Cols; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * k + e);
      for (int i = 0; i < Rows; ++i) acc[i][t] = _mm256_fmadd_ps(wv[i], xv, acc[i][t]);
    }
  }
  for (int i = 0; i < Rows; ++i)
    for (int t = 0; t < Cols; ++t) y[t * ldy + i] = hsum(acc[i][t]);
}

// Every activation row against `Rows` dequantized weight rows (the panel).
template <int Rows, bool Wide>
void panel_rows(const float* w, const Activations& a, float* y, int64_t ldy) {
  constexpr int kCols = Wide ? 6 : 2;
  int64_t t = 0;
  for (; t + kCols <= a.rows; t += kCols) {
    if constexpr (Wide) panel_512<Rows, kCols>(w, a.k, a.f32 + t * a.k, y + t * ldy, ldy);
    else panel_256<Rows, kCols>(w, a.k, a.f32 + t * a.k, y + t * ldy, ldy);
  }
  const float* x = a.f32 + t * a.k;
  float* out = y + t * ldy;
  if constexpr (Wide) {  // the last rows in one call: each call reads the whole panel again
    switch (a.rows - t) {
      case 5: return panel_512<Rows, 5>(w, a.k, x, out, ldy);
      case 4: return panel_512<Rows, 4>(w, a.k, x, out, ldy);
      case 3: return panel_512<Rows, 3>(w, a.k, x, out, ldy);
      case 2: return panel_512<Rows, 2>(w, a.k, x, out, ldy);
      case 1: return panel_512<Rows, 1>(w, a.k, x, out, ldy);
      default: return;
    }
  } else if (a.rows - t == 1) {
    panel_256<Rows, 1>(w, a.k, x, out, ldy);
  }
}

template <class F, bool KQuant, bool Wide>
void float_panels(const uint8_t* weights, int64_t row_bytes, int64_t n_begin, int64_t n_end, const Activations& a,
                  float* y, int64_t ldy) {
  constexpr int kRows = 4;
  const int64_t nb = row_bytes / F::kBytes;
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(kRows * a.k));
  int64_t n = n_begin;
  for (; n + kRows <= n_end; n += kRows) {
    for (int i = 0; i < kRows; ++i) dequantize_rows<F, KQuant>(weights + (n + i) * row_bytes, nb, panel.data() + i * a.k);
    panel_rows<kRows, Wide>(panel.data(), a, y + n, ldy);
  }
  for (; n < n_end; ++n) {
    dequantize_rows<F, KQuant>(weights + n * row_bytes, nb, panel.data());
    panel_rows<1, Wide>(panel.data(), a, y + n, ldy);
  }
}

// ------------------------------------------------------------ rows and dispatch

// The kernel of one tile: Kind 0 fp32, 1 int8 at AVX2, 2 int8 at AVX-512 VNNI.
template <class F, int Kind, bool KQuant, int Tile>
AE_AVX512 inline void tile512(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y,
                              int64_t ldy) {
  if constexpr (KQuant) k_int8_512<F, Tile>(row, nb, a, t0, y, ldy);
  else block32_int8_512<F, Tile>(row, nb, a, t0, y, ldy);
}

template <class F, int Kind, bool KQuant, int Tile>
AE_AVX2 inline void tile256(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y,
                            int64_t ldy) {
  if constexpr (KQuant) {
    if constexpr (Kind == 1) k_int8<F, Tile>(row, nb, a, t0, y, ldy);
    else k_float<F, Tile>(row, nb, a, t0, y, ldy);
  } else {
    if constexpr (Kind == 1) block32_int8<F, Tile>(row, nb, a, t0, y, ldy);
    else block32_float<F, Tile>(row, nb, a, t0, y, ldy);
  }
}

template <class F, int Kind, bool KQuant, int Tile>
inline void tile(const uint8_t* row, int64_t nb, const Activations& a, int64_t t0, float* y, int64_t ldy) {
  if constexpr (Kind == 2) tile512<F, Kind, KQuant, Tile>(row, nb, a, t0, y, ldy);
  else tile256<F, Kind, KQuant, Tile>(row, nb, a, t0, y, ldy);
}

constexpr int64_t kPrefetchRows = 2;

template <class F, int Kind, bool KQuant>
void rows(const uint8_t* weights, int64_t row_bytes, int64_t n_begin, int64_t n_end, const Activations& a, float* y,
          int64_t ldy) {
  const int64_t nb = row_bytes / F::kBytes;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = weights + n * row_bytes;
    if (n + kPrefetchRows < n_end)  // the rows a few ahead, so DRAM streams while these compute
      for (int64_t line = 0; line < row_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * row_bytes + line), _MM_HINT_T0);
    int64_t t = 0;
    for (; t + 4 <= a.rows; t += 4) tile<F, Kind, KQuant, 4>(row, nb, a, t, y + n, ldy);
    switch (a.rows - t) {
      case 3: tile<F, Kind, KQuant, 3>(row, nb, a, t, y + n, ldy); break;
      case 2: tile<F, Kind, KQuant, 2>(row, nb, a, t, y + n, ldy); break;
      case 1: tile<F, Kind, KQuant, 1>(row, nb, a, t, y + n, ldy); break;
      default: break;
    }
  }
}

// Calls visit(Format{}, is_k_quant) with the kernels' type of `type`: every dispatcher below is
// one line of it.
template <class Visit>
void visit_format(GgmlType type, Visit&& visit) {
  switch (type) {
    case GgmlType::Q4_0: return visit(Q4_0{}, std::false_type{});
    case GgmlType::Q4_1: return visit(Q4_1{}, std::false_type{});
    case GgmlType::Q5_0: return visit(Q5_0{}, std::false_type{});
    case GgmlType::Q8_0: return visit(Q8_0{}, std::false_type{});
    case GgmlType::Q4_K: return visit(Q4_K{}, std::true_type{});
    case GgmlType::Q5_K: return visit(Q5_K{}, std::true_type{});
    case GgmlType::Q6_K: return visit(Q6_K{}, std::true_type{});
  }
}

template <int Kind>
void dispatch(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin, int64_t n_end,
              const Activations& a, float* y, int64_t ldy) {
  visit_format(format.type, [&](auto f, auto k) {
    rows<decltype(f), Kind, decltype(k)::value>(weights, row_bytes, n_begin, n_end, a, y, ldy);
  });
}

template <bool Wide>
void dispatch_panels(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                     int64_t n_end, const Activations& a, float* y, int64_t ldy) {
  visit_format(format.type, [&](auto f, auto k) {
    float_panels<decltype(f), decltype(k)::value, Wide>(weights, row_bytes, n_begin, n_end, a, y, ldy);
  });
}

}  // namespace

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

void avx2_float_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                     int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
  dispatch<0>(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
}

void avx2_int8_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                    int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
  dispatch<1>(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
}

void avx512_int8_rows(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                      int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
  dispatch<2>(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
}

void avx2_float_panels(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                       int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
  dispatch_panels<false>(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
}

void avx512_float_panels(const FormatInfo& format, const uint8_t* weights, int64_t row_bytes, int64_t n_begin,
                         int64_t n_end, const Activations& acts, float* y, int64_t ldy) {
  dispatch_panels<true>(format, weights, row_bytes, n_begin, n_end, acts, y, ldy);
}

}  // namespace adaptive_export

#endif
