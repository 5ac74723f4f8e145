// GGUF block-quantized matmuls on the CPU, over the blocks exactly as a .gguf file stores them.
//
// A weight [N, K] is N rows of K/32 blocks (the k-quants, K/256 super-blocks: gguf_kquants.cpp).
// Q4_0: {fp16 d; 16 bytes of nibbles} (w = d*(q-8)),
// Q4_1: {fp16 d; fp16 m; 16 bytes} (w = d*q + m), Q8_0: {fp16 d; int8 q[32]} (w = d*q). In a
// 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high one.
//
// Decode (a few rows of x) is bound by the weight bytes. At batch 1, gemv() rounds x to int16
// per block and runs integer multiply-adds over the blocks' values (row_dot1); with more rows
// it expands each block's values to float32 in registers and multiplies them by x as it is,
// so its products are the dequantized weight's. Either way greedy decoding follows the float32
// path through near-ties (llama.cpp instead rounds x to int8 per block, which moved the
// default model's first answer token).
// Each weight byte is read once for all rows of x. Prefill (many rows) is compute-bound:
// dequantize() writes float32 rows for a BLAS GEMM instead. The backend stores Q4_0, Q4_1,
// Q5_0, Q5_1 and Q8_0 weights with their rows interleaved by 8 (gguf_rows8.cpp: their GEMV,
// one row per vector lane, x rounded to int16 at every row count); dequantize() takes those a
// group of 8 rows at a time, restored to the file's layout.
// ATen's tensor and the few ops used here, not <torch/extension.h>: that header (all of
// libtorch's C++ API and the Python bindings) is most of the build's time; only bindings.cpp
// needs the bindings.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "native_ops.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(DEEPINFER_AVX2)
#define DEEPINFER_VNNI 1  // 256-bit vpdpwssd (EVEX), and 32 vector registers
#endif

namespace deepinfer_gguf {

// Per row of x, the sum of each 32-column block: Q4_0's -8 and Q4_1's minimum multiply it.
std::vector<float> block_sums(const float* x, int64_t blocks) {
  std::vector<float> sums(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    float s = 0.f;
    for (int i = 0; i < kBlock; ++i) s += x[b * kBlock + i];
    sums[b] = s;
  }
  return sums;
}

Int16Row round_to_int16(const float* x, int64_t blocks) {
  Int16Row row{std::vector<int16_t>(blocks * kBlock), std::vector<float>(blocks)};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    row.scale[b] = amax / 32767.f;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int i = 0; i < kBlock; ++i) {
      row.q[b * kBlock + i] = static_cast<int16_t>(std::nearbyint(xb[i] * inv));
    }
  }
  return row;
}

}  // namespace deepinfer_gguf

