// Fused float32 CPU ops for decode-sized steps: one call each where torch takes 8-20 small ops.
//
// At batch 1 a small model's step is mostly per-op overhead (a 135M llama layer is ~80 torch
// calls), so the norms, the rotary embedding and the paged decode attention run here as single
// calls. Each computes what the torch reference in ops.py / attention.py computes, in float32.
// ATen's tensor and the few ops used here, not <torch/extension.h>: that header (all of
// libtorch's C++ API and the Python bindings) is most of the build's time; only bindings.cpp
// needs the bindings.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "native_ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DEEPINFER_AVX2_FMA 1
#endif

namespace {

// Multiply-adds a parallel_for chunk should hold before a second thread is worth waking.
constexpr int64_t kParallelWork = 1 << 14;

// a . b over n floats. A scalar loop is one dependent add a product (the compiler keeps the
// order, so it does not vectorize it): four 8-wide FMA chains instead, ~10x faster at the
// head sizes of decode attention.
float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef DEEPINFER_AVX2_FMA
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (; i + 32 <= n; i += 32) {
    for (int u = 0; u < 4; ++u) {
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * u), _mm256_loadu_ps(b + i + 8 * u),
                               acc[u]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
  }
  const __m256 v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// x[j] = exp(x[j] - top) for j < n, and their sum. std::exp is a call a score (most of a
// decode attention's time at head size 64); 8 at a time here, by Cephes' expf polynomial
// (relative error ~1e-7, as std::exp's order of rounding).
float exp_shifted(float* x, int64_t n, float top) {
  int64_t j = 0;
  float sum = 0.f;
#ifdef DEEPINFER_AVX2_FMA
  const __m256 shift = _mm256_set1_ps(top), lo = _mm256_set1_ps(-87.3f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const float p[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  __m256 total = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift), lo);
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(v, log2e, half));
    v = _mm256_fnmadd_ps(fx, c2, _mm256_fnmadd_ps(fx, c1, v));
    __m256 y = _mm256_set1_ps(p[0]);
    for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(p[i]));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(v, v), v), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    _mm256_storeu_ps(x + j, y);
    total = _mm256_add_ps(total, y);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
  for (; j < n; ++j) sum += (x[j] = std::exp(x[j] - top));
  return sum;
}

// Asks for the n floats at p ahead of their use. Decode attention reads one K and one V row a
// key, scattered by the block table; the weights a step streams between layers have pushed
// them out of the caches, and without this each row is a wait on memory (a 257-key layer of
// SmolLM2: 28 us with its K/V in cache, 124 us without).
inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);  // 64-byte lines
}

// Keys ahead of the one in use whose rows are requested.
constexpr int64_t kPrefetchKeys = 8;

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 tensor");
}

// out[i] = w * (x[i] / sqrt(mean(x[i]^2) + eps)) for each row i of [rows, h].
void norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t h, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * h;
      double sq = 0.0;
      for (int64_t i = 0; i < h; ++i) sq += static_cast<double>(xr[i]) * xr[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(sq / h) + eps);
      float* o = out + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = w[i] * (xr[i] * inv);
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "weight");
  const int64_t h = x.size(-1);
  at::Tensor out = at::empty_like(x);
  norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), x.numel() / h, h,
            out.data_ptr<float>());
  return out;
}

// (rms_norm(x + residual), x + residual)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                const at::Tensor& residual,
                                                const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(residual, "residual");
  at::Tensor summed = at::add(x, residual);
  return {rms_norm(summed, w, eps), summed};
}

// Whether t is float32 [T, H, D] with each row t[i] contiguous (the rows may be apart: q, k
// and v of a fused qkv output).
bool rows_contiguous(const at::Tensor& t) {
  return t.dtype() == at::kFloat && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2);
}

