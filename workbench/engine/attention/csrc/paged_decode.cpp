// Paged decode attention on the CPU: one query token per sequence, reading K/V pages in
// place through the block table (no gather copy). The torch backend gathers each
// sequence's pages into a fresh tensor and then runs SDPA over it: three passes over
// the KV bytes where this kernel makes one, and decode attention is memory-bound.
//
// Layouts (the backend contract): q, out [T, Hq, D] (rows may be strided); caches
// [num_pages, page_size, Hkv, D] contiguous float32; block_tables [R, W] int32.
// Work item = one decode row; the G = Hq / Hkv query heads of a KV head share its K/V loads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// The next page is elsewhere in the pool (pages are scattered): ask for it while this one
// is computed, since the hardware prefetcher only follows the current page's stream.
inline void prefetch_page(const float* p, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 3);
}

// In-place softmax of x[0:n]. exp is evaluated as 2^k * p(r) (r in [-ln2/2, ln2/2], a
// degree-6 Taylor polynomial, relative error < 2e-7) so that the loop vectorises: a
// scalar std::exp per score was most of the kernel's time.
inline void softmax_inplace(float* x, int64_t n) {
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

}  // namespace

// Returns nothing: writes out[tok[i], h*G:(h+1)*G, :] for every decode row i and KV head h.
void paged_decode(const torch::Tensor& q, torch::Tensor& out, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& tok, const torch::Tensor& bt_rows, const torch::Tensor& lens,
                  double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
                  v_cache.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat,
              "paged_decode: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_decode: caches and block tables must be contiguous");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.dim() == 3 && out.stride(2) == 1,
              "paged_decode: q and out must be [T, Hq, D] with a contiguous last dim");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && tok.scalar_type() == torch::kLong &&
                  bt_rows.scalar_type() == torch::kLong && lens.scalar_type() == torch::kInt,
              "paged_decode: index dtypes");
  const int64_t num_pages = k_cache.size(0), ps = k_cache.size(1), hkv = k_cache.size(2),
                d = k_cache.size(3), hq = q.size(1), g = hq / hkv, width = block_tables.size(1);
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
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t tok_stride = hkv * d, page_stride = ps * hkv * d;
  const float sc = static_cast<float>(scale);

  // Longest rows first, handed out one at a time (LPT): rows differ in length by 10-100x,
  // and a static split leaves one core idle while the other finishes the long rows.
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ln[a] > ln[b]; });
  const int64_t max_len = n ? ln[order[0]] : 0;
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), n));

#pragma omp parallel num_threads(nthreads)
  {
    // A work item is one decode row with all its KV heads: each page is then read as one
    // contiguous block (page_size x Hkv x D), which the hardware prefetcher streams.
    std::vector<float> scores(hq * max_len), acc(hq * d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t oi = 0; oi < n; ++oi) {
      const int64_t i = order[oi], len = ln[i];
      const int32_t* row = bt + rw[i] * width;
      const float* qrow = qp + tk[i] * qs0;
      // scores[hq_i, t] = q . k_t * scale over pages read in place; four tokens at a time
      // give four independent FMA chains per query head instead of one latency-bound one.
      for (int64_t t0 = 0, j = 0; t0 < len; t0 += ps, ++j) {
        const float* kpage = kp + static_cast<int64_t>(row[j]) * page_stride;
        const int64_t m = std::min(ps, len - t0);
        if (t0 + ps < len) prefetch_page(kp + static_cast<int64_t>(row[j + 1]) * page_stride, page_stride);
        int64_t s = 0;
        for (; s + 4 <= m; s += 4) {
          for (int64_t h = 0; h < hkv; ++h) {
            const float *k0 = kpage + s * tok_stride + h * d, *k1 = k0 + tok_stride, *k2 = k1 + tok_stride,
                        *k3 = k2 + tok_stride;
            for (int64_t gi = 0; gi < g; ++gi) {
              const int64_t qi = h * g + gi;
              const float* qg = qrow + qi * qs1;
              float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
              for (int64_t x = 0; x < d; ++x) {
                a0 += qg[x] * k0[x];
                a1 += qg[x] * k1[x];
                a2 += qg[x] * k2[x];
                a3 += qg[x] * k3[x];
              }
              float* sg = scores.data() + qi * len + t0 + s;
              sg[0] = a0 * sc, sg[1] = a1 * sc, sg[2] = a2 * sc, sg[3] = a3 * sc;
            }
          }
        }
        for (; s < m; ++s)
          for (int64_t h = 0; h < hkv; ++h)
            for (int64_t gi = 0; gi < g; ++gi)
              scores[(h * g + gi) * len + t0 + s] = dot(qrow + (h * g + gi) * qs1, kpage + s * tok_stride + h * d, d) * sc;
      }
      for (int64_t qi = 0; qi < hq; ++qi) softmax_inplace(scores.data() + qi * len, len);
      // out[hq_i] = sum_t p[hq_i, t] v_t, four tokens per pass over the accumulator
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, j = 0; t0 < len; t0 += ps, ++j) {
        const float* vpage = vp + static_cast<int64_t>(row[j]) * page_stride;
        const int64_t m = std::min(ps, len - t0);
        if (t0 + ps < len) prefetch_page(vp + static_cast<int64_t>(row[j + 1]) * page_stride, page_stride);
        int64_t s = 0;
        for (; s + 4 <= m; s += 4) {
          for (int64_t h = 0; h < hkv; ++h) {
            const float *v0 = vpage + s * tok_stride + h * d, *v1 = v0 + tok_stride, *v2 = v1 + tok_stride,
                        *v3 = v2 + tok_stride;
            for (int64_t gi = 0; gi < g; ++gi) {
              const int64_t qi = h * g + gi;
              const float* p = scores.data() + qi * len + t0 + s;
              const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
              float* y = acc.data() + qi * d;
#pragma omp simd
              for (int64_t x = 0; x < d; ++x) y[x] += p0 * v0[x] + p1 * v1[x] + p2 * v2[x] + p3 * v3[x];
            }
          }
        }
        for (; s < m; ++s)
          for (int64_t h = 0; h < hkv; ++h)
            for (int64_t gi = 0; gi < g; ++gi)
              axpy(acc.data() + (h * g + gi) * d, scores[(h * g + gi) * len + t0 + s],
                   vpage + s * tok_stride + h * d, d);
      }
      for (int64_t qi = 0; qi < hq; ++qi)
        std::copy(acc.begin() + qi * d, acc.begin() + (qi + 1) * d, op + tk[i] * os0 + qi * os1);
    }
  }
}

