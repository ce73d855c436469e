// Paged decode attention on the CPU: one query token per sequence, reading K/V pages in
// place through the block table (no gather copy). The torch backend gathers each
// sequence's pages into a fresh tensor and then runs SDPA over it: three passes over
// the KV bytes where this kernel makes one, and decode attention is memory-bound.
//
// Layouts (the backend contract): q, out [T, Hq, D] float32 (rows may be strided); caches
// [num_pages, page_size, Hkv, D] contiguous, float32 or bfloat16 (widened as loaded: the
// bf16 path reads half the bytes); block_tables [R, W] int32.
// Work item = one decode row and KV head (and up to 4 of its G = Hq / Hkv query heads,
// which share its K/V loads): 2 x Hkv items a row keep both cores busy on short batches.
#include <torch/extension.h>
#include <cstring>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "../../csrc/avx512_math.h"

namespace {

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * pagedkv::to_float(b[i]);
  return acc;
}

template <typename T>
inline void axpy(float* y, float a, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * pagedkv::to_float(x[i]);
}

// In-place softmax of x[0:n]. exp is evaluated as 2^k * p(r) (r in [-ln2/2, ln2/2], a
// degree-6 Taylor polynomial, relative error < 2e-7) so that the loop vectorises: a
// scalar std::exp per score was most of the kernel's time.
inline void softmax_inplace(float* x, int64_t n) {
#if defined(__AVX512F__)
  // The same in explicit 512-bit vectors: g++ does not vectorise the loop below (the
  // float -> int bit trick), and it was ~2/3 of the kernel's compute at 3 heads a KV head.
  if (n >= 16) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(x + t));
    float mx = _mm512_reduce_max_ps(vmx);
    for (; t < n; ++t) mx = std::max(mx, x[t]);
    const __m512 m = _mm512_set1_ps(mx);
    __m512 vs = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
      const __m512 e = pagedkv::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + t), m));
      _mm512_storeu_ps(x + t, e);
      vs = _mm512_add_ps(vs, e);
    }
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
    if (tail) {
      const __m512 e = pagedkv::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + t), m));
      _mm512_mask_storeu_ps(x + t, tail, e);
      vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(tail, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vs));
    for (t = 0; t + 16 <= n; t += 16) _mm512_storeu_ps(x + t, _mm512_mul_ps(_mm512_loadu_ps(x + t), inv));
    if (tail) _mm512_mask_storeu_ps(x + t, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + t), inv));
    return;
  }
#endif
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, x[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    const float z = std::max(x[t] - mx, -87.0f);
    const float k = std::floor(z * 1.44269504f + 0.5f);
    const float r = z - k * 0.693145752f - k * 1.42860677e-6f;
    const float p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666418f +
                    r * (0.00833345205f + r * 0.00138888624f)))));
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    x[t] = p * scale;
    sum += x[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) x[t] *= inv;
}

// What one work item needs: a decode row's pages, its KV heads [h0, h1) and their queries.
struct Item {
  const int32_t* pages;   // the row of the block table
  int64_t len;            // context tokens
  const float* q;         // the row's query heads (head 0)
  float* out;             // its output row (head 0)
  int64_t h0, h1;         // KV heads of this item
};

struct Geometry {
  int64_t ps, hkv, d, g, qs1, os1, tok_stride, page_stride;
  float scale;
};

// Ask for page j of an item (the item's heads of it) before it is read: pages are scattered
// through the pool, and the hardware prefetcher follows one page only. Two pages ahead
// covers the DRAM latency at one page's compute time. (Items of one KV head only: whole
// rows read each page front to back instead, read_page below.)
template <typename T>
inline void prefetch_page(const T* base, const Item& it, const Geometry& g, int64_t j) {
  const int64_t t0 = j * g.ps;
  if (t0 >= it.len) return;
  const char* page = reinterpret_cast<const char*>(base + static_cast<int64_t>(it.pages[j]) * g.page_stride);
  const int64_t tokens = std::min(g.ps, it.len - t0), esz = static_cast<int64_t>(sizeof(T));
  if (it.h1 - it.h0 == g.hkv) {                       // the whole page: one contiguous run
    for (int64_t b = 0, n = tokens * g.tok_stride * esz; b < n; b += 64) __builtin_prefetch(page + b, 0, 3);
    return;
  }
  for (int64_t s = 0; s < tokens; ++s)
    for (int64_t b = it.h0 * g.d * esz, e = it.h1 * g.d * esz; b < e; b += 64)
      __builtin_prefetch(page + (s * g.tok_stride) * esz + b, 0, 3);
}