// NeoX rotary in place on x [T, H, D] (rows_contiguous) over its first R dims: the two halves
// of those dims rotate as (a, b) -> (a cos - b sin, b cos + a sin), with cos/sin rows [R] per
// position.
void rotate(at::Tensor& x, const int64_t* positions, const float* cos, const float* sin,
            int64_t rot) {
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = rot / 2;
  float* p = x.data_ptr<float>();
  for (int64_t i = 0; i < t; ++i) {
    const float* c = cos + positions[i] * rot;
    const float* s = sin + positions[i] * rot;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = p + i * x.stride(0) + h * d;
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a * c[j] - b * s[j];
        v[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
  }
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& positions,
            const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(rows_contiguous(q) && rows_contiguous(k),
              "q and k must be float32 [T, H, D] with each row contiguous");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(positions.dtype() == at::kLong, "positions must be int64");
  const at::Tensor pos = positions.contiguous();
  const int64_t rot = cos.size(1);
  rotate(q, pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rot);
  rotate(k, pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rot);
}

namespace {

// The step's k [B, Hk, D] and v [B, Hk, Dv] into their cache rows new_slots[b] (as
// index_copy_ along dim 0). k and v may be rows of the fused qkv output (rows_contiguous).

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& new_slots) {
  TORCH_CHECK(rows_contiguous(k) && rows_contiguous(v),
              "k and v must be float32 [B, Hk, D] with each row contiguous");
  TORCH_CHECK(new_slots.dtype() == at::kLong && new_slots.numel() == k.size(0) &&
                  v.size(0) == k.size(0),
              "new_slots must be int64 with one slot per row of k and v");
  const int64_t krow = k_cache.numel() / k_cache.size(0), vrow = v_cache.numel() / v_cache.size(0);
  TORCH_CHECK(k.size(1) * k.size(2) == krow && v.size(1) * v.size(2) == vrow,
              "k and v rows must match the cache rows");
  const at::Tensor slots = new_slots.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < k.size(0); ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < k_cache.size(0), "slot ", sp[b], " outside the cache");
    std::copy_n(k.data_ptr<float>() + b * k.stride(0), krow,
                k_cache.data_ptr<float>() + sp[b] * krow);
    std::copy_n(v.data_ptr<float>() + b * v.stride(0), vrow,
                v_cache.data_ptr<float>() + sp[b] * vrow);
  }
}

// Work items of decode attention below this many keys are not split further.
constexpr int64_t kMinKeysPerPart = 64;

// Key ranges each (sequence, KV head) splits into: with fewer items than the threads can
// share evenly (batch 1: SmolLM2's 3 KV heads on 2 threads left one thread idle a third of
// the time), enough ranges for every thread to take the same number of them.
int64_t key_parts(int64_t items, int64_t width) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || items % threads == 0 || items >= 4 * threads) return 1;
  const int64_t even = threads / std::gcd(items, threads);  // items * even divides by threads
  return std::max<int64_t>(1, std::min(even, width / kMinKeysPerPart));
}

struct AttentionRows {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  const int64_t* slots;
  const int64_t* lens;
  int64_t hq, hk, d, dv, width;
  float scale;
};

// Keys j0 <= j < j1 of sequence b for the query heads of KV head kvh: each head's score
// maximum, sum of exp(score - maximum) and sum of exp(score - maximum) * v (into acc, group x
// dv, overwritten).
void attend_range(const AttentionRows& r, int64_t b, int64_t kvh, int64_t j0, int64_t j1,
                  float* score, float* top, float* total, float* acc) {
  const int64_t group = r.hq / r.hk, d = r.d, dv = r.dv, hk = r.hk;
  const float* q0 = r.q + (b * r.hq + kvh * group) * d;
  const int64_t* row = r.slots + b * r.width;
  std::fill(top, top + group, -INFINITY);
  for (int64_t j = j0; j < std::min(j1, j0 + kPrefetchKeys); ++j) {
    prefetch(r.k_cache + (row[j] * hk + kvh) * d, d);
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kPrefetchKeys < j1) prefetch(r.k_cache + (row[j + kPrefetchKeys] * hk + kvh) * d, d);
    const float* kv = r.k_cache + (row[j] * hk + kvh) * d;
    for (int64_t g = 0; g < group; ++g) {
      float& s = score[g * r.width + j];
      s = dot(q0 + g * d, kv, d) * r.scale;
      top[g] = std::max(top[g], s);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    total[g] = exp_shifted(score + g * r.width + j0, j1 - j0, top[g]);
  }
  std::fill(acc, acc + group * dv, 0.f);
  for (int64_t j = j0; j < std::min(j1, j0 + kPrefetchKeys); ++j) {
    prefetch(r.v_cache + (row[j] * hk + kvh) * dv, dv);
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kPrefetchKeys < j1) prefetch(r.v_cache + (row[j + kPrefetchKeys] * hk + kvh) * dv, dv);
    const float* vv = r.v_cache + (row[j] * hk + kvh) * dv;
    for (int64_t g = 0; g < group; ++g) {
      const float p = score[g * r.width + j];
      float* o = acc + g * dv;
      for (int64_t i = 0; i < dv; ++i) o[i] += p * vv[i];
    }
  }
}

// acc (group x dv) divided by each head's sum of exponentials.
void normalise(float* acc, const float* total, int64_t group, int64_t dv) {
  for (int64_t g = 0; g < group; ++g) {
    if (total[g] == 0.f) continue;  // no keys: zeros
    const float inv = 1.f / total[g];
    for (int64_t i = 0; i < dv; ++i) acc[g * dv + i] *= inv;
  }
}