namespace {

using namespace deepinfer_gguf;

constexpr int kMaxRows = 16;  // rows of x one gemv() call takes (decode batches)

int64_t block_values(int64_t qtype) { return is_k_quant(qtype) ? kSuperBlock : kBlock; }

// The 32-value types at compile time: where its nibbles start, whether it has a minimum
// (Q4_1, Q5_1: w = d*q + m) and a fifth bit per value (Q5_0, Q5_1: 4 bytes of them after the
// scales, bit i for value i), and the value its integers centre on.
template <int64_t QT>
constexpr int64_t nibbles_at() {
  return QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : QT == kQ5_0 ? 6 : 8;
}
template <int64_t QT>
constexpr bool has_min() { return QT == kQ4_1 || QT == kQ5_1; }
template <int64_t QT>
constexpr bool has_fifth_bit() { return QT == kQ5_0 || QT == kQ5_1; }
template <int64_t QT>
constexpr int centre_of() { return has_fifth_bit<QT>() ? 16 : 8; }

// What d times a block's raw values (uncentred, as expand gives them) is offset by: the
// minimum m (Q4_1, Q5_1), -8d or -16d (Q4_0, Q5_0), nothing for Q8_0's signed values.
template <int64_t QT>
float raw_offset(const uint8_t* block, float d) {
  if (has_min<QT>()) return half_to_float(block + 2);
  return QT == kQ8_0 ? 0.f : -static_cast<float>(centre_of<QT>()) * d;
}

// The fifth bits of a Q5 block's 32 values as 0 or 16 (scalar path).
inline int fifth_bit(const uint8_t* qh, int i) { return ((qh[i / 8] >> (i % 8)) & 1) << 4; }

#ifdef DEEPINFER_AVX2
// A Q5 block's 32 fifth bits (4 bytes, bit i for value i) as bytes 0 or 16, byte i for value
// i: each byte of the word broadcast to 8 lanes, one bit tested a lane (as ggml's
// bytes_from_bits_32).
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i set = _mm256_cmpeq_epi8(
      _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi8(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

inline __m256 widen_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
inline __m256 widen_s8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// The block's 32 integer values (Q4: 0..15, Q8: signed) as four vectors of 8 floats, in order.
template <int64_t QT>
inline void expand(const uint8_t* block, __m256 v[4]) {
  if (QT == kQ8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
    v[0] = widen_s8(lo);
    v[1] = widen_s8(_mm_srli_si128(lo, 8));
    v[2] = widen_s8(hi);
    v[3] = widen_s8(_mm_srli_si128(hi, 8));
    return;
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      block + nibbles_at<QT>()));
  const __m128i mask = _mm_set1_epi8(0x0f);
  __m128i lo = _mm_and_si128(packed, mask);                     // elements 0..15
  __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // elements 16..31
  if (has_fifth_bit<QT>()) {
    const __m256i bits = fifth_bits(block + nibbles_at<QT>() - 4);
    lo = _mm_or_si128(lo, _mm256_castsi256_si128(bits));
    hi = _mm_or_si128(hi, _mm256_extracti128_si256(bits, 1));
  }
  v[0] = widen_u8(lo);
  v[1] = widen_u8(_mm_srli_si128(lo, 8));
  v[2] = widen_u8(hi);
  v[3] = widen_u8(_mm_srli_si128(hi, 8));
}
#endif

// sum over the block of its integer values times x (the scalar build's path).
template <int64_t QT>
float dot_scalar(const uint8_t* block, const float* x) {
  float acc = 0.f;
  if (QT == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < kBlock; ++i) acc += q[i] * x[i];
    return acc;
  }
  const uint8_t* qs = block + nibbles_at<QT>();
  for (int j = 0; j < 16; ++j) {
    int lo = qs[j] & 0x0f, hi = qs[j] >> 4;
    if (has_fifth_bit<QT>()) {
      lo += fifth_bit(qs - 4, j);
      hi += fifth_bit(qs - 4, j + 16);
    }
    acc += lo * x[j] + hi * x[j + 16];
  }
  return acc;
}

// One weight row against every row of x: out[m] = sum over blocks of
// d * (values . x_block) + offset * sum(x_block). The block type is a template parameter so
// the inner loop has no branches on it; the block is expanded once for all rows of x.
template <int64_t QT>
void row_dot(const uint8_t* w, int64_t blocks, const float* x, int64_t k,
             const std::vector<float>* sums, int64_t rows, float* out) {
  constexpr int64_t stride = block_bytes(QT);
#ifdef DEEPINFER_AVX2
  __m256 acc[kMaxRows];
  for (int64_t m = 0; m < rows; ++m) acc[m] = _mm256_setzero_ps();
#endif
  float extra[kMaxRows] = {0.f};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * stride;
    const float d = half_to_float(block);
    const float offset = raw_offset<QT>(block, d);
#ifdef DEEPINFER_AVX2
    __m256 v[4];
    expand<QT>(block, v);
    const __m256 dv = _mm256_set1_ps(d);
#endif
    for (int64_t m = 0; m < rows; ++m) {
      const float* xb = x + m * k + b * kBlock;
#ifdef DEEPINFER_AVX2
      __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
      t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t);
      t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t);
      t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t);
      acc[m] = _mm256_fmadd_ps(t, dv, acc[m]);
#else
      extra[m] += d * dot_scalar<QT>(block, xb);
#endif
      if (QT != kQ8_0) extra[m] += offset * sums[m][b];
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
#ifdef DEEPINFER_AVX2
    out[m] = hsum(acc[m]) + extra[m];
#else
    out[m] = extra[m];
#endif
  }
}

