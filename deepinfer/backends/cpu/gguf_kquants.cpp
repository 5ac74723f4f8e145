// GGUF k-quants on the CPU, over the super-blocks as the file stores them (ggml's layouts):
//
// Q4_K, 144 bytes a 256 values: {fp16 d; fp16 dmin; 12 bytes of eight 6-bit scales and eight
//   6-bit mins; 128 bytes of nibbles}. Sub-block j of 32: w = d*sc_j*q - dmin*m_j; each 32
//   bytes of nibbles hold two sub-blocks (low nibbles, then high ones).
// Q5_K, 176 bytes a 256 values: Q4_K's with 32 bytes of fifth bits before the nibbles.
// Q6_K, 210 bytes a 256 values: {128 bytes of low nibbles; 64 bytes of 2-bit highs; 16 int8
//   scales; fp16 d}. Sub-block of 16: w = d*sc*(q - 32).
// Q2_K, 84 bytes a 256 values: {16 bytes of 4-bit scale | 4-bit min pairs; 64 bytes of 2-bit
//   values; fp16 d; fp16 dmin}. Sub-block j of 16: w = d*sc_j*q - dmin*m_j.
// Q3_K, 110 bytes a 256 values: {32 bytes of high bits; 64 bytes of 2-bit values; 12 bytes of
//   sixteen 6-bit scales; fp16 d}. Sub-block j of 16: w = d*(sc_j - 32)*(q - 4 where the high
//   bit is clear).
// In Q2_K and Q3_K, value v of a super-block is bits 2s, 2s+1 of byte 32*(v/128) + v%32 of the
// value bytes, s = (v%128)/32; Q3_K's high bit is bit v/32 of byte v%32 of its first 32.
//
// Q4_K_M and Q5_K_M files (the common llama.cpp choices) are Q4_K or Q5_K with some tensors in
// Q6_K; Q2_K and Q3_K files (Q2_K, Q3_K_S/M/L) mix Q2_K or Q3_K with Q4_K and higher. The GEMV
// expands each super-block of a weight row to float32 once, in L1, and dots it with every row
// of x: the products are the dequantized weight's, as the Q4_0/Q4_1/Q8_0 kernels' several-row
// path (gguf_kernels.cpp). At batch 1 Q3_K, Q4_K, Q5_K and Q6_K run as Q4_1 does there: x
// rounded to int16 per 32 columns, integer multiply-adds over the values.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "gguf_blocks.h"

namespace deepinfer_gguf {
namespace {

// Q4_K's scale and min of sub-block j (ggml's get_scale_min_k4).
inline void q4k_scale_min(int j, const uint8_t* q, float* sc, float* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void expand_q4_k(const uint8_t* block, float* y) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  const uint8_t* scales = block + 4;
  const uint8_t* q = block + 16;
  for (int j = 0; j < kSuperBlock; j += 64, q += 32) {
    float sc, m;
    q4k_scale_min(j / 32, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    q4k_scale_min(j / 32 + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) y[j + l] = d1 * (q[l] & 0xf) - m1;
    for (int l = 0; l < 32; ++l) y[j + 32 + l] = d2 * (q[l] >> 4) - m2;
  }
}

// Q5_K: Q4_K's layout with a fifth bit per value, 32 bytes of them after the scales (bit 2c
// of byte l for value l of sub-block 2c, bit 2c+1 for sub-block 2c+1).
void expand_q5_k(const uint8_t* block, float* y) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  const uint8_t* scales = block + 4;
  const uint8_t* qh = block + 16;
  const uint8_t* q = block + 48;
  for (int c = 0; c < 4; ++c, q += 32) {
    float sc, m;
    q4k_scale_min(2 * c, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    q4k_scale_min(2 * c + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) {
      y[64 * c + l] = d1 * ((q[l] & 0xf) + (((qh[l] >> (2 * c)) & 1) << 4)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      y[64 * c + 32 + l] = d2 * ((q[l] >> 4) + (((qh[l] >> (2 * c + 1)) & 1) << 4)) - m2;
    }
  }
}

// Q2_K and Q3_K walk their values as ggml does: for each 128 (n), each 2-bit shift (j) and
// each half of 32 value bytes, 16 values share a sub-block scale. Their 16 values as int32
// in two vectors of 8 (AVX2), or one at a time.
#ifdef DEEPINFER_AVX2
// 16 int8 values to float32, times `scale`, less `offset`, into y[0..15].
inline void store16(__m128i values, float scale, float offset, float* y) {
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8)));
  _mm256_storeu_ps(y, _mm256_sub_ps(_mm256_mul_ps(s, lo), o));
  _mm256_storeu_ps(y + 8, _mm256_sub_ps(_mm256_mul_ps(s, hi), o));
}

// Bits `shift`, shift+1 of 16 bytes.
inline __m128i two_bits(const uint8_t* q, int shift) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm_and_si128(_mm_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(3));
}
#endif