// The key ranges' partial softmaxes of each (item, query head) rescaled to their common
// maximum and summed: out [items * group, dv] (items in (sequence, KV head) order, as the
// heads of out).
void merge_parts(const float* top, const float* total, const float* acc, int64_t items,
                 int64_t parts, int64_t group, int64_t dv, float* out) {
  for (int64_t it = 0; it < items; ++it) {
    for (int64_t g = 0; g < group; ++g) {
      float m = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, top[(it * parts + p) * group + g]);
      float sum = 0.f;
      float* o = out + (it * group + g) * dv;
      std::fill(o, o + dv, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t at = (it * parts + p) * group + g;
        if (total[at] == 0.f) continue;  // an empty range
        const float c = std::exp(top[at] - m);
        sum += c * total[at];
        for (int64_t i = 0; i < dv; ++i) o[i] += c * acc[at * dv + i];
      }
      for (int64_t i = 0; i < dv; ++i) o[i] /= sum;
    }
  }
}

}  // namespace

// One query per sequence over its keys in the paged cache: q [B, Hq, D], caches [S, Hk, D] and
// [S, Hk, Dv], slots [B, L] (the first lens[b] are sequence b's visible keys, in order).
// Softmax(q . k * scale) . v per query head, the query heads of a KV head sharing its keys.
// The step's own k and v are written to their rows new_slots first (one call instead of two
// index_copy_ a layer: at batch 1 the calls, not the bytes, are the cost).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& new_slots,
                            const at::Tensor& slots, const at::Tensor& lens, double scale) {
  check_f32(q, "q");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(slots.dtype() == at::kLong && lens.dtype() == at::kLong,
              "slots and lens must be int64");
  store_kv(k, v, k_cache, v_cache, new_slots);
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hk = k_cache.size(1), dv = v_cache.size(2), width = slots.size(1);
  const int64_t group = hq / hk;
  const at::Tensor sl = slots.contiguous(), ln = lens.contiguous();
  at::Tensor out = at::empty({batch, hq, dv}, q.options());
  const int64_t items = batch * hk, parts = key_parts(items, width);
  // Per (item, part, query head): the part's score maximum, its sum of exponentials and its
  // output before normalisation, merged below.
  std::vector<float> part_max(items * parts * group), part_sum(items * parts * group),
      part_out(parts > 1 ? items * parts * group * dv : 0);
  const AttentionRows rows{q.data_ptr<float>(), k_cache.data_ptr<float>(),
                           v_cache.data_ptr<float>(), sl.data_ptr<int64_t>(),
                           ln.data_ptr<int64_t>(), hq, hk, d, dv, width, static_cast<float>(scale)};
  float* op = out.data_ptr<float>();
  // One work item a (sequence, KV head, key range): its query heads (h = kvh * group + g)
  // read each K and V row once between them. Only items too small to pay for waking a second
  // thread stay on one (the rows come from memory: even 257 keys of SmolLM2 run in 44 us on
  // two threads against 57 on one).
  const int64_t item_work = std::max<int64_t>(1, group * width / parts * (d + dv));
  const int64_t grain = std::max<int64_t>(1, kParallelWork / item_work);
  at::parallel_for(0, items * parts, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> score(group * width);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bk = w / parts, part = w % parts, b = bk / hk, kvh = bk % hk;
      const int64_t n = rows.lens[b], j0 = n * part / parts, j1 = n * (part + 1) / parts;
      float* acc = parts > 1 ? part_out.data() + w * group * dv : op + (b * hq + kvh * group) * dv;
      attend_range(rows, b, kvh, j0, j1, score.data(), part_max.data() + w * group,
                   part_sum.data() + w * group, acc);
      if (parts == 1) normalise(acc, part_sum.data() + w * group, group, dv);
    }
  });
  if (parts > 1) {
    merge_parts(part_max.data(), part_sum.data(), part_out.data(), items, parts, group, dv, op);
  }
  return out;
}

// rotary() of q and k in place, then decode_attention(): one call for a decode layer's
// attention, q and k rows of the fused qkv output (q is copied whole for the attention where
// its rows are apart: several sequences).
at::Tensor rotary_decode_attention(at::Tensor q, at::Tensor k, const at::Tensor& v,
                                   const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                                   const at::Tensor& new_slots, const at::Tensor& slots,
                                   const at::Tensor& lens, double scale) {
  rotary(q, k, positions, cos, sin);
  return decode_attention(q.contiguous(), k, v, k_cache, v_cache, new_slots, slots, lens,
                          scale);
}