#if defined(__AVX512F__)
inline __m512 sum16_raw(const __m512* v);
// The lane of the tree's result that holds each vector's sum, found once by feeding it
// vectors whose sums are their own index (no hand-derived permutation to get wrong).
inline __m512i sum16_order() {
  static const __m512i order = [] {
    __m512 v[16];
    for (int t = 0; t < 16; ++t) v[t] = _mm512_set1_ps(static_cast<float>(t) / 16.f);
    alignas(64) float got[16];
    _mm512_store_ps(got, sum16_raw(v));
    alignas(64) int32_t idx[16];
    for (int lane = 0; lane < 16; ++lane) idx[static_cast<int>(got[lane] + 0.5f)] = lane;
    return _mm512_load_si512(idx);
  }();
  return order;
}

// The sum of each v[t]'s 16 lanes, for 16 vectors at once: halve the width four times, each
// step adding two vectors' halves side by side (shuffle, shuffle, add).
inline __m512 sum16_raw(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)       // 256-bit halves: a[i] = [v2i's 8 partials | v2i+1's 8]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)       // 128-bit quarters: b[i] = 4 partials of v4i .. v4i+3
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)       // pairs inside each 128-bit lane
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

// The sums in order: the tree leaves them permuted across lanes.
inline __m512 sum16(const __m512* v) { return _mm512_permutexvar_ps(sum16_order(), sum16_raw(v)); }

#endif