void expand_q2_k(const uint8_t* block, float* y) {
  const float d = half_to_float(block + 80), dmin = half_to_float(block + 82);
  const uint8_t* scales = block;
  for (int n = 0; n < 2; ++n) {
    const uint8_t* q = block + 16 + 32 * n;
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half, ++scales, y += 16) {
        // (d * sc) * q - dmin * m, as ggml and gguf-py compute it.
        const float dl = d * (*scales & 0xf), ml = dmin * (*scales >> 4);
#ifdef DEEPINFER_AVX2
        store16(two_bits(q + 16 * half, 2 * j), dl, ml, y);
#else
        for (int l = 0; l < 16; ++l) y[l] = dl * ((q[16 * half + l] >> (2 * j)) & 3) - ml;
#endif
      }
    }
  }
}

// d times Q3_K's sixteen 6-bit scales (less 32): low 4 bits from bytes 0-7 (low nibbles for
// 0-7, high ones for 8-15), high 2 bits from bytes 8-11 (bits 2*(i/4) of byte 8 + i%4),
// four at a time in 32-bit words as ggml's dequantize_row_q3_K does.
inline void q3_k_scales(const uint8_t* packed, float d, float dl[16]) {
  constexpr uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
  uint32_t word[3], scales[4];
  std::memcpy(word, packed, 12);
  scales[0] = (word[0] & low4) | ((word[2] & low2) << 4);
  scales[1] = (word[1] & low4) | (((word[2] >> 2) & low2) << 4);
  scales[2] = ((word[0] >> 4) & low4) | (((word[2] >> 4) & low2) << 4);
  scales[3] = ((word[1] >> 4) & low4) | (((word[2] >> 6) & low2) << 4);
  uint8_t bytes[16];
  std::memcpy(bytes, scales, 16);
  for (int i = 0; i < 16; ++i) dl[i] = d * static_cast<float>(bytes[i] - 32);
}

// A Q3_K value is its 2 bits less 4 where its high bit is clear.
void expand_q3_k(const uint8_t* block, float* y) {
  const uint8_t* hmask = block;
  float dl[16];
  q3_k_scales(block + 96, half_to_float(block + 108), dl);
  for (int n = 0; n < 2; ++n) {
    const uint8_t* q = block + 32 + 32 * n;
    for (int j = 0; j < 4; ++j) {
      const int bit = 4 * n + j;  // the high-bit plane of these 32 values
      for (int half = 0; half < 2; ++half, y += 16) {
        const float scale = dl[8 * n + 2 * j + half];
#ifdef DEEPINFER_AVX2
        const __m128i high = _mm_and_si128(
            _mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hmask + 16 * half)),
                          _mm_cvtsi32_si128(bit)),
            _mm_set1_epi8(1));
        // q - 4 + 4 * high: q less 4 where the high bit is clear.
        const __m128i values = _mm_add_epi8(_mm_sub_epi8(two_bits(q + 16 * half, 2 * j),
                                                         _mm_set1_epi8(4)),
                                            _mm_slli_epi16(high, 2));
        store16(values, scale, 0.f, y);
#else
        for (int l = 0; l < 16; ++l) {
          const int value = ((q[16 * half + l] >> (2 * j)) & 3) -
                            (((hmask[16 * half + l] >> bit) & 1) ? 0 : 4);
          y[l] = scale * static_cast<float>(value);
        }
#endif
      }
    }
  }
}