#ifdef DEEPINFER_AVX2
// The block's 32 integer values as two vectors of 16 int16 (elements 0..15, 16..31); 4-bit
// values centred (q - 8), so the products stay small and Q4_0 needs no offset term.
template <int64_t QT>
inline void expand_i16(const uint8_t* block, __m256i& lo, __m256i& hi) {
  if (QT == kQ8_0) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18)));
    return;
  }
  // Each byte widened to an int16 lane first: its low nibble is then lane & 15 and its high
  // one lane >> 4, with no mask for the shift (four instructions where bytes took seven).
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
      block + nibbles_at<QT>())));
  const __m256i centre = _mm256_set1_epi16(centre_of<QT>());
  lo = _mm256_sub_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0f)), centre);
  hi = _mm256_sub_epi16(_mm256_srli_epi16(bytes, 4), centre);
  if (has_fifth_bit<QT>()) {
    const __m256i bits = fifth_bits(block + nibbles_at<QT>() - 4);
    lo = _mm256_add_epi16(lo, _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bits)));
    hi = _mm256_add_epi16(hi, _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bits, 1)));
  }
}

// The block's 32 products as 8 int32 lanes (lane i: values 2i, 2i+1, 16+2i, 17+2i): VNNI's
// vpdpwssd multiplies and adds in one instruction where it is built for (the same integers).
inline __m256i block_dot(__m256i lo, __m256i hi, const __m256i* xb) {
#ifdef DEEPINFER_VNNI
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(xb)), hi,
                             _mm256_loadu_si256(xb + 1));
#else
  return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(xb)),
                          _mm256_madd_epi16(hi, _mm256_loadu_si256(xb + 1)));
#endif
}

// The fp16 in the low half of each 32-bit lane, as 8 floats.
inline __m256 low_halves(__m256i words) {
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, pick), 0x08);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

// row_dot for one row of x: integer multiply-adds (vpmaddwd, 16 products an instruction) over
// the int16 row, one float scale per block; four blocks in flight, each with its own
// accumulator. Q4_1's w = d*q + m = d*(q - 8) + (m + 8d): the offset multiplies the block's
// float32 sum of x. Eight blocks at a time, their fp16 d (and m) are read by one gather and
// converted, scaled and (Q4_1's offset) multiplied by their sums as vectors: one per block,
// these scalar conversions were as many instructions as the block's integer dot.
template <int64_t QT>
float row_dot1(const uint8_t* w, int64_t blocks, const Int16Row& x, const float* sums) {
  constexpr int stride = block_bytes(QT);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  __m256 offsets = _mm256_setzero_ps();  // Q4_1: sum over blocks of (m + 8d) * sum(x_block)
  float tail_offsets = 0.f;
  auto dot = [&](int64_t b, int u, float scale) {
    const uint8_t* block = w + b * stride;
    __m256i lo, hi;
    expand_i16<QT>(block, lo, hi);
    const __m256i* xb = reinterpret_cast<const __m256i*>(x.q.data() + b * kBlock);
    acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(lo, hi, xb)), _mm256_set1_ps(scale),
                             acc[u]);
  };
  const __m256i at = _mm256_setr_epi32(0, stride, 2 * stride, 3 * stride, 4 * stride,
                                       5 * stride, 6 * stride, 7 * stride);
  alignas(32) float scales[8];
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    // Each block's first 4 bytes: d, and Q4_1's m after it.
    const __m256i words = _mm256_i32gather_epi32(reinterpret_cast<const int*>(w + b * stride),
                                                  at, 1);
    const __m256 d = low_halves(words);
    _mm256_store_ps(scales, _mm256_mul_ps(d, _mm256_loadu_ps(x.scale.data() + b)));
    if (has_min<QT>()) {
      const __m256 m = low_halves(_mm256_srli_epi32(words, 16));
      offsets = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(centre_of<QT>()), d, m),
                                _mm256_loadu_ps(sums + b), offsets);
    }
    for (int i = 0; i < 8; ++i) dot(b + i, i & 3, scales[i]);
  }
  for (; b < blocks; ++b) {
    const uint8_t* block = w + b * stride;
    const float d = half_to_float(block);
    dot(b, 0, d * x.scale[b]);
    if (has_min<QT>()) {
      tail_offsets += (half_to_float(block + 2) + static_cast<float>(centre_of<QT>()) * d) *
                      sums[b];
    }
  }
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  return hsum(sum) + (hsum(offsets) + tail_offsets);
}
#endif