// ---- the small per-layer ops around attention ------------------------------------------
// At decode sizes (16 rows) torch's rms_norm and rope are a handful of tiny ops each, and
// every one pays an OpenMP fork/join right after oneDNN's GEMM: ~30-70 us where the work
// is ~2 us. These run rows serially below 64 rows and in parallel above.

// y = w * x / sqrt(mean(x^2) + eps), x [R, H] with a contiguous last dim.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x [R, H] (contiguous rows), w [H]");
  const int64_t rows = x.size(0), hdim = x.size(1), xs = x.stride(0);
  auto y = torch::empty({rows, hdim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const float* xr = xp + r * xs;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hdim; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hdim) + e);
      float* yr = yp + r * hdim;
#pragma omp simd
      for (int64_t i = 0; i < hdim; ++i) yr[i] = wp[i] * (xr[i] * inv);
    }
  });
  return y;
}

// In place on the packed q|k|v rows [T, (Hq + 2 Hkv) * D]: rotate q and k (rotate-half RoPE,
// as Hugging Face Llama; cos/sin [T, D] for each token's position), then store k and v at
// slots[t] of the caches [num_pages, page_size, Hkv, D]. One pass instead of ~7 ops.
void rope_write(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                torch::Tensor& v_cache, const torch::Tensor& slots, int64_t hq, int64_t hkv) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
                  v_cache.scalar_type() == torch::kFloat, "rope_write: float32 only");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && slots.is_contiguous(), "rope_write: contiguous tensors only");
  TORCH_CHECK(slots.scalar_type() == torch::kLong, "rope_write: slots must be int64");
  const int64_t t_n = qkv.size(0), d = k_cache.size(3), half = d / 2;
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d && k_cache.size(2) == hkv && cos.size(0) == t_n &&
                  cos.size(1) == d && sin.sizes() == cos.sizes() && slots.numel() == t_n,
              "rope_write: shapes disagree");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), width = qkv.size(1), kv = hkv * d;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_n; ++t)       // validate first: a bad slot writes nothing anywhere
    TORCH_CHECK_INDEX(sl[t] >= 0 && sl[t] < num_slots, "index ", sl[t], " is out of bounds for dimension 0 "
                      "with size ", num_slots, " (rope_write: slot of token ", t, ")");
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, t_n, 64, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      float* row = base + t * width;
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        float* x = row + h * d;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], bb = x[i + half];
          x[i] = a * c[i] - bb * s[i];
          x[i + half] = bb * c[i + half] + a * s[i + half];
        }
      }
      std::copy(row + hq * d, row + hq * d + kv, kc + sl[t] * kv);
      std::copy(row + hq * d + kv, row + hq * d + 2 * kv, vc + sl[t] * kv);
    }
  });
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
      const float* xr = xp + r * xs;
      float m = 0.f;
      bool nan = false;
      for (int64_t i = 0; i < cols; ++i) {
        const float a = std::fabs(xr[i]);
        nan |= (a != a);
        m = a > m ? a : m;
      }
      op[r] = nan ? NAN : m;
    }
  });
  return out;
}

// max |x| over all of x [R, C] (contiguous rows) as a Python float, NaN-propagating: the
// KVWritten event's absmax of K and of V, every layer of every logged step.
double absmax(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "absmax: float32 [R, C] with contiguous rows");
  const int64_t rows = x.size(0), cols = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  float m = 0.f;
  bool nan = false;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * xs;
    for (int64_t i = 0; i < cols; ++i) {
      const float a = std::fabs(xr[i]);
      nan |= (a != a);
      m = a > m ? a : m;
    }
  }
  return nan ? NAN : m;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while it runs, as torch's own ops do: submitter threads keep going.
  m.def("paged_decode", &paged_decode, "paged decode attention over pages read in place (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("row_absmax", &row_absmax, "max |x| per row, NaN-propagating (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("absmax", &absmax, "max |x| over a tensor, NaN-propagating (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (float32, CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("rope_write", &rope_write, "rotate q|k in place and store k, v at their slots (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
