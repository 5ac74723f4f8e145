// GGUF weights with their rows interleaved in groups of 8, for the batch-1 GEMV.
//
// In the file's layout a GEMV dots one weight row at a time: each 32-value block's integer dot
// ends in 8 partial lanes that need their own float scale, and each row ends in a horizontal
// sum. With 8 rows side by side each vector lane is one row: the x pair a multiply-add needs is
// one broadcast shared by the 8 rows, a block's 8 scales are one fp16 load, and the 8 results
// come out as one vector. The CPU backend interleaves Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_K
// weights of N % 8 == 0 rows once at load (CPUOps.prepare_weights;
// GGUFWeight.interleave_rows) -- the bytes are the file's, reordered:
//
//   the file's [N, B blocks, S bytes] seen as 2-byte units [N/8, 8 rows, B, S/2, 2]
//   is stored as                                          [N/8, B, S/2, 8 rows, 2].
//
// So a group's block holds the 8 rows' fp16 d, then (Q4_1, Q5_1) their 8 m, then (Q5) the low
// and the high 16 bits of their fifth bits, then 16 bytes per unit j of nibble pairs (row r's
// bytes 2j and 2j+1: values 2j, 2j+1 in the low nibbles and 16+2j, 17+2j in the high ones) or
// of int8 pairs (Q8_0: values 2j, 2j+1). Widened to int16, lane pair (2r, 2r+1) is row r's
// pair of values: vpmaddwd against the broadcast x pair gives row r's two products in 32-bit
// lane r.
//
// The integers are the file-layout batch-1 GEMV's (x rounded to int16 per block; Q4/Q5
// values centred by subtracting 8 or 16 * the block's sum of x's integers, exact), so the
// results equal it up to the float rounding of the scale products. Several rows of x (up to
// 16) are each rounded so, and up to 4 of them share each expanded block: a sequence's
// products do not depend on its batch. The GEMM's dequantization takes the weight a group
// at a time, restored to the file's layout in a small buffer. Builds without AVX2 do not
// interleave (kernels.interleaves).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"

namespace deepinfer_gguf {

bool interleavable(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 ||
         qtype == kQ8_0 || qtype == kQ4_K;
}

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

constexpr int kRowsAPass = 4;  // rows of x dotted with a group's expanded block at once

#ifdef DEEPINFER_AVX2
// A row of x as the kernels take it: rounded to int16 per block, each block's sum of those
// integers (the centring) and its float sum (Q4_1/Q5_1's minimum; gemv() computed it).
struct XRow {
  Int16Row q;
  std::vector<int32_t> int_sums;
  const float* sums;

  static XRow of(const float* x, int64_t blocks, const std::vector<float>& sums) {
    XRow row{round_to_int16(x, blocks), std::vector<int32_t>(blocks, 0), sums.data()};
    for (int64_t b = 0; b < blocks; ++b) {
      for (int i = 0; i < kBlock; ++i) row.int_sums[b] += row.q.q[b * kBlock + i];
    }
    return row;
  }
};

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

// Where a group's block keeps its parts (bytes from the block's start; 8 rows of each): the
// fp16 d, Q4_1/Q5_1's fp16 m, Q5's fifth bits (the 32-bit word as two 16-bit units), then
// the values.
template <int64_t QT>
constexpr int64_t mins_at() { return 2 * kInterleave; }
template <int64_t QT>
constexpr int64_t fifth_bits_at() { return (QT == kQ4_1 || QT == kQ5_1 ? 4 : 2) * kInterleave; }
template <int64_t QT>
constexpr int64_t values_at() {
  return fifth_bits_at<QT>() + (QT == kQ5_0 || QT == kQ5_1 ? 4 * kInterleave : 0);
}
template <int64_t QT>
constexpr int centre() { return QT == kQ8_0 ? 0 : QT == kQ5_0 || QT == kQ5_1 ? 16 : 8; }

// 16 bits of each of the 8 rows (a unit of 8 rows: row r's at bytes 2r, 2r+1) in both int16
// lanes of its pair.
inline __m256i both_lanes(const uint8_t* unit) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(unit)));
  return _mm256_or_si256(words, _mm256_slli_epi32(words, 16));
}