#if defined(__AVX512F__)
// Scores of GQ query heads (d = 16 * DV, q rows qs1 apart) over m tokens of one KV head's
// slice of a page; sc[gi * len + s] = q_gi . k_s * scale.
template <typename T, int DV, int GQ>
void qk_page(const float* q, int64_t qs1, const T* k, int64_t m, int64_t tok_stride, float* sc, int64_t len,
             float scale) {
  using pagedkv::load16;
  __m512 qv[GQ][DV];
  for (int gi = 0; gi < GQ; ++gi)
    for (int j = 0; j < DV; ++j) qv[gi][j] = _mm512_loadu_ps(q + gi * qs1 + 16 * j);
  int64_t s = 0;
  // 16 tokens at a time: 16 partial dot products per query head, summed across lanes in
  // one transpose tree (~3 ops a score where a horizontal sum each costs ~8 and a chain).
  for (; s + 16 <= m; s += 16) {
    const T* kt = k + s * tok_stride;
    for (int gi = 0; gi < GQ; ++gi) {
      __m512 part[16];
      for (int t = 0; t < 16; ++t) {
        const T* kr = kt + t * tok_stride;
        __m512 acc = _mm512_mul_ps(qv[gi][0], load16(kr));
        for (int j = 1; j < DV; ++j) acc = _mm512_fmadd_ps(qv[gi][j], load16(kr + 16 * j), acc);
        part[t] = acc;
      }
      _mm512_storeu_ps(sc + gi * len + s, _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
    }
  }
  for (; s < m; ++s) {
    const T* kt = k + s * tok_stride;
    __m512 kv[DV];
    for (int j = 0; j < DV; ++j) kv[j] = load16(kt + 16 * j);
    for (int gi = 0; gi < GQ; ++gi) {
      __m512 acc = _mm512_mul_ps(qv[gi][0], kv[0]);
      for (int j = 1; j < DV; ++j) acc = _mm512_fmadd_ps(qv[gi][j], kv[j], acc);
      sc[gi * len + s] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// acc[gi] += sum_s p[gi * len + s] * v_s over m tokens of one KV head's slice of a page;
// the GQ x DV accumulators stay in registers for the page.
template <typename T, int DV, int GQ>
void pv_page(const float* p, int64_t len, const T* v, int64_t m, int64_t tok_stride, float* acc, int64_t d) {
  using pagedkv::load16;
  __m512 a[GQ][DV];
  for (int gi = 0; gi < GQ; ++gi)
    for (int j = 0; j < DV; ++j) a[gi][j] = _mm512_loadu_ps(acc + gi * d + 16 * j);
  for (int64_t s = 0; s < m; ++s) {
    const T* vt = v + s * tok_stride;
    __m512 vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = load16(vt + 16 * j);
    for (int gi = 0; gi < GQ; ++gi) {
      const __m512 w = _mm512_set1_ps(p[gi * len + s]);
      for (int j = 0; j < DV; ++j) a[gi][j] = _mm512_fmadd_ps(w, vv[j], a[gi][j]);
    }
  }
  for (int gi = 0; gi < GQ; ++gi)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc + gi * d + 16 * j, a[gi][j]);
}
#endif

// Any d, any T: the same two steps with loops the compiler vectorises as it can.
template <typename T>
void qk_page_generic(const float* q, int64_t qs1, int64_t gq, const T* k, int64_t m, int64_t tok_stride, float* sc,
                     int64_t len, float scale, int64_t d) {
  for (int64_t s = 0; s < m; ++s)
    for (int64_t gi = 0; gi < gq; ++gi) sc[gi * len + s] = dot(q + gi * qs1, k + s * tok_stride, d) * scale;
}

template <typename T>
void pv_page_generic(const float* p, int64_t len, int64_t gq, const T* v, int64_t m, int64_t tok_stride, float* acc,
                     int64_t d) {
  for (int64_t s = 0; s < m; ++s)
    for (int64_t gi = 0; gi < gq; ++gi) axpy(acc + gi * d, p[gi * len + s], v + s * tok_stride, d);
}

// The largest group of query heads one step holds in registers for this head size.
inline int64_t heads_per_step(int64_t d, int64_t g) {
#if defined(__AVX512F__)
  if (d == 64) return std::min<int64_t>(g, 4);
  if (d == 128) return std::min<int64_t>(g, 2);
#endif
  return g;
}

// The compiled steps for (T, d, query heads at a time), or null for the generic loops.
template <typename T>
struct Steps {
  void (*qk)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t, float) = nullptr;
  void (*pv)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t) = nullptr;
};

template <typename T>
Steps<T> steps_for(int64_t d, int64_t gq) {
  Steps<T> st;
#if defined(__AVX512F__)
#define PAGEDKV_STEPS(DV, GQ) \
  if (d == 16 * DV && gq == GQ) { st.qk = &qk_page<T, DV, GQ>; st.pv = &pv_page<T, DV, GQ>; }
  PAGEDKV_STEPS(4, 1) PAGEDKV_STEPS(4, 2) PAGEDKV_STEPS(4, 3) PAGEDKV_STEPS(4, 4)
  PAGEDKV_STEPS(8, 1) PAGEDKV_STEPS(8, 2)
#undef PAGEDKV_STEPS
#endif
  return st;
}

// Read a whole page (all KV heads of its tokens) front to back before the per-head passes
// use it from L1. Those passes read each token's 3 head slices in 3 separate sweeps, a
// stride the hardware prefetcher does not follow: measured here (24 rows, ~310 tokens, 30
// layers of fp32 pages from DRAM) the sweeps ran at 12 GB/s, this one sequential read first
// at 18-19 GB/s (a plain read of the same bytes: 30), and better than software prefetches
// of the next pages, with or without it.
#if defined(__AVX512F__)
constexpr bool kReadPages = true;
#else
constexpr bool kReadPages = false;     // no read_page below: every item keeps the prefetches
#endif

template <typename T>
inline void read_page(const T* p, int64_t n) {
#if defined(__AVX512F__)
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();   // integer ors: no float assists
  for (int64_t i = 0; i + 128 <= bytes; i += 128) {
    a = _mm512_or_si512(a, _mm512_loadu_si512(c + i));
    b = _mm512_or_si512(b, _mm512_loadu_si512(c + i + 64));
  }
  asm volatile("" : : "v"(a), "v"(b));    // the loads are the point: keep them
#else
  (void)p, (void)n;
#endif
}

// One item: scores of all its query heads page by page, softmax, then P.V page by page.
// A page is visited once per pass for all the item's heads: its bytes are read together.
template <typename T>
void run_item(const Item& it, const T* kp, const T* vp, const Geometry& g, const Steps<T>& st, int64_t gq,
              float* scores, float* acc) {
  const int64_t len = it.len, ps = g.ps, d = g.d, first = it.h0 * g.g, heads = (it.h1 - it.h0) * g.g;
  const int64_t pages = (len + ps - 1) / ps;
  // A whole row reads whole pages: one sequential read each (read_page). One KV head of a
  // row (short batches) reads a strided slice: software prefetch of its pages two ahead.
  const bool whole = kReadPages && it.h1 - it.h0 == g.hkv;
  if (!whole) {
    prefetch_page(kp, it, g, 0);
    prefetch_page(kp, it, g, 1);
  }
  for (int64_t j = 0; j < pages; ++j) {
    const int64_t t0 = j * ps, m = std::min(ps, len - t0);
    const T* page = kp + static_cast<int64_t>(it.pages[j]) * g.page_stride;
    if (whole) {
      read_page(page, m * g.tok_stride);
    } else if (j + 2 < pages) {
      prefetch_page(kp, it, g, j + 2);
    } else {
      prefetch_page(vp, it, g, j + 2 - pages);          // V's first pages, read after the softmax
    }
    for (int64_t h = it.h0; h < it.h1; ++h)
      for (int64_t c = 0; c < g.g; c += gq) {
        const int64_t qi = h * g.g + c, n = std::min(gq, g.g - c);
        float* sc = scores + (qi - first) * len + t0;
        if (st.qk && n == gq) st.qk(it.q + qi * g.qs1, g.qs1, page + h * d, m, g.tok_stride, sc, len, g.scale);
        else qk_page_generic(it.q + qi * g.qs1, g.qs1, n, page + h * d, m, g.tok_stride, sc, len, g.scale, d);
      }
  }
  for (int64_t i = 0; i < heads; ++i) softmax_inplace(scores + i * len, len);
  std::fill(acc, acc + heads * d, 0.f);
  for (int64_t j = 0; j < pages; ++j) {
    const int64_t t0 = j * ps, m = std::min(ps, len - t0);
    const T* page = vp + static_cast<int64_t>(it.pages[j]) * g.page_stride;
    if (whole) read_page(page, m * g.tok_stride);
    else prefetch_page(vp, it, g, j + 2);
    for (int64_t h = it.h0; h < it.h1; ++h)
      for (int64_t c = 0; c < g.g; c += gq) {
        const int64_t qi = h * g.g + c, n = std::min(gq, g.g - c);
        const float* p = scores + (qi - first) * len + t0;
        float* a = acc + (qi - first) * d;
        if (st.pv && n == gq) st.pv(p, len, page + h * d, m, g.tok_stride, a, d);
        else pv_page_generic(p, len, n, page + h * d, m, g.tok_stride, a, d);
      }
  }
  for (int64_t i = 0; i < heads; ++i)
    std::copy(acc + i * d, acc + (i + 1) * d, it.out + (first + i) * g.os1);
}

template <typename T>
void decode_all(const float* qp, float* op, const T* kp, const T* vp, const int32_t* bt, const int64_t* tk,
                const int64_t* rw, const int32_t* ln, int64_t n, int64_t width, int64_t qs0, int64_t os0,
                const Geometry& geo) {
  const int64_t gq = heads_per_step(geo.d, geo.g);
  const Steps<T> st = steps_for<T>(geo.d, gq);
  // Work items, longest rows first, handed out one at a time (LPT): rows differ in length by
  // 10-100x, and a static split leaves one core idle while the other finishes the long rows.
  // A whole row (all its KV heads: each page read as one block) when there are enough rows
  // to share out; one KV head of a row when there are few (a single stream still uses every core).
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ln[a] > ln[b]; });
  const int threads = std::max(1, at::get_num_threads());
  const int64_t split = n < 4 * threads ? geo.hkv : 1, items = n * split;
  const int64_t max_len = n ? ln[order[0]] : 0, heads = geo.hkv / split * geo.g;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> scores(heads * max_len + 16), acc(heads * geo.d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t i = order[w / split], h0 = (w % split) * (geo.hkv / split);
      Item it{bt + rw[i] * width, ln[i], qp + tk[i] * qs0, op + tk[i] * os0, h0, h0 + geo.hkv / split};
      run_item<T>(it, kp, vp, geo, st, gq, scores.data(), acc.data());
    }
  }
}

}  // namespace