#ifdef DEEPINFER_AVX2
// Half `half` of a Q6_K super-block (values 128*half ...) as 4 vectors of 32 int8 values minus
// 32: vector i holds values 32i .. 32i+31 of the half, each from byte l of the low nibbles
// (ql[l] or ql[l + 32], low or high nibble) and 2 bits of qh[l].
inline void q6_k_values(const uint8_t* block, int half, __m256i values[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  const __m256i offset = _mm256_set1_epi8(32);
  const uint8_t* ql = block + 64 * half;
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 +
                                                                          32 * half));
  const __m256i low[4] = {ql0, ql1, _mm256_srli_epi16(ql0, 4), _mm256_srli_epi16(ql1, 4)};
  for (int i = 0; i < 4; ++i) {
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), low2);
    values[i] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(low[i], low4),
                                                _mm256_slli_epi16(high, 4)),
                                offset);
  }
}
#endif

void expand_q6_k(const uint8_t* block, float* y) {
  // (d * sc) * value in that order, as ggml and gguf-py compute it.
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_to_float(block + 208);
#ifdef DEEPINFER_AVX2
  for (int half = 0; half < 2; ++half) {
    __m256i values[4];
    q6_k_values(block, half, values);
    for (int i = 0; i < 4; ++i) {
      for (int g = 0; g < 4; ++g) {  // 8 values at a time; 16 share a scale
        const __m128i part = g < 2 ? _mm256_castsi256_si128(values[i])
                                   : _mm256_extracti128_si256(values[i], 1);
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            (g & 1) ? _mm_srli_si128(part, 8) : part));
        const float scale = d * sc[8 * half + 2 * i + g / 2];
        _mm256_storeu_ps(y + 128 * half + 32 * i + 8 * g,
                         _mm256_mul_ps(_mm256_set1_ps(scale), v));
      }
    }
  }