// A group's block of 8 interleaved rows as int16 vectors, lane pair (2r, 2r+1) row r's
// values: Q4/Q5: v[2j] its values (2j, 2j+1) as stored (0..15; Q5 0..31), v[2j+1] values
// (16+2j, 17+2j); Q8_0: v[j] values (2j, 2j+1). Expanded once for every row of x. Q5's fifth
// bit of value i is bit i of the row's word: lane 2r+t takes bit 2j+t of the unit (low: bits
// 0-15, high: 16-31), each step shifting both units right by two.
template <int64_t QT>
inline void expand_group_block(const uint8_t* block, __m256i v[16]) {
  constexpr bool fifth = QT == kQ5_0 || QT == kQ5_1;
  const uint8_t* quants = block + values_at<QT>();
  __m256i low_bits = _mm256_setzero_si256(), high_bits = _mm256_setzero_si256();
  if (fifth) {
    low_bits = both_lanes(block + fifth_bits_at<QT>());
    high_bits = both_lanes(block + fifth_bits_at<QT>() + 2 * kInterleave);
  }
  const __m256i pick = _mm256_set1_epi32(0x00020001);  // bit 0 in even lanes, bit 1 in odd
  const __m256i sixteen = _mm256_set1_epi16(16), zero = _mm256_setzero_si256();
  for (int j = 0; j < (QT == kQ8_0 ? 16 : 8); ++j) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + 16 * j));
    if (QT == kQ8_0) {
      v[j] = _mm256_cvtepi8_epi16(bytes);
      continue;
    }
    const __m256i wide = _mm256_cvtepu8_epi16(bytes);
    v[2 * j] = _mm256_and_si256(wide, _mm256_set1_epi16(0x0f));
    v[2 * j + 1] = _mm256_srli_epi16(wide, 4);
    if (fifth) {  // 16 where the lane's bit is set: not (bit == 0), and 16
      v[2 * j] = _mm256_add_epi16(v[2 * j], _mm256_andnot_si256(
          _mm256_cmpeq_epi16(_mm256_and_si256(low_bits, pick), zero), sixteen));
      v[2 * j + 1] = _mm256_add_epi16(v[2 * j + 1], _mm256_andnot_si256(
          _mm256_cmpeq_epi16(_mm256_and_si256(high_bits, pick), zero), sixteen));
      low_bits = _mm256_srli_epi16(low_bits, 2);
      high_bits = _mm256_srli_epi16(high_bits, 2);
    }
  }
}

// Per row r (lane r), the integer dot of its 32 values with x's 32 int16. Four accumulators
// keep the multiply-adds' latency off the critical path.
template <int64_t QT>
inline __m256i group_block_dot(const __m256i v[16], const int16_t* x) {
  __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                  _mm256_setzero_si256()};
  for (int j = 0; j < (QT == kQ8_0 ? 16 : 8); ++j) {
    if (QT == kQ8_0) {
      s[j & 3] = dot_pairs(s[j & 3], v[j], x + 2 * j);
    } else {
      const int a = (j & 1) * 2;
      s[a] = dot_pairs(s[a], v[2 * j], x + 2 * j);
      s[a + 1] = dot_pairs(s[a + 1], v[2 * j + 1], x + 16 + 2 * j);
    }
  }
  return _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
}

// The 8 rows of a group (its blocks) times R rows of x: out[r * out_stride + m] for weight
// row r and x row m. Per row of x, as the file-layout GEMV splits it (so both round x the same
// way): d * (q - centre) . x in integers, the centring as centre * sum(x's integers) per block
// (Q4: 8, Q5: 16, Q8_0: none), plus Q4_1/Q5_1's (m + centre * d) * sum(x) in float.
template <int64_t QT, int R>
void group_dot(const uint8_t* group, int64_t blocks, const XRow* x, float* out,
               int64_t out_stride) {
  constexpr int64_t s = block_bytes(QT);
  constexpr bool has_min = QT == kQ4_1 || QT == kQ5_1;
  __m256 acc[R], offsets[R];
  for (int m = 0; m < R; ++m) acc[m] = offsets[m] = _mm256_setzero_ps();
  __m256i v[16];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * kInterleave * s;
    expand_group_block<QT>(block, v);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    __m256 offset = _mm256_setzero_ps();
    if (has_min) {
      const __m256 mins = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + mins_at<QT>())));
      offset = _mm256_fmadd_ps(_mm256_set1_ps(static_cast<float>(centre<QT>())), d, mins);
    }
    for (int m = 0; m < R; ++m) {
      __m256i dot = group_block_dot<QT>(v, x[m].q.q.data() + b * kBlock);
      if (centre<QT>()) {
        dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(centre<QT>() * x[m].int_sums[b]));
      }
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(d, _mm256_set1_ps(x[m].q.scale[b])), acc[m]);
      if (has_min) offsets[m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x[m].sums[b]), offsets[m]);
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(32) float lanes[kInterleave];
    _mm256_store_ps(lanes, _mm256_add_ps(acc[m], offsets[m]));
    for (int r = 0; r < kInterleave; ++r) out[r * out_stride + m] = lanes[r];
  }
}