// Returns nothing: writes out[tok[i], h*G:(h+1)*G, :] for every decode row i and KV head h.
void paged_decode(const torch::Tensor& q, torch::Tensor& out, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& tok, const torch::Tensor& bt_rows, const torch::Tensor& lens,
                  double scale) {
  const auto kt = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat &&
                  (kt == torch::kFloat || kt == torch::kBFloat16) && v_cache.scalar_type() == kt,
              "paged_decode: float32 q / out and a float32 or bfloat16 cache only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_decode: caches and block tables must be contiguous");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.dim() == 3 && out.stride(2) == 1,
              "paged_decode: q and out must be [T, Hq, D] with a contiguous last dim");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && tok.scalar_type() == torch::kLong &&
                  bt_rows.scalar_type() == torch::kLong && lens.scalar_type() == torch::kInt,
              "paged_decode: index dtypes");
  const int64_t num_pages = k_cache.size(0), ps = k_cache.size(1), hkv = k_cache.size(2),
                d = k_cache.size(3), hq = q.size(1), width = block_tables.size(1);
  const int64_t n = tok.numel();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t* tk = tok.data_ptr<int64_t>();
  const int64_t* rw = bt_rows.data_ptr<int64_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  // Validate before reading: a bad id must raise (as torch's index_select does), never
  // read past the pool. The page_table probe and page_out_of_range fault rely on that.
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ln[i] >= 1 && (ln[i] + ps - 1) / ps <= width, "paged_decode: context length ", ln[i],
                " does not fit the block table width ", width);
    TORCH_CHECK(tk[i] >= 0 && tk[i] < q.size(0), "paged_decode: query row out of range");
    const int32_t* row = bt + rw[i] * width;
    for (int64_t j = 0, w = (ln[i] + ps - 1) / ps; j < w; ++j)
      TORCH_CHECK_INDEX(row[j] >= 0 && row[j] < num_pages, "index ", row[j], " is out of bounds for dimension 0 "
                  "with size ", num_pages, " (paged_decode: page id in block table row ", rw[i], ")");
  }
  TORCH_CHECK(hq % hkv == 0, "paged_decode: ", hq, " query heads do not share ", hkv, " KV heads evenly");
  const Geometry geo{ps, hkv, d, hq / hkv, q.stride(1), out.stride(1), hkv * d, ps * hkv * d, static_cast<float>(scale)};
  if (kt == torch::kFloat)
    decode_all<float>(q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<float>(),
                      v_cache.data_ptr<float>(), bt, tk, rw, ln, n, width, q.stride(0), out.stride(0), geo);
  else
    decode_all<c10::BFloat16>(q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(),
                              v_cache.data_ptr<c10::BFloat16>(), bt, tk, rw, ln, n, width, q.stride(0),
                              out.stride(0), geo);
}

