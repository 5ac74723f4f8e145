// GGUF block-quantized matmuls on the CPU, over the blocks exactly as a .gguf file stores them.
//
// A weight [N, K] is N rows of K/32 blocks. Q4_0: {fp16 d; 16 bytes of nibbles} (w = d*(q-8)),
// Q4_1: {fp16 d; fp16 m; 16 bytes} (w = d*q + m), Q8_0: {fp16 d; int8 q[32]} (w = d*q). In a
// 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high one.
//
// Decode (a few rows of x) is bandwidth-bound: gemv() quantizes x once per 32-column block to
// int8 (one scale each, as llama.cpp's Q8_0/Q8_1 activations) and takes integer dot products
// with AVX2 (maddubs: unsigned weight nibbles x signed activations), so a weight byte costs a
// few instructions and is read once for all rows of x. Prefill (many rows) is compute-bound:
// dequantize() writes float32 rows for a BLAS GEMM instead.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kMaxRows = 16;  // rows of x one gemv() call takes (decode batches)

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGMLQuantizationType values

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  TORCH_CHECK(false, "unsupported GGUF block type ", qtype);
}

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

float round_to_half(float value) {
#ifdef DEEPINFER_AVX2
  return _cvtsh_ss(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT));
#else
  return value;  // the portable build keeps float32 scales
#endif
}

// x quantized per 32-column block: int8 values, the block's scale, and the block's sum as
// the int8 values give it (Q4_0's -8 offset and Q4_1's minimum both multiply that sum).
struct QuantizedRow {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> sum;
};

QuantizedRow quantize_row(const float* x, int64_t blocks) {
  QuantizedRow row{std::vector<int8_t>(blocks * kBlock), std::vector<float>(blocks),
                   std::vector<float>(blocks)};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      row.q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    // Stored as llama.cpp stores its Q8_0/Q8_1 activations (scale and sum in fp16), so the
    // products equal its own and greedy decoding follows it through near-ties.
    row.scale[b] = round_to_half(d);
    row.sum[b] = round_to_half(d * static_cast<float>(sum));
  }
  return row;
}

// sum over the block of weight integer * activation integer (Q4: nibbles 0..15; Q8: signed).
#ifdef DEEPINFER_AVX2
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 dot_u8_s8(__m256i w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = _mm256_maddubs_epi16(w, xv);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline __m256 dot_s8_s8(__m256i w, const int8_t* x) {
  // maddubs wants one unsigned operand: |w| times x carrying w's sign.
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

int32_t dot_scalar(int64_t qtype, const uint8_t* block, const int8_t* x) {
  int32_t acc = 0;
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < kBlock; ++i) acc += q[i] * x[i];
    return acc;
  }
  const uint8_t* qs = block + (qtype == kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) acc += (qs[j] & 0x0f) * x[j] + (qs[j] >> 4) * x[j + 16];
  return acc;
}

// Pointers into one QuantizedRow, read in the inner loop.
struct RowView {
  const int8_t* q;
  const float* scale;
  const float* sum;
};

// One weight row against every quantized row of x: out[m] = sum over blocks. The block type
// is a template parameter so that the inner loop has no branches on it.
template <int64_t QT>
void row_dot(const uint8_t* w, int64_t blocks, const RowView* xs, int64_t rows, float* out) {
  constexpr int64_t stride = QT == kQ4_0 ? 18 : (QT == kQ4_1 ? 20 : 34);
  constexpr int64_t data = QT == kQ4_1 ? 4 : 2;  // bytes before the values
#ifdef DEEPINFER_AVX2
  __m256 acc[kMaxRows];
  for (int64_t m = 0; m < rows; ++m) acc[m] = _mm256_setzero_ps();
#endif
  float extra[kMaxRows] = {0.f};  // the offset/minimum terms, one scalar per block
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * stride;
    const float d = half_to_float(block);
    // Q4_0's -8 and Q4_1's minimum multiply the block's sum of x.
    const float offset = QT == kQ4_1 ? half_to_float(block + 2) : (QT == kQ4_0 ? -8.f * d : 0.f);
#ifdef DEEPINFER_AVX2
    const __m256i wv = QT == kQ8_0
        ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + data))
        : nibbles(block + data);
#endif
    for (int64_t m = 0; m < rows; ++m) {
      const float dx = xs[m].scale[b];
      const int8_t* xq = xs[m].q + b * kBlock;
#ifdef DEEPINFER_AVX2
      const __m256 dot = QT == kQ8_0 ? dot_s8_s8(wv, xq) : dot_u8_s8(wv, xq);
      acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * dx), acc[m]);
#else
      extra[m] += d * dx * static_cast<float>(dot_scalar(QT, block, xq));
