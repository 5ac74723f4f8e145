// What the GGUF block kernels share: the block types they take and the fp16 their scales are
// stored in; the k-quants' entry points (gguf_kquants.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#endif

namespace deepinfer_gguf {

enum QType : int64_t {  // GGMLQuantizationType values
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};
constexpr int kBlock = 32;        // values in a Q4_0/Q4_1/Q8_0 block, and in x's int16 blocks
constexpr int kSuperBlock = 256;  // values in a k-quant super-block
constexpr int64_t kInterleave = 8;  // rows of an interleaved weight's group (gguf_rows8.cpp)

// f(std::integral_constant<int64_t, QT>{}) for a 32-value block type: the kernels are
// templates on the type, so their inner loops have no branch on it.
template <typename F>
void with_block_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); break;
    default: f(std::integral_constant<int64_t, kQ8_0>{}); break;
  }
}

inline bool is_k_quant(int64_t qtype) {
  return qtype >= kQ2_K && qtype <= kQ6_K;
}

// Bytes a block (a k-quant's: a super-block) of the type takes; 0 for a type not taken here.
constexpr int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

#ifdef DEEPINFER_AVX2
// The sum of v's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef DEEPINFER_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float value;
  if (exp == 0) {
    value = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    value = man ? NAN : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits |= sign;
  std::memcpy(&value, &bits, 4);
  return value;
#endif
}

// Per row of x, the sum of each 32-column block (what a block's offset or minimum multiplies).
std::vector<float> block_sums(const float* x, int64_t blocks);

// One row of x (decode at batch 1) rounded to int16 per 32-column block: x ~= scale * q with
// scale = max|x| / 32767, a relative error ~1e-5 of the block's largest value (llama.cpp's
// int8 rounding is ~256 times coarser, and moved the default model's first answer token).
struct Int16Row {
  std::vector<int16_t> q;
  std::vector<float> scale;
};
Int16Row round_to_int16(const float* x, int64_t blocks);

// y [rows, n] = x [rows, k] @ W.T for W's n rows of `blocks` k-quant super-blocks.
void k_quant_gemv(const uint8_t* w, int64_t row_stride, int64_t n, int64_t blocks,
                  const float* x, int64_t k, int64_t rows, int64_t qtype, float* y);
// The float32 weight [n, blocks * 256] (its rows interleaved by 8 or not: Q4_K).
void k_quant_dequantize(const uint8_t* w, int64_t row_stride, int64_t n, int64_t blocks,
                        int64_t qtype, bool interleaved, float* out);

// Rows interleaved in groups of 8 (gguf_rows8.cpp): the types that may be (the 32-value
// types and Q4_K), group g restored to the file's layout (out: [8, blocks * block bytes]), and
// the GEMV over them, y [n, rows] (blocks: a row's blocks, Q4_K's super-blocks; sums: each row
// of x's block_sums per 32 columns; AVX2 builds only).
bool interleavable(int64_t qtype);
void restore_group(const uint8_t* w, int64_t blocks, int64_t qtype, int64_t g, uint8_t* out);
void interleaved_gemv(const uint8_t* w, int64_t n, int64_t blocks, const float* x, int64_t k,
                      int64_t rows, const std::vector<float>* sums, int64_t qtype, float* y);

}  // namespace deepinfer_gguf