// ---- the small per-layer ops around attention ------------------------------------------
// At decode sizes (16 rows) torch's rms_norm and rope are a handful of tiny ops each, and
// every one pays an OpenMP fork/join right after oneDNN's GEMM: ~30-70 us where the work
// is ~2 us. These run rows serially below 64 rows and in parallel above.

static inline void absmax_lanes(const float* x, int64_t n, float* m, bool* nan);

// y = w * x / sqrt(mean(x^2) + eps), x [R, H] with a contiguous last dim. am: where to put the row's
// max |x| (NaN-propagating), read while the row is in L1, or null: the residual stream each layer's
// norm reads is the previous layer's hidden state, which the fp16 probe measures (a pass of its own
// over a 2048-row prefill's hidden state cost ~0.5 ms a layer, read from memory).
inline void rms_row(const float* xr, const float* wp, float* yr, int64_t hdim, float e, float* am = nullptr) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < hdim; ++i) ss += xr[i] * xr[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(hdim) + e);
#pragma omp simd
  for (int64_t i = 0; i < hdim; ++i) yr[i] = wp[i] * (xr[i] * inv);
  if (am != nullptr) {
    float m = 0.f;
    bool nan = false;
    absmax_lanes(xr, hdim, &m, &nan);
    *am = nan ? NAN : m;
  }
}

void rms_norm_rows(const float* xp, int64_t xs, const float* wp, float* yp, int64_t rows, int64_t hdim, float e,
                   float* am = nullptr) {
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) rms_row(xp + r * xs, wp, yp + r * hdim, hdim, e, am ? am + r : nullptr);
  });
}

// bf16 rows: each widened into a float32 row (exact), normed by the same float32 code, and
// rounded to nearest even once, as torch's .to(bfloat16) rounds: the result of x.float(), the
// float32 kernel and .to(bf16), in one pass (~2.2x those three ops at 2048 rows). The
// conversions are written as vectors so that this does not rest on g++ vectorising a
// c10::BFloat16 loop (it did, here).
void rms_norm_rows(const c10::BFloat16* xp, int64_t xs, const float* wp, c10::BFloat16* yp, int64_t rows,
                   int64_t hdim, float e, float* am = nullptr) {
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t end) {
    std::vector<float> xf(hdim), yf(hdim);
    for (int64_t r = b; r < end; ++r) {
      const c10::BFloat16* xr = xp + r * xs;
      c10::BFloat16* yr = yp + r * hdim;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= hdim; i += 16) _mm512_storeu_ps(xf.data() + i, pagedkv::load16(xr + i));
#endif
      for (; i < hdim; ++i) xf[i] = static_cast<float>(xr[i]);
      rms_row(xf.data(), wp, yf.data(), hdim, e, am ? am + r : nullptr);      // (widened: exact)
      i = 0;
#if defined(__AVX512BF16__)
      for (; i + 16 <= hdim; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(yf.data() + i)));
#endif
      for (; i < hdim; ++i) yr[i] = c10::BFloat16(yf[i]);
    }
  });
}

// float32 rows, or bfloat16 ones widened, normed in float32 and rounded once (native bf16: one
// pass where x.float(), the norm and .to(bf16) were three); w float32 or bf16, y in x's dtype.
// absmax: a contiguous float32 [N, R] buffer whose row `row` gets each row's max |x| (NaN-propagating).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                       const c10::optional<torch::Tensor>& absmax, int64_t row) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                  (w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16),
              "rms_norm: float32 or bfloat16 rows and weight only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x [R, H] (contiguous rows), w [H]");
  const int64_t rows = x.size(0), hdim = x.size(1), xs = x.stride(0);
  float* am = nullptr;
  if (absmax.has_value()) {
    const auto& a = *absmax;
    TORCH_CHECK(a.scalar_type() == torch::kFloat && a.device().is_cpu() && a.is_contiguous() && a.dim() == 2 &&
                    a.size(1) == rows && row >= 0 && row < a.size(0),
                "rms_norm: absmax is a contiguous float32 [N, R] buffer for x's R rows and row names one of its N "
                "(got row ", row, ")");
    am = a.data_ptr<float>() + row * rows;
  }
  auto y = torch::empty({rows, hdim}, x.options());
  const float e = static_cast<float>(eps);
  // A bf16 weight (a native-bf16 model's) widened here, once a call: a torch .float() from Python
  // cost ~20 us a call, 3 calls a layer.
  std::vector<float> wide;
  const float* wp;
  if (w.scalar_type() == torch::kFloat) {
    wp = w.data_ptr<float>();
  } else {
    const c10::BFloat16* wb = w.data_ptr<c10::BFloat16>();
    wide.assign(wb, wb + hdim);
    wp = wide.data();
  }
  if (x.scalar_type() == torch::kFloat)
    rms_norm_rows(x.data_ptr<float>(), xs, wp, y.data_ptr<float>(), rows, hdim, e, am);
  else
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), xs, wp, y.data_ptr<c10::BFloat16>(), rows, hdim, e, am);
  return y;
}