#endif
      if (QT != kQ8_0) extra[m] += offset * xs[m].sum[b];
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
// One block's contribution for a single row of x, added to an accumulator pair: the vector
// of integer dots scaled by d * dx, and the scalar offset term.
template <int64_t QT>
inline void block_dot1(const uint8_t* block, const RowView& x, int64_t b, __m256& acc,
                       float& extra) {
  constexpr int64_t data = QT == kQ4_1 ? 4 : 2;
  const float d = half_to_float(block);
  const int8_t* xq = x.q + b * kBlock;
  const __m256 dot = QT == kQ8_0
      ? dot_s8_s8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + data)), xq)
      : dot_u8_s8(nibbles(block + data), xq);
  acc = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * x.scale[b]), acc);
  if (QT == kQ4_1) extra += half_to_float(block + 2) * x.sum[b];
  if (QT == kQ4_0) extra -= 8.f * d * x.sum[b];
}

// row_dot for one row of x (decode at batch 1): four blocks in flight, each with its own
// accumulators, so the loop is not held to one FMA latency per block.
template <int64_t QT>
float row_dot1(const uint8_t* w, int64_t blocks, const RowView& x) {
  constexpr int64_t stride = QT == kQ4_0 ? 18 : (QT == kQ4_1 ? 20 : 34);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  float extra[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    for (int u = 0; u < 4; ++u) block_dot1<QT>(w + (b + u) * stride, x, b + u, acc[u], extra[u]);
  }
  for (; b < blocks; ++b) block_dot1<QT>(w + b * stride, x, b, acc[0], extra[0]);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  return hsum(sum) + (extra[0] + extra[1]) + (extra[2] + extra[3]);
}
#endif

template <int64_t QT>
void gemv_rows(const uint8_t* w, int64_t row_stride, int64_t n, int64_t blocks,
               const RowView* xs, int64_t rows, float* y) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
#ifdef DEEPINFER_AVX2
    if (rows == 1) {
      for (int64_t r = begin; r < end; ++r) y[r] = row_dot1<QT>(w + r * row_stride, blocks, xs[0]);
      return;
    }
#endif
    for (int64_t r = begin; r < end; ++r) row_dot<QT>(w + r * row_stride, blocks, xs, rows, y + r * rows);
  });
}

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "GGUF weight must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(k % kBlock == 0, "GGUF rows hold whole 32-column blocks; K=", k);
  TORCH_CHECK(w.size(1) == k / kBlock * block_bytes(qtype), "row bytes ", w.size(1),
              " do not match K=", k, " of type ", qtype);
}

}  // namespace

// y [M, N] = x [M, K] @ W.T for M <= 16, x float32; W's blocks as stored in the file.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0), blocks = k / kBlock;
  TORCH_CHECK(rows <= kMaxRows, "gemv takes at most ", kMaxRows, " rows, got ", rows);
  check_weight(w, qtype, k);
  const torch::Tensor xc = x.contiguous();
  std::vector<QuantizedRow> quantized;
  std::vector<RowView> xs;
  quantized.reserve(rows);  // RowView points into these: no reallocation
  for (int64_t m = 0; m < rows; ++m) {
    quantized.push_back(quantize_row(xc.data_ptr<float>() + m * k, blocks));
    const QuantizedRow& row = quantized.back();
    xs.push_back({row.q.data(), row.scale.data(), row.sum.data()});
  }
  torch::Tensor y = torch::empty({n, rows}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_stride = w.size(1);
  switch (qtype) {
    case kQ4_0: gemv_rows<kQ4_0>(wp, row_stride, n, blocks, xs.data(), rows, yp); break;
    case kQ4_1: gemv_rows<kQ4_1>(wp, row_stride, n, blocks, xs.data(), rows, yp); break;
    default: gemv_rows<kQ8_0>(wp, row_stride, n, blocks, xs.data(), rows, yp); break;
  }
  return y.t().contiguous();
}

// The float32 weight [N, K] (for a GEMM over many rows, or an embedding lookup).
torch::Tensor dequantize(const torch::Tensor& w, int64_t qtype, int64_t k) {
  check_weight(w, qtype, k);
  const int64_t n = w.size(0), blocks = k / kBlock, stride = block_bytes(qtype);
  torch::Tensor out = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = wp + r * w.size(1) + b * stride;
        float* o = op + r * k + b * kBlock;
        const float d = half_to_float(block);
        if (qtype == kQ8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
          for (int i = 0; i < kBlock; ++i) o[i] = d * q[i];
          continue;
        }
        const float m_w = qtype == kQ4_1 ? half_to_float(block + 2) : -8.f * d;
        const uint8_t* qs = block + (qtype == kQ4_1 ? 4 : 2);
        for (int j = 0; j < 16; ++j) {
          o[j] = d * (qs[j] & 0x0f) + m_w;
          o[j + 16] = d * (qs[j] >> 4) + m_w;
        }
      }
    }
  });
  return out;
}