template <int64_t QT>
void gemv_rows(const uint8_t* w, int64_t row_stride, int64_t n, int64_t blocks, const float* x,
               int64_t k, const std::vector<float>* sums, int64_t rows, float* y) {
#ifdef DEEPINFER_AVX2
  if (rows == 1) {
    const Int16Row xq = round_to_int16(x, blocks);
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        y[r] = row_dot1<QT>(w + r * row_stride, blocks, xq, sums[0].data());
      }
    });
    return;
  }
#endif
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row_dot<QT>(w + r * row_stride, blocks, x, k, sums, rows, y + r * rows);
    }
  });
}

// Value i of a 32-value block as the integer its scale multiplies (scalar builds).
template <int64_t QT>
int block_value(const uint8_t* block, int i) {
  if (QT == kQ8_0) return reinterpret_cast<const int8_t*>(block + 2)[i];
  const uint8_t* qs = block + nibbles_at<QT>();
  const int nibble = i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4;
  return has_fifth_bit<QT>() ? nibble + fifth_bit(qs - 4, i) : nibble;
}

// Rows [begin, end) of 32-value blocks as float32: d * value + offset, the values expanded as
// the several-row GEMV expands them. Each product is exact in float32 (an fp16 scale times an
// integer of at most 8 bits), so every weight is the one rounding gguf-py's is.
template <int64_t QT>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t begin, int64_t end,
                     int64_t blocks, float* out) {
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w + r * row_bytes + b * block_bytes(QT);
      float* o = out + (r * blocks + b) * kBlock;
      const float d = half_to_float(block);
      const float offset = raw_offset<QT>(block, d);
#ifdef DEEPINFER_AVX2
      __m256 v[4];
      expand<QT>(block, v);
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(d)),
                                                  _mm256_set1_ps(offset)));
      }
#else
      for (int i = 0; i < kBlock; ++i) o[i] = d * block_value<QT>(block, i) + offset;
#endif
    }
  }
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t k, bool interleaved) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "GGUF weight must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(block_bytes(qtype) > 0, "unsupported GGUF block type ", qtype);
  const int64_t values = block_values(qtype);
  TORCH_CHECK(k % values == 0, "GGUF rows hold whole ", values, "-column blocks; K=", k);
  TORCH_CHECK(w.size(1) == k / values * block_bytes(qtype), "row bytes ", w.size(1),
              " do not match K=", k, " of type ", qtype);
  TORCH_CHECK(!interleaved || (interleavable(qtype) && w.size(0) % kInterleave == 0),
              "rows of type ", qtype, " x ", w.size(0), " are not interleaved in groups of ",
              kInterleave);
}

template <int64_t QT>
void gemv_any(const uint8_t* w, int64_t row_stride, int64_t n, int64_t blocks, const float* x,
              int64_t k, const std::vector<float>* sums, int64_t rows, bool interleaved,
              float* y) {
  if (interleaved) {
    interleaved_gemv(w, n, blocks, x, k, rows, sums, QT, y);
  } else {
    gemv_rows<QT>(w, row_stride, n, blocks, x, k, sums, rows, y);
  }
}

}  // namespace

// y [M, N] = x [M, K] @ W.T for M <= 16, x float32; W's blocks as stored in the file, or
// with its rows interleaved in groups of 8 (gguf_rows8.cpp).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t qtype, bool interleaved) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "x must be float32 [M, K]");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0), blocks = k / kBlock;
  TORCH_CHECK(rows <= kMaxRows, "gemv takes at most ", kMaxRows, " rows, got ", rows);
  check_weight(w, qtype, k, interleaved);
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  if (is_k_quant(qtype) && !interleaved) {
    at::Tensor y = at::empty({rows, n}, x.options());
    k_quant_gemv(w.data_ptr<uint8_t>(), w.size(1), n, k / kSuperBlock, xp, k, rows, qtype,
                 y.data_ptr<float>());
    return y;
  }
  std::vector<std::vector<float>> sums;
  for (int64_t m = 0; m < rows; ++m) sums.push_back(block_sums(xp + m * k, blocks));
  at::Tensor y = at::empty({n, rows}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = w.size(1);
  if (is_k_quant(qtype)) {  // interleaved Q4_K
    interleaved_gemv(wp, n, k / kSuperBlock, xp, k, rows, sums.data(), qtype, yp);
  } else {
    with_block_type(qtype, [&](auto qt) {
      gemv_any<qt.value>(wp, stride, n, blocks, xp, k, sums.data(), rows, interleaved, yp);
    });
  }
  return y.t().contiguous();
}