// A row into a cache slot: copied, or rounded to the cache's bf16.
template <typename T, typename S>
inline void store_row(T* dst, const S* src, int64_t n) {
  if constexpr (std::is_same_v<T, S>) {
    std::copy(src, src + n, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);   // round to nearest even, as torch's .to()
  }
}

// RoPE of one head x [d] in place: x[i], x[i + d/2] rotated by (cos, sin) in float32. bf16 rows
// (a native-bf16 model's q|k) are widened, rotated and rounded once, as torch's bf16 ops round.
inline void rotate(float* x, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], bb = x[i + half];
    x[i] = a * c[i] - bb * s[i];
    x[i + half] = bb * c[i + half] + a * s[i + half];
  }
}

inline void rotate(c10::BFloat16* x, const float* c, const float* s, int64_t half) {
  float w[512];
  for (int64_t i = 0; i < 2 * half; ++i) w[i] = static_cast<float>(x[i]);
  rotate(w, c, s, half);
  for (int64_t i = 0; i < 2 * half; ++i) x[i] = c10::BFloat16(w[i]);
}

static inline float sumsq_lanes(const float* x, int64_t n);

// In place on the packed q|k|v rows [T, (Hq + 2 Hkv) * D]: rotate q and k (rotate-half RoPE,
// as Hugging Face Llama; cos/sin [T, D] for each token's position), then store k and v at
// slots[t] of the caches [num_pages, page_size, Hkv, D]. One pass instead of ~7 ops.
// absmax (float32 q|k|v only): [2, T] or [4, T] float32, filled with each row's max |k| (rotated, as
// stored before any cast) and max |v|, and with [4, T] also its largest per-head L2 norm of k and of
// q (rotated), all NaN-propagating, read while the row is in L1: what the event log's KVWritten and
// the fp16 probe (its score bound) would otherwise read from memory again, a pass a layer.
void rope_write(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                torch::Tensor& v_cache, const torch::Tensor& slots, int64_t hq, int64_t hkv,
                const c10::optional<torch::Tensor>& absmax, int64_t layer) {
  const auto ct = k_cache.scalar_type(), xt = qkv.scalar_type();
  TORCH_CHECK(((xt == torch::kFloat && (ct == torch::kFloat || ct == torch::kBFloat16)) ||
               (xt == torch::kBFloat16 && ct == torch::kBFloat16)) && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat && v_cache.scalar_type() == ct,
              "rope_write: float32 q|k|v with a float32 or bfloat16 cache, or bfloat16 q|k|v with a bfloat16 cache; "
              "float32 cos / sin");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && slots.is_contiguous(), "rope_write: contiguous tensors only");
  TORCH_CHECK(slots.scalar_type() == torch::kLong, "rope_write: slots must be int64");
  const int64_t t_n = qkv.size(0), d = k_cache.size(3), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && (xt == torch::kFloat || d <= 512), "rope_write: head size ", d,
              " is not even (or over 512 in bf16)");
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d && k_cache.size(2) == hkv && cos.size(0) == t_n &&
                  cos.size(1) == d && sin.sizes() == cos.sizes() && slots.numel() == t_n,
              "rope_write: shapes disagree");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), width = qkv.size(1), kv = hkv * d;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_n; ++t)       // validate first: a bad slot writes nothing anywhere
    TORCH_CHECK_INDEX(sl[t] >= 0 && sl[t] < num_slots, "index ", sl[t], " is out of bounds for dimension 0 "
                      "with size ", num_slots, " (rope_write: slot of token ", t, ")");
  // absmax: [S, T], or a forward's whole [L, S, T] buffer with `layer` naming the slice this layer fills
  // (the model then hands every layer the same tensor: no view made per layer between its kernels)
  float* am = nullptr;
  int64_t stats = 0;
  if (absmax.has_value()) {
    const auto& a = *absmax;
    const bool whole = a.dim() == 3;
    TORCH_CHECK(xt == torch::kFloat && a.scalar_type() == torch::kFloat && a.device().is_cpu() && a.is_contiguous() &&
                    (a.dim() == 2 || whole) && (a.size(whole) == 2 || a.size(whole) == 4) && a.size(whole + 1) == t_n,
                "rope_write: absmax is a contiguous float32 [2, T] or [4, T] (or [L, 2 or 4, T] with a layer) and needs "
                "float32 q|k|v");
    TORCH_CHECK(!whole || (layer >= 0 && layer < a.size(0)), "rope_write: layer ", layer, " outside the absmax buffer's ",
                a.size(0), " layers");
    stats = a.size(whole);
    am = a.data_ptr<float>() + (whole ? layer * stats * t_n : 0);
  }
  const bool norms = am != nullptr && stats == 4;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto body = [&](auto* base, auto* kc, auto* vc) {
  at::parallel_for(0, t_n, 64, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      auto* row = base + t * width;
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < hq + hkv; ++h) rotate(row + h * d, c, s, half);
      store_row(kc + sl[t] * kv, row + hq * d, kv);
      store_row(vc + sl[t] * kv, row + hq * d + kv, kv);
      if constexpr (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(row)>>, float>) {
        if (am != nullptr) {
          for (int u = 0; u < 2; ++u) {
            float m = 0.f;
            bool nan = false;
            absmax_lanes(row + hq * d + u * kv, kv, &m, &nan);
            am[u * t_n + t] = nan ? NAN : m;
          }
          if (norms) {                      // rows 2, 3: max over k heads, then q heads, of ||head||
            for (int u = 0; u < 2; ++u) {
              const int64_t h0 = u == 0 ? hq : 0, h1 = u == 0 ? hq + hkv : hq;
              float m = 0.f;
              bool nan = false;
              for (int64_t h = h0; h < h1; ++h) {
                const float n = std::sqrt(sumsq_lanes(row + h * d, d));
                nan |= (n != n);
                m = n > m ? n : m;
              }
              am[(2 + u) * t_n + t] = nan ? NAN : m;
            }
          }
        }
      }
    }
  });
  };
  if (xt == torch::kBFloat16)
    body(qkv.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  else if (ct == torch::kFloat)
    body(qkv.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else
    body(qkv.data_ptr<float>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
}

// max |x| over n floats into *m, and whether a NaN was seen into *nan. Four accumulators of 4-float
// vectors (GCC vector extensions: SSE / NEON width, native on every build of this file, which AVX2 and
// AVX-512 builds run as well): no -ffast-math needed, since nothing is reordered across a lane, and
// ~4x the scalar running max (memory-bound at ~30 GB/s on one core here).
typedef float absmax_v4f __attribute__((vector_size(16)));
typedef int32_t absmax_v4i __attribute__((vector_size(16)));

static inline void absmax_lanes(const float* x, int64_t n, float* m, bool* nan) {
  absmax_v4f mx[4] = {};
  absmax_v4i nx[4] = {};
  const absmax_v4i clear_sign = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int u = 0; u < 4; ++u) {
      absmax_v4f a;
      std::memcpy(&a, x + i + 4 * u, sizeof(a));             // unaligned rows (k / v views of qkv)
      a = (absmax_v4f)((absmax_v4i)a & clear_sign);
      nx[u] |= (a != a);
      mx[u] = a > mx[u] ? a : mx[u];
    }
  }
  float mm = *m;
  int nn = *nan;
  for (int u = 0; u < 4; ++u) {
    for (int j = 0; j < 4; ++j) {
      nn |= nx[u][j] != 0;
      mm = mx[u][j] > mm ? mx[u][j] : mm;
    }
  }
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nn |= (a != a);
    mm = a > mm ? a : mm;
  }
  *m = mm;
  *nan = nn != 0;
}