#else
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  for (int n = 0; n < kSuperBlock; n += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      y[n + l] = d * sc[is] * (((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32);
      y[n + l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
      y[n + l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      y[n + l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
#endif
}

inline void expand(int64_t qtype, const uint8_t* block, float* y) {
  switch (qtype) {
    case kQ2_K: expand_q2_k(block, y); break;
    case kQ3_K: expand_q3_k(block, y); break;
    case kQ4_K: expand_q4_k(block, y); break;
    case kQ5_K: expand_q5_k(block, y); break;
    default: expand_q6_k(block, y); break;
  }
}


// a . b over one super-block: four 8-wide FMA chains.
float dot256(const float* a, const float* b) {
#ifdef DEEPINFER_AVX2
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int i = 0; i < kSuperBlock; i += 32) {
    for (int u = 0; u < 4; ++u) {
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * u), _mm256_loadu_ps(b + i + 8 * u),
                               acc[u]);
    }
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#else
  float s = 0.f;
  for (int i = 0; i < kSuperBlock; ++i) s += a[i] * b[i];
  return s;
#endif
}

#ifdef DEEPINFER_AVX2
inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// One Q4_K row against one row of x, as the Q4_1 GEMV does it at batch 1 (gguf_kernels.cpp):
// x rounded to int16 per 32 columns, integer multiply-adds over each sub-block's nibbles,
// times d*sc and x's scale, less dmin*m times the sub-block's float sum of x. Each 32 bytes
// of nibbles hold sub-blocks 2c (low nibbles) and 2c+1 (high ones).
// Q5_K likewise, each value's fifth bit (16) added from its high-bit byte.
template <int64_t QT>
float q4_5_k_row_dot1(const uint8_t* w, int64_t blocks, const Int16Row& x, const float* sums) {
  constexpr int64_t stride = block_bytes(QT), quants = QT == kQ4_K ? 16 : 48;
  const __m256i mask = _mm256_set1_epi16(0x0f), one = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  float mins = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * stride;
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    const uint8_t* q = block + quants;
    for (int c = 0; c < 4; ++c, q += 32) {
      const int64_t j = b * 8 + 2 * c;  // x's 32-column block under the low nibbles
      float sc0, m0, sc1, m1;
      q4k_scale_min(2 * c, block + 4, &sc0, &m0);
      q4k_scale_min(2 * c + 1, block + 4, &sc1, &m1);
      const __m256i w0 = _mm256_cvtepu8_epi16(load16(q));
      const __m256i w1 = _mm256_cvtepu8_epi16(load16(q + 16));
      __m256i lo0 = _mm256_and_si256(w0, mask), lo1 = _mm256_and_si256(w1, mask);
      __m256i hi0 = _mm256_srli_epi16(w0, 4), hi1 = _mm256_srli_epi16(w1, 4);
      if (QT == kQ5_K) {
        const __m256i h0 = _mm256_cvtepu8_epi16(load16(block + 16));
        const __m256i h1 = _mm256_cvtepu8_epi16(load16(block + 32));
        const __m128i shift = _mm_cvtsi32_si128(2 * c), next = _mm_cvtsi32_si128(2 * c + 1);
        auto bit = [&](__m256i h, __m128i s) {
          return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, s), one), 4);
        };
        lo0 = _mm256_add_epi16(lo0, bit(h0, shift));
        lo1 = _mm256_add_epi16(lo1, bit(h1, shift));
        hi0 = _mm256_add_epi16(hi0, bit(h0, next));
        hi1 = _mm256_add_epi16(hi1, bit(h1, next));
      }
      const __m256i* x0 = reinterpret_cast<const __m256i*>(x.q.data() + j * kBlock);
      const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(lo0, _mm256_loadu_si256(x0)),
                                          _mm256_madd_epi16(lo1, _mm256_loadu_si256(x0 + 1)));
      const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(hi0, _mm256_loadu_si256(x0 + 2)),
                                          _mm256_madd_epi16(hi1, _mm256_loadu_si256(x0 + 3)));
      acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(d * sc0 * x.scale[j]),
                               acc[0]);
      acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi),
                               _mm256_set1_ps(d * sc1 * x.scale[j + 1]), acc[1]);
      mins += dmin * m0 * sums[j] + dmin * m1 * sums[j + 1];
    }
  }
  return hsum(_mm256_add_ps(acc[0], acc[1])) - mins;
}

// One Q6_K row against one row of x at batch 1: x in int16 per 32 columns, integer
// multiply-adds over the centred 6-bit values (q - 32), one float scale per 16 values
// (d * sc * x's scale). In each half of a super-block, byte l of the low nibbles and of the
// high 2 bits builds values l, l+32, l+64, l+96 (expand_q6_k's order).
float q6_k_row_dot1(const uint8_t* w, int64_t blocks, const Int16Row& x) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * block_bytes(kQ6_K);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_to_float(block + 208);
    for (int half = 0; half < 2; ++half) {
      __m256i values[4];
      q6_k_values(block, half, values);
      for (int i = 0; i < 4; ++i) {
        const int64_t j = b * 8 + half * 4 + i;  // x's 32-column block
        const __m256i* xb = reinterpret_cast<const __m256i*>(x.q.data() + j * kBlock);
        const __m256i first = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(values[i])), _mm256_loadu_si256(xb));
        const __m256i second = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(values[i], 1)),
            _mm256_loadu_si256(xb + 1));
        const float scale = d * x.scale[j];
        const int s = 8 * half + 2 * i;  // the scales of values 0..15 and 16..31
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_set1_ps(scale * sc[s]),
                                 acc[0]);
        acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second),
                                 _mm256_set1_ps(scale * sc[s + 1]), acc[1]);
      }
    }
  }
  return hsum(_mm256_add_ps(acc[0], acc[1]));
}