// Q4_K's 8 rows' sub-block scales and minimums of one super-block, times d and dmin: the 12
// scale bytes are units 2-7 of the block (row r's bytes 2u, 2u+1 in 16-bit lane r), decoded
// lane-wise as ggml's get_scale_min_k4 does.
inline void q4_k_group_scales(const uint8_t* block, __m256 dsc[8], __m256 dmin_m[8]) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
  const __m256 dmin = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 * kInterleave)));
  const __m256i byte = _mm256_set1_epi32(0xff), six = _mm256_set1_epi32(63);
  const __m256i four = _mm256_set1_epi32(0x0f);
  __m256i b[12];
  for (int u = 0; u < 6; ++u) {
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(block + (2 + u) * 2 * kInterleave)));
    b[2 * u] = _mm256_and_si256(words, byte);
    b[2 * u + 1] = _mm256_srli_epi32(words, 8);
  }
  for (int j = 0; j < 8; ++j) {
    __m256i sc, m;
    if (j < 4) {
      sc = _mm256_and_si256(b[j], six);
      m = _mm256_and_si256(b[j + 4], six);
    } else {
      sc = _mm256_or_si256(_mm256_and_si256(b[j + 4], four),
                           _mm256_slli_epi32(_mm256_srli_epi32(b[j - 4], 6), 4));
      m = _mm256_or_si256(_mm256_srli_epi32(b[j + 4], 4),
                          _mm256_slli_epi32(_mm256_srli_epi32(b[j], 6), 4));
    }
    dsc[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    dmin_m[j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
  }
}

// A Q4_K group's 8 rows times R rows of x, as the file layout's batch-1 GEMV splits each row
// (q4_5_k_row_dot1): per sub-block, d*sc * x's scale * (its nibbles . x's int16), less
// dmin*m * x's float sum over the sub-block. Each 32 bytes of a row's nibbles (16 units of
// the group) hold sub-blocks 2c (low nibbles) and 2c+1 (high ones): values 2t, 2t+1 of both
// in unit t.
template <int R>
void q4_k_group_dot(const uint8_t* group, int64_t super_blocks, const XRow* x, float* out,
                    int64_t out_stride) {
  constexpr int64_t s = block_bytes(kQ4_K);
  __m256 acc[R], mins[R];
  for (int m = 0; m < R; ++m) acc[m] = mins[m] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi16(0x0f);
  for (int64_t b = 0; b < super_blocks; ++b) {
    const uint8_t* block = group + b * kInterleave * s;
    __m256 dsc[8], dmin_m[8];
    q4_k_group_scales(block, dsc, dmin_m);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* units = block + (8 + 16 * c) * 2 * kInterleave;
      __m256i lo[16], hi[16];
      for (int t = 0; t < 16; ++t) {
        const __m256i wide = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(units + 16 * t)));
        lo[t] = _mm256_and_si256(wide, mask);
        hi[t] = _mm256_srli_epi16(wide, 4);
      }
      const int64_t j = b * 8 + 2 * c;  // x's 32-column block under the low nibbles
      for (int m = 0; m < R; ++m) {
        const int16_t* xq = x[m].q.q.data() + j * kBlock;
        __m256i dot_lo = _mm256_setzero_si256(), dot_hi = _mm256_setzero_si256();
        for (int t = 0; t < 16; ++t) {
          dot_lo = dot_pairs(dot_lo, lo[t], xq + 2 * t);
          dot_hi = dot_pairs(dot_hi, hi[t], xq + kBlock + 2 * t);
        }
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lo),
                                 _mm256_mul_ps(dsc[2 * c], _mm256_set1_ps(x[m].q.scale[j])),
                                 acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi),
                                 _mm256_mul_ps(dsc[2 * c + 1],
                                               _mm256_set1_ps(x[m].q.scale[j + 1])),
                                 acc[m]);
        mins[m] = _mm256_fmadd_ps(dmin_m[2 * c], _mm256_set1_ps(x[m].sums[j]), mins[m]);
        mins[m] = _mm256_fmadd_ps(dmin_m[2 * c + 1], _mm256_set1_ps(x[m].sums[j + 1]),
                                  mins[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    alignas(32) float lanes[kInterleave];
    _mm256_store_ps(lanes, _mm256_sub_ps(acc[m], mins[m]));
    for (int r = 0; r < kInterleave; ++r) out[r * out_stride + m] = lanes[r];
  }
}