template <int64_t QT>
void dequantize_any(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t blocks,
                    bool interleaved, float* out) {
  if (!interleaved) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      dequantize_rows<QT>(w, row_bytes, begin, end, blocks, out);
    });
    return;
  }
  at::parallel_for(0, n / kInterleave, 2, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> group(kInterleave * row_bytes);
    for (int64_t g = begin; g < end; ++g) {
      restore_group(w, blocks, QT, g, group.data());
      dequantize_rows<QT>(group.data(), row_bytes, 0, kInterleave, blocks,
                          out + g * kInterleave * blocks * kBlock);
    }
  });
}

namespace {

// n rows of a weight (w: its first row's bytes) as float32 into out. Inside a parallel region
// (dequantize_bf16's chunks) the loops below run on the calling thread.
void dequantize_rows_to(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t qtype,
                        int64_t k, bool interleaved, float* out) {
  if (is_k_quant(qtype)) {
    k_quant_dequantize(w, row_bytes, n, k / kSuperBlock, qtype, interleaved, out);
    return;
  }
  with_block_type(qtype, [&](auto qt) {
    dequantize_any<qt.value>(w, row_bytes, n, k / kBlock, interleaved, out);
  });
}

// Rows a thread expands to float32 at a time before rounding them to bfloat16: a multiple of
// the interleave, and few enough to stay in its cache (1 MiB for 4096-column rows).
constexpr int64_t kBf16ChunkRows = 64;

}  // namespace

// The float32 weight [N, K] (for a GEMM over many rows, or an embedding lookup).
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t k, bool interleaved) {
  check_weight(w, qtype, k, interleaved);
  at::Tensor out = at::empty({w.size(0), k}, at::dtype(at::kFloat));
  dequantize_rows_to(w.data_ptr<uint8_t>(), w.size(1), w.size(0), qtype, k, interleaved,
                     out.data_ptr<float>());
  return out;
}

// The same weight as bfloat16 [N, K], for a bfloat16 GEMM: each chunk of rows is expanded to
// float32 in a buffer of its thread and rounded (to nearest even, as torch's conversion) into
// the output, so the float32 weight never goes to memory.
at::Tensor dequantize_bf16(const at::Tensor& w, int64_t qtype, int64_t k, bool interleaved) {
  check_weight(w, qtype, k, interleaved);
  const int64_t n = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({n, k}, at::dtype(at::kBFloat16));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t chunks = (n + kBf16ChunkRows - 1) / kBf16ChunkRows;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kBf16ChunkRows * k);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t r0 = c * kBf16ChunkRows, rows = std::min(kBf16ChunkRows, n - r0);
      dequantize_rows_to(wp + r0 * row_bytes, row_bytes, rows, qtype, k, interleaved,
                         buf.data());
      at::BFloat16* o = op + r0 * k;
      for (int64_t i = 0; i < rows * k; ++i) o[i] = at::BFloat16(buf[i]);
    }
  });
  return out;
}

// A gated MLP's decode step in one call: down(silu(gate) * up) with gate|up one [2F, K] GGUF
// weight, x float32 [M <= 16, K]. The same ops, in the same order, as the three torch calls
// it replaces (gemv, silu and mul, gemv); at batch 1 their Python, not their bytes, is what
// one call saves.
at::Tensor gguf_mlp(const at::Tensor& x, const at::Tensor& gate_up, int64_t gate_up_type,
                    bool gate_up_interleaved, const at::Tensor& down, int64_t down_type,
                    bool down_interleaved) {
  const at::Tensor h = gemv(x, gate_up, gate_up_type, gate_up_interleaved);
  const int64_t f = h.size(1) / 2;
  return gemv(at::silu(h.narrow(1, 0, f)).mul_(h.narrow(1, f, f)), down, down_type,
              down_interleaved);
}
