// GGUF weights with their rows interleaved in groups of 8, for the batch-1 GEMV.
//
// In the file's layout a GEMV dots one weight row at a time: each 32-value block's integer dot
// ends in 8 partial lanes that need their own float scale, and each row ends in a horizontal
// sum. With 8 rows side by side each vector lane is one row: the x pair a multiply-add needs is
// one broadcast shared by the 8 rows, a block's 8 scales are one fp16 load, and the 8 results
// come out as one vector. The CPU backend interleaves Q4_0, Q4_1 and Q8_0 weights of N % 8 == 0
// rows once at load (CPUOps.prepare_weights; GGUFWeight.interleave) -- the bytes are the
// file's, reordered:
//
//   the file's [N, B blocks, S bytes] seen as 2-byte units [N/8, 8 rows, B, S/2, 2]
//   is stored as                                          [N/8, B, S/2, 8 rows, 2].
//
// So in a group's block: Q4_0 and Q8_0 start with the 8 rows' fp16 d, Q4_1 with the 8 d then
// the 8 m; then 16 bytes per unit j of nibble pairs (Q4: row r's bytes 2j and 2j+1, i.e.
// values 2j, 2j+1 in the low nibbles and 16+2j, 17+2j in the high ones) or of int8 pairs
// (Q8_0: values 2j, 2j+1). Widened to int16, lane pair (2r, 2r+1) is row r's pair of values:
// vpmaddwd against the broadcast x pair gives row r's two products in 32-bit lane r.
//
// The integers are the file-layout GEMV's (x rounded to int16 per block; Q4 values centred by
// subtracting 8 * the block's sum of x's integers, exact), so the results equal it up to the
// float rounding of the scale products. Several rows of x and the GEMM's dequantization take
// the interleaved weight a group at a time, restored to the file's layout in a small buffer.
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"

namespace deepinfer_gguf {

bool interleavable(int64_t qtype) { return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0; }

// Group g's rows in the file's layout: out [8, blocks * S].
void restore_group(const uint8_t* w, int64_t blocks, int64_t qtype, int64_t g, uint8_t* out) {
  const int64_t s = block_bytes(qtype), units = s / 2, row_bytes = blocks * s;
  const uint8_t* group = w + g * kInterleave * row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * kInterleave * s;
    for (int64_t u = 0; u < units; ++u) {
      for (int64_t r = 0; r < kInterleave; ++r) {
        std::memcpy(out + r * row_bytes + b * s + 2 * u, block + (u * kInterleave + r) * 2, 2);
      }
    }
  }
}

}  // namespace deepinfer_gguf

namespace {

using namespace deepinfer_gguf;

#ifdef DEEPINFER_AVX2
// acc + the int16 pairs of v times the pair at x (two int16), per 32-bit lane.
inline __m256i dot_pairs(__m256i acc, __m256i v, const int16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, v, _mm256_set1_epi32(pair));
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_set1_epi32(pair)));
#endif
}

// One block of 8 interleaved rows: per row, the integer dot of its 32 values (Q4: as stored,
// 0..15) with x's 32 int16, in lane r. Four accumulators keep the multiply-adds' latency off
// the critical path.
template <int64_t QT>
inline __m256i group_block_dot(const uint8_t* quants, const int16_t* x) {
  __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                  _mm256_setzero_si256()};
  if (QT == kQ8_0) {
    for (int j = 0; j < 16; ++j) {
      const __m256i v = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + 16 * j)));
      s[j & 3] = dot_pairs(s[j & 3], v, x + 2 * j);
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      const __m256i bytes = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + 16 * j)));
      const int a = (j & 1) * 2;
      s[a] = dot_pairs(s[a], _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f)), x + 2 * j);
      s[a + 1] = dot_pairs(s[a + 1], _mm256_srli_epi16(bytes, 4), x + 16 + 2 * j);
    }
  }
  return _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
}

// The 8 rows of group `group` (its blocks) times one int16 row of x: out[0..8).
// Q4_0: d * (q - 8) . x, the centring as 8 * sum(x's integers) per block (exact integers);
// Q4_1: d * (q - 8) . x as Q4_0's, plus (m + 8d) * sum(x) in float (the file-layout GEMV's
// split, so both round x the same way); Q8_0: d * q . x.
template <int64_t QT>
void group_dot1(const uint8_t* group, int64_t blocks, const Int16Row& x,
                const std::vector<int32_t>& int_sums, const float* sums, float* out) {
  constexpr int64_t s = block_bytes(QT);
  constexpr int64_t header = (QT == kQ4_1 ? 4 : 2) * kInterleave;  // d (and m) of 8 rows
  __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * kInterleave * s;
    __m256i dot = group_block_dot<QT>(block + header, x.q.data() + b * kBlock);
    if (QT != kQ8_0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * int_sums[b]));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[b])),
                          acc);
    if (QT == kQ4_1) {
      const __m256 m = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 * kInterleave)));
      offsets = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(8.f), d, m),
                                _mm256_set1_ps(sums[b]), offsets);
    }
  }
  _mm256_storeu_ps(out, _mm256_add_ps(acc, offsets));
}
#endif

}  // namespace

namespace deepinfer_gguf {

bool interleaved_gemv1(const uint8_t* w, int64_t n, int64_t blocks, const float* x,
                       int64_t qtype, float* y) {
#ifdef DEEPINFER_AVX2
  const Int16Row xq = round_to_int16(x, blocks);
  std::vector<int32_t> int_sums(blocks, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < kBlock; ++i) int_sums[b] += xq.q[b * kBlock + i];
  }
  const std::vector<float> sums = block_sums(x, blocks);
  const int64_t group_bytes = kInterleave * blocks * block_bytes(qtype);
  at::parallel_for(0, n / kInterleave, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = w + g * group_bytes;
      float* out = y + g * kInterleave;
      switch (qtype) {
        case kQ4_0: group_dot1<kQ4_0>(group, blocks, xq, int_sums, sums.data(), out); break;
        case kQ4_1: group_dot1<kQ4_1>(group, blocks, xq, int_sums, sums.data(), out); break;
        default: group_dot1<kQ8_0>(group, blocks, xq, int_sums, sums.data(), out); break;
      }
    }
  });
  return true;
#else
  (void)w, (void)n, (void)blocks, (void)x, (void)qtype, (void)y;
  return false;
#endif
}

}  // namespace deepinfer_gguf