// Rows [m0, m0 + R) of x against group g, R up to kRowsAPass.
template <int64_t QT>
void group_rows(const uint8_t* group, int64_t blocks, const XRow* x, int rows, float* out,
                int64_t out_stride) {
  switch (rows) {
    case 1: group_dot<QT, 1>(group, blocks, x, out, out_stride); break;
    case 2: group_dot<QT, 2>(group, blocks, x, out, out_stride); break;
    case 3: group_dot<QT, 3>(group, blocks, x, out, out_stride); break;
    default: group_dot<QT, 4>(group, blocks, x, out, out_stride); break;
  }
}

void q4_k_group_rows(const uint8_t* group, int64_t super_blocks, const XRow* x, int rows,
                     float* out, int64_t out_stride) {
  switch (rows) {
    case 1: q4_k_group_dot<1>(group, super_blocks, x, out, out_stride); break;
    case 2: q4_k_group_dot<2>(group, super_blocks, x, out, out_stride); break;
    case 3: q4_k_group_dot<3>(group, super_blocks, x, out, out_stride); break;
    default: q4_k_group_dot<4>(group, super_blocks, x, out, out_stride); break;
  }
}
#endif

}  // namespace

namespace deepinfer_gguf {

void interleaved_gemv(const uint8_t* w, int64_t n, int64_t blocks, const float* x, int64_t k,
                      int64_t rows, const std::vector<float>* sums, int64_t qtype, float* y) {
#ifdef DEEPINFER_AVX2
  std::vector<XRow> xs;
  const int64_t x_blocks = k / kBlock;
  for (int64_t m = 0; m < rows; ++m) xs.push_back(XRow::of(x + m * k, x_blocks, sums[m]));
  const int64_t group_bytes = kInterleave * blocks * block_bytes(qtype);
  if (qtype == kQ4_K) {
    at::parallel_for(0, n / kInterleave, 8, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        for (int64_t m0 = 0; m0 < rows; m0 += kRowsAPass) {
          const int r = static_cast<int>(std::min<int64_t>(kRowsAPass, rows - m0));
          q4_k_group_rows(w + g * group_bytes, blocks, xs.data() + m0, r,
                          y + g * kInterleave * rows + m0, rows);
        }
      }
    });
    return;
  }
  with_block_type(qtype, [&](auto qt) {
    at::parallel_for(0, n / kInterleave, 8, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        for (int64_t m0 = 0; m0 < rows; m0 += kRowsAPass) {
          const int r = static_cast<int>(std::min<int64_t>(kRowsAPass, rows - m0));
          group_rows<qt.value>(w + g * group_bytes, blocks, xs.data() + m0, r,
                               y + g * kInterleave * rows + m0, rows);
        }
      }
    });
  });
#else
  (void)w, (void)n, (void)blocks, (void)x, (void)k, (void)rows, (void)sums, (void)qtype, (void)y;
  TORCH_CHECK(false, "GGUF rows interleaved by 8 need the extension built with AVX2 "
              "(kernels.interleaves says which weights to interleave)");
#endif
}

}  // namespace deepinfer_gguf