// sum of x[i]^2 over n floats in four 4-float accumulators: the serial sum (one add waiting on the
// last, no -ffast-math to reorder it) made a 2048-row prefill's head norms cost ~0.4 ms a layer, more
// than the rotation and the store; a NaN or inf in x carries into the sum.
static inline float sumsq_lanes(const float* x, int64_t n) {
  absmax_v4f acc[4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int u = 0; u < 4; ++u) {
      absmax_v4f a;
      std::memcpy(&a, x + i + 4 * u, sizeof(a));
      acc[u] += a * a;
    }
  }
  float s = 0.f;
  for (int u = 0; u < 4; ++u)
    for (int j = 0; j < 4; ++j) s += acc[u][j];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// Per-row max |x| of x [R, C] (contiguous rows), NaN-propagating like torch.amax: the
// fp16_overflow probe's K/V/hidden measurements, without an OpenMP fork per small tensor.
torch::Tensor row_absmax(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "row_absmax: float32 [R, C] with contiguous rows");
  const int64_t rows = x.size(0), cols = x.size(1), xs = x.stride(0);
  auto out = torch::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      float m = 0.f;
      bool nan = false;
      absmax_lanes(xp + r * xs, cols, &m, &nan);
      op[r] = nan ? NAN : m;
    }
  });
  return out;
}