// One Q3_K row against one row of x at batch 1, as q6_k_row_dot1: x in int16 per 32 columns,
// integer multiply-adds over the centred values (2 bits less 4 where the high bit is clear),
// one float scale per 16 values (d * (sc - 32) * x's scale). Each 32 value bytes hold four
// runs of 32 values, bits 2j of the bytes for run j; the high bits of run 4n + j are bit
// 4n + j of the 32 high-bit bytes.
float q3_k_row_dot1(const uint8_t* w, int64_t blocks, const Int16Row& x) {
  const __m256i low2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  const __m256i four = _mm256_set1_epi8(4);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * block_bytes(kQ3_K);
    float dl[16];
    q3_k_scales(block + 96, half_to_float(block + 108), dl);
    const __m256i hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    for (int n = 0; n < 2; ++n) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 +
                                                                           32 * n));
      for (int j = 0; j < 4; ++j) {
        const __m128i shift = _mm_cvtsi32_si128(2 * j), bit = _mm_cvtsi32_si128(4 * n + j);
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(hmask, bit), one);
        const __m256i values = _mm256_add_epi8(
            _mm256_sub_epi8(_mm256_and_si256(_mm256_srl_epi16(q, shift), low2), four),
            _mm256_slli_epi16(high, 2));
        const int64_t jx = b * 8 + 4 * n + j;  // x's 32-column block
        const __m256i* xb = reinterpret_cast<const __m256i*>(x.q.data() + jx * kBlock);
        const __m256i first = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(values)), _mm256_loadu_si256(xb));
        const __m256i second = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(values, 1)),
            _mm256_loadu_si256(xb + 1));
        const float scale = x.scale[jx];
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first),
                                 _mm256_set1_ps(dl[8 * n + 2 * j] * scale), acc[0]);
        acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second),
                                 _mm256_set1_ps(dl[8 * n + 2 * j + 1] * scale), acc[1]);
      }
    }
  }
  return hsum(_mm256_add_ps(acc[0], acc[1]));
}
#endif

}  // namespace

void k_quant_gemv(const uint8_t* w, int64_t row_stride, int64_t n, int64_t blocks,
                  const float* x, int64_t k, int64_t rows, int64_t qtype, float* y) {
  const int64_t stride = block_bytes(qtype);
#ifdef DEEPINFER_AVX2
  if (rows == 1 && qtype != kQ2_K) {  // Q2_K: expanded as for several rows
    const Int16Row xq = round_to_int16(x, k / kBlock);
    const std::vector<float> sums = block_sums(x, k / kBlock);
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* row = w + r * row_stride;
        y[r] = qtype == kQ4_K   ? q4_5_k_row_dot1<kQ4_K>(row, blocks, xq, sums.data())
               : qtype == kQ5_K ? q4_5_k_row_dot1<kQ5_K>(row, blocks, xq, sums.data())
               : qtype == kQ3_K ? q3_k_row_dot1(row, blocks, xq)
                                : q6_k_row_dot1(row, blocks, xq);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float values[kSuperBlock];
    float sums[16];
    for (int64_t r = begin; r < end; ++r) {
      std::fill(sums, sums + rows, 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        expand(qtype, w + r * row_stride + b * stride, values);
        for (int64_t m = 0; m < rows; ++m) sums[m] += dot256(values, x + m * k + b * kSuperBlock);
      }
      for (int64_t m = 0; m < rows; ++m) y[m * n + r] = sums[m];
    }
  });
}

namespace {

void dequantize_rows(const uint8_t* w, int64_t row_stride, int64_t begin, int64_t end,
                     int64_t blocks, int64_t qtype, float* out) {
  const int64_t stride = block_bytes(qtype);
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      expand(qtype, w + r * row_stride + b * stride, out + (r * blocks + b) * kSuperBlock);
    }
  }
}

}  // namespace

void k_quant_dequantize(const uint8_t* w, int64_t row_stride, int64_t n, int64_t blocks,
                        int64_t qtype, bool interleaved, float* out) {
  if (!interleaved) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      dequantize_rows(w, row_stride, begin, end, blocks, qtype, out);
    });
    return;
  }
  at::parallel_for(0, n / kInterleave, 2, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> group(kInterleave * row_stride);
    for (int64_t g = begin; g < end; ++g) {  // each group restored to the file's layout
      restore_group(w, blocks, qtype, g, group.data());
      dequantize_rows(group.data(), row_stride, 0, kInterleave, blocks, qtype,
                      out + g * kInterleave * blocks * kSuperBlock);
    }
  });
}

}  // namespace deepinfer_gguf