// Per-row max |x| of each of xs [R, C_i] (the same R, contiguous rows) into one [len(xs), R]: a
// decode forward's K, V or hidden states of every layer reduced in one call, without stacking them;
// or one layer's K and V (views into the same q|k|v rows). Row-major over (row, tensor): row r of
// every tensor is read before row r + 1, so K and V, adjacent in each q|k|v row, go in one pass
// over the buffer (a 2048-row prefill's K and V after the GEMM that wrote them: ~300 us here
// against ~880 us for two whole-tensor reductions, each a pass of its own).
torch::Tensor rows_absmax(const std::vector<torch::Tensor>& xs) {
  const int64_t n = static_cast<int64_t>(xs.size());
  TORCH_CHECK(n > 0, "rows_absmax: no tensors");
  const int64_t rows = xs[0].size(0);
  std::vector<const float*> ptr(n);
  std::vector<int64_t> cols(n), stride(n);
  for (int64_t i = 0; i < n; ++i) {
    const auto& x = xs[i];
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(0) == rows && x.stride(1) == 1,
                "rows_absmax: float32 [R, C] tensors with the same R and contiguous rows");
    ptr[i] = x.data_ptr<float>(), cols[i] = x.size(1), stride[i] = x.stride(0);
  }
  auto out = torch::empty({n, rows}, xs[0].options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * rows, 256, [&](int64_t b, int64_t end) {
    for (int64_t k = b; k < end; ++k) {
      const int64_t r = k / n, i = k % n;
      float m = 0.f;
      bool nan = false;
      absmax_lanes(ptr[i] + r * stride[i], cols[i], &m, &nan);
      op[i * rows + r] = nan ? NAN : m;
    }
  });
  return out;
}

// max |x| over all of x [R, C] (contiguous rows) as a Python float, NaN-propagating, on one thread
// (native.absmax: a tensor's absmax where no per-row figure is wanted).
double absmax(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "absmax: float32 [R, C] with contiguous rows");
  const int64_t rows = x.size(0), cols = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  float m = 0.f;
  bool nan = false;
  if (xs == cols) {
    absmax_lanes(xp, rows * cols, &m, &nan);      // one run over contiguous rows
  } else {
    for (int64_t r = 0; r < rows; ++r) absmax_lanes(xp + r * xs, cols, &m, &nan);
  }
  return nan ? NAN : m;
}

// paged_prefill.cpp
void paged_prefill(const torch::Tensor& q, torch::Tensor& out, const torch::Tensor& k, const torch::Tensor& v,
                   const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& chunks, double scale, bool bf16_dots);
bool prefill_bf16_dot();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while it runs, as torch's own ops do: submitter threads keep going.
  m.def("paged_prefill", &paged_prefill, "causal prefill attention of every chunk of a step (float32 q / k / v / out, or "
        "bf16 with bf16_dots; fresh rows or float32 / bf16 pages, CPU)", py::arg("q"), py::arg("out"), py::arg("k"), py::arg("v"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("chunks"), py::arg("scale"), py::arg("bf16_dots") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_bf16_dot", &prefill_bf16_dot, "whether paged_prefill's bf16 dots (avx512_bf16) were compiled in");
  m.def("paged_decode", &paged_decode, "paged decode attention over pages read in place (float32 q, float32 / bf16 pages, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("row_absmax", &row_absmax, "max |x| per row, NaN-propagating (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rows_absmax", &rows_absmax, "max |x| per row of each of a list of [R, C_i] tensors -> [n, R] (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("absmax", &absmax, "max |x| over a tensor, NaN-propagating (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (float32 or bf16 rows and weight, CPU); absmax: a float32 [N, R] "
        "buffer whose row `row` gets each row's max |x|", py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("absmax") = py::none(), py::arg("row") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("rope_write", &rope_write, "rotate q|k in place and store k, v at their slots (float32 q|k|v with a float32 / bf16 cache, or bf16 "
        "q|k|v with a bf16 cache, CPU); absmax: [2, T] float32 out, each row's max |k| and |v|, or [4, T] with its largest "
        "per-head L2 norm of k and of q too (float32 q|k|v); or a forward's [L, 2 or 4, T] buffer, this layer's slice filled",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("hq"), py::arg("hkv"), py::arg("absmax") = py::none(), py::arg("layer") = -1,
        py::call_guard<py::gil_scoped_release>());
}
