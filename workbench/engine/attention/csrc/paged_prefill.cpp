// Prefill attention on the CPU for every prefill chunk of a step in one call (flash-attention
// style: key blocks of 16 or 32, an online softmax, nothing of size n x context materialised).
//
// torch's per-sequence SDPA calls cost one OpenMP fork each and split 9 heads over 2 cores
// unevenly; at ~290-token chunks they ran at ~55 GFLOP/s here. This kernel shares out
// (chunk, KV head, block of 16 query positions) items longest first over the cores.
//
// Keys and values of a chunk come from one of two places, as in the torch path it replaces:
// - a chunk that is its sequence's whole context reads the fresh k / v rows of this step
//   (float32, or a native-bf16 model's bf16; rows `fresh_stride` apart in the packed q|k|v buffer);
// - a chunk after a prefix hit or an earlier chunk reads its whole context from the pages
//   through the block table (float32 or bfloat16 pages, widened as loaded).
// Query position i of a chunk of n over context c sits at c - n + i: causal, bottom-right.
//
// bf16 dots (a native-bf16 model, bf16 pages, a CPU with avx512_bf16): the scores and P.V take
// their inputs rounded to bf16 and sum pairs of products in float32 with vdpbf16ps, half the
// multiply-adds of the float32 kernel; the softmax stays float32. Q is rounded once (after the
// scale), K and V are the bf16 values the pages hold (a fresh chunk's float32 rows are rounded
// the way the store rounds them), P is rounded once before P.V, as flash attention does on GPUs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../csrc/avx512_math.h"

namespace {

// Keys per block: 32 where the pages allow (a block never crosses a page), else 16. Each block
// pays a fixed cost (the mask, the running max and sum, the rescale of every accumulator row):
// 32-key blocks halve it, ~5% of the kernel here.
constexpr int64_t KB_PAGED = 32, KB_MIN = 16;
constexpr int64_t QB = 16;   // query positions per item

struct Chunk {
  int64_t start, n, context, bt_row;
  bool fresh;
  int64_t offset;   // the plan's mask: position p sees keys t <= p + offset (0: causal)
};

struct Shape {
  int64_t hq, hkv, g, d, ps, page_stride, tok_stride, width, qs0, qs1, os0, os1, fresh_stride;
  float scale;
};

#if defined(__AVX512F__)
// Scores with the rows in the lanes: st[t][gi] = sum_x k_t[x] qt[x][16 gi : 16 gi + 16] for NG
// groups of 16 rows, U tokens at a time: the tokens share each qt load, the groups each k_t[x]
// broadcast (U NG accumulators, NG + U loads per U NG FMAs; U = 8 at 3 groups, 24 accumulators:
// ~5% of the kernel over U = 4).
template <typename T, int NG>
inline void qk_rows(const float* qt, int64_t rpad, const T* kp, int64_t kstride, int64_t kn, int64_t d,
                    __m512 (*st)[3]) {
  int64_t t = 0;
  constexpr int U = NG == 3 ? 8 : 4;
  for (; t + U <= kn; t += U) {
    __m512 a[U][NG];
    for (int u = 0; u < U; ++u)
      for (int gi = 0; gi < NG; ++gi) a[u][gi] = _mm512_setzero_ps();
    const T* k0 = kp + t * kstride;
    for (int64_t x = 0; x < d; ++x) {
      __m512 qv[NG];
      for (int gi = 0; gi < NG; ++gi) qv[gi] = _mm512_loadu_ps(qt + x * rpad + 16 * gi);
      // Keep q in registers: g++ otherwise folds each load into the 4 FMAs that use it (12
      // vector loads a step where 3 do), and the loop ran load-bound (~8% of the kernel).
      for (int gi = 0; gi < NG; ++gi) asm("" : "+v"(qv[gi]));
      for (int u = 0; u < U; ++u) {
        const __m512 kb = _mm512_set1_ps(pagedkv::to_float(k0[u * kstride + x]));
        for (int gi = 0; gi < NG; ++gi) a[u][gi] = _mm512_fmadd_ps(kb, qv[gi], a[u][gi]);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int gi = 0; gi < NG; ++gi) st[t + u][gi] = a[u][gi];
  }
  for (; t < kn; ++t) {
    __m512 a[NG];
    for (int gi = 0; gi < NG; ++gi) a[gi] = _mm512_setzero_ps();
    const T* kt = kp + t * kstride;
    for (int64_t x = 0; x < d; ++x) {
      const __m512 kb = _mm512_set1_ps(pagedkv::to_float(kt[x]));
      for (int gi = 0; gi < NG; ++gi) a[gi] = _mm512_fmadd_ps(kb, _mm512_loadu_ps(qt + x * rpad + 16 * gi), a[gi]);
    }
    for (int gi = 0; gi < NG; ++gi) st[t][gi] = a[gi];
  }
}

template <typename T>
inline void qk_groups(int ng, const float* qt, int64_t rpad, const T* kp, int64_t kstride, int64_t kn, int64_t d,
                      __m512 (*st)[3]) {
  if (ng == 3) qk_rows<T, 3>(qt, rpad, kp, kstride, kn, d, st);
  else if (ng == 2) qk_rows<T, 2>(qt, rpad, kp, kstride, kn, d, st);
  else qk_rows<T, 1>(qt, rpad, kp, kstride, kn, d, st);
}

// 16 rows of 16 32-bit words transposed in registers (unpacks, then 128-bit lane shuffles).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + 4 + k], 0x88);
      t[i + 4 + k] = _mm512_shuffle_i32x4(r[i + k], r[i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
}

// o[r] = o[r] * corr[r] + sum_t p[t][r] v_t for RT rows, the accumulators in registers; d = 16 DV.
template <typename T, int DV, int RT>
inline void pv_tile(float* o, int64_t d, const float* corr, const float* p, int64_t rpad, int64_t rows, const T* vp,
                    int64_t vstride, int64_t kn) {
  __m512 acc[RT][DV];
  for (int r = 0; r < RT; ++r) {
    const __m512 cr = _mm512_set1_ps(r < rows ? corr[r] : 0.f);
    for (int x = 0; x < DV; ++x)
      acc[r][x] = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(o + r * d + 16 * x), cr) : _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < kn; ++t) {
    __m512 vv[DV];
    for (int x = 0; x < DV; ++x) vv[x] = pagedkv::load16(vp + t * vstride + 16 * x);
    for (int r = 0; r < RT; ++r) {
      const __m512 w = _mm512_set1_ps(p[t * rpad + r]);
      for (int x = 0; x < DV; ++x) acc[r][x] = _mm512_fmadd_ps(w, vv[x], acc[r][x]);
    }
  }
  for (int r = 0; r < RT && r < rows; ++r)
    for (int x = 0; x < DV; ++x) _mm512_storeu_ps(o + r * d + 16 * x, acc[r][x]);
}
#endif

#if defined(__AVX512BF16__)
#define PAGEDKV_PREFILL_BF16 1
// A pair of bf16 (two key dims, or two keys' probabilities) in one 32-bit lane: what vdpbf16ps
// multiplies lane by lane. memcpy: the pair is read from bf16 rows, without aliasing a uint16.
inline __m512bh pair_bcast(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

// 16 floats rounded to bf16 (RNE, as the K/V store rounds), zero-extended into 32-bit lanes.
inline __m512i bf16_lanes(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

// lo in the low half of each lane, hi in the high half: the pair vdpbf16ps takes.
inline __m512i pack_pairs(__m512 lo, __m512 hi) {
  return _mm512_or_si512(bf16_lanes(lo), _mm512_slli_epi32(bf16_lanes(hi), 16));
}

// The scores of qk_rows with Q as dim pairs [d/2][rpad] and K rows of bf16: half the steps.
template <int NG>
inline void qk_rows_bf(const uint32_t* qp, int64_t rpad, const uint16_t* kp, int64_t kstride, int64_t kn, int64_t d,
                       __m512 (*st)[3]) {
  int64_t t = 0;
  constexpr int U = NG == 3 ? 8 : 4;
  const int64_t d2 = d / 2;
  for (; t + U <= kn; t += U) {
    __m512 a[U][NG];
    for (int u = 0; u < U; ++u)
      for (int gi = 0; gi < NG; ++gi) a[u][gi] = _mm512_setzero_ps();
    const uint16_t* k0 = kp + t * kstride;
    for (int64_t x = 0; x < d2; ++x) {
      __m512i qv[NG];
      for (int gi = 0; gi < NG; ++gi) qv[gi] = _mm512_loadu_si512(qp + x * rpad + 16 * gi);
      for (int gi = 0; gi < NG; ++gi) asm("" : "+v"(qv[gi]));   // as in qk_rows: q stays in registers
      for (int u = 0; u < U; ++u) {
        const __m512bh kb = pair_bcast(k0 + u * kstride + 2 * x);
        for (int gi = 0; gi < NG; ++gi) a[u][gi] = _mm512_dpbf16_ps(a[u][gi], (__m512bh)qv[gi], kb);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int gi = 0; gi < NG; ++gi) st[t + u][gi] = a[u][gi];
  }
  for (; t < kn; ++t) {
    __m512 a[NG];
    for (int gi = 0; gi < NG; ++gi) a[gi] = _mm512_setzero_ps();
    const uint16_t* kt = kp + t * kstride;
    for (int64_t x = 0; x < d2; ++x) {
      const __m512bh kb = pair_bcast(kt + 2 * x);
      for (int gi = 0; gi < NG; ++gi)
        a[gi] = _mm512_dpbf16_ps(a[gi], (__m512bh)_mm512_loadu_si512(qp + x * rpad + 16 * gi), kb);
    }
    for (int gi = 0; gi < NG; ++gi) st[t][gi] = a[gi];
  }
}

inline void qk_groups_bf(int ng, const uint32_t* qp, int64_t rpad, const uint16_t* kp, int64_t kstride, int64_t kn,
                         int64_t d, __m512 (*st)[3]) {
  if (ng == 3) qk_rows_bf<3>(qp, rpad, kp, kstride, kn, d, st);
  else if (ng == 2) qk_rows_bf<2>(qp, rpad, kp, kstride, kn, d, st);
  else qk_rows_bf<1>(qp, rpad, kp, kstride, kn, d, st);
}

// 32 bf16 of a K or V row from x: the page's values, or a fresh float32 row rounded as stored.
inline __m512i row32(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline __m512i row32(const float* p) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}

// A block's kn keys as bf16 rows [kn][d] (kbuf), and its values as key pairs [kn/2][d][2]
// (vbuf: lane x of pair j holds v[2j][x], v[2j+1][x]; an odd last key pairs with zeros).
template <typename T>
inline void block_bf(const T* kp, int64_t kstride, const T* vp, int64_t vstride, int64_t kn, int64_t d,
                     uint16_t* kbuf, uint16_t* vbuf) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t t = 0; t < kn; ++t)
      for (int64_t x = 0; x < d; x += 32) _mm512_storeu_si512(kbuf + t * d + x, row32(kp + t * kstride + x));
  }
  for (int64_t t = 0; t < kn; t += 2) {
    uint16_t* dst = vbuf + t * d;        // pair t / 2: 2 d values
    for (int64_t x = 0; x < d; x += 32) {
      const __m512i a = row32(vp + t * vstride + x);
      const __m512i b = t + 1 < kn ? row32(vp + (t + 1) * vstride + x) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * x, _mm512_permutex2var_epi16(a, il, b));
      _mm512_storeu_si512(dst + 2 * x + 32, _mm512_permutex2var_epi16(a, ih, b));
    }
  }
}

// pv_tile over key pairs: pp [kn/2][rpad] holds each row's two probabilities as a bf16 pair.
template <int DV, int RT>
inline void pv_tile_bf(float* o, int64_t d, const float* corr, const uint32_t* pp, int64_t rpad, int64_t rows,
                       const uint16_t* vbuf, int64_t kn2) {
  __m512 acc[RT][DV];
  for (int r = 0; r < RT; ++r) {
    const __m512 cr = _mm512_set1_ps(r < rows ? corr[r] : 0.f);
    for (int x = 0; x < DV; ++x)
      acc[r][x] = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(o + r * d + 16 * x), cr) : _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < kn2; ++j) {
    __m512i vv[DV];
    for (int x = 0; x < DV; ++x) vv[x] = _mm512_loadu_si512(vbuf + j * 2 * d + 32 * x);
    for (int r = 0; r < RT; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[j * rpad + r]));
      for (int x = 0; x < DV; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], w, (__m512bh)vv[x]);
    }
  }
  for (int r = 0; r < RT && r < rows; ++r)
    for (int x = 0; x < DV; ++x) _mm512_storeu_ps(o + r * d + 16 * x, acc[r][x]);
}
#endif  // __AVX512BF16__

// One item: positions [i0, i0 + qn) of a chunk, KV head h, its G query heads: R = qn x G rows
// (row r = position r / G, head r % G). kblock(j) / vblock(j) give key block j's first row
// and row stride (a block's KB rows never cross a page).
// BF: the bf16 dots (Q as dim pairs in qt's space, the block's K and V as bf16, P as key pairs).
// Q: the dtype of q and out (float32, or bf16 with BF: a native-bf16 model's rows, no widening).
template <typename T, typename Q, int64_t KB, bool BF, typename KF, typename VF>
void item(const Chunk& c, int64_t i0, int64_t qn, int64_t h, const Q* q, Q* out, const Shape& s,
          KF kblock, VF vblock, float* scratch) {
  const int64_t g = s.g, d = s.d, R = qn * g, rpad = (R + 15) / 16 * 16;
  float* qt = scratch;                    // Q transposed and scaled, [d][rpad] (BF: pairs [d / 2][rpad])
  float* o = qt + d * rpad;               // accumulators [R][d]
  float* m = o + rpad * d;                // running max [rpad]
  float* l = m + rpad;                    // running sum [rpad]
  float* corr = l + rpad;                 // this block's rescale of o [rpad]
  float* p = corr + rpad;                 // this block's probabilities, [KB][rpad]
  // BF only: the block's keys as bf16 rows [KB][d], its values as key pairs [KB / 2][d][2], its
  // probabilities as key pairs [KB / 2][rpad].
  uint16_t* kbuf = reinterpret_cast<uint16_t*>(p + KB * rpad);
  uint16_t* vbuf = kbuf + KB * d;
  uint32_t* pp = reinterpret_cast<uint32_t*>(vbuf + KB * d);
  uint32_t* qp = reinterpret_cast<uint32_t*>(qt);
  std::fill(m, m + rpad, -INFINITY);
  std::fill(l, l + rpad, 0.f);
  const Q* q0 = q + (c.start + i0) * s.qs0 + h * g * s.qs1;     // row r: position r / g, head r % g
#if defined(__AVX512F__)
  // Q scaled (BF: rounded to bf16 pairs) row by row into o's space as [rpad][cw] 32-bit words,
  // then transposed 16 x 16 words at a time into qt [cw][rpad]. One gather per dimension and 16
  // rows, as before, was ~15% of the kernel on these cores.
  const int64_t cw = BF ? d / 2 : d;
  if (d % (BF ? 32 : 16) == 0) {
    uint32_t* rows = reinterpret_cast<uint32_t*>(o);
    const __m512 vscale = _mm512_set1_ps(s.scale);
    for (int64_t r = 0; r < rpad; ++r) {
      uint32_t* dst = rows + r * cw;
      if (r >= R) {
        std::fill(dst, dst + cw, 0u);
        continue;
      }
      const Q* qr = q0 + (r / g) * s.qs0 + (r % g) * s.qs1;
#if defined(PAGEDKV_PREFILL_BF16)
      if constexpr (BF) {
        for (int64_t x = 0; x < d; x += 32) {
          const __m512 a = _mm512_mul_ps(pagedkv::load16(qr + x), vscale);
          const __m512 b = _mm512_mul_ps(pagedkv::load16(qr + x + 16), vscale);
          _mm512_storeu_si512(dst + x / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        continue;
      }
#endif
      for (int64_t x = 0; x < d; x += 16)
        _mm512_storeu_ps(reinterpret_cast<float*>(dst) + x, _mm512_mul_ps(pagedkv::load16(qr + x), vscale));
    }
    uint32_t* words = reinterpret_cast<uint32_t*>(qt);
    for (int64_t r0 = 0; r0 < rpad; r0 += 16)
      for (int64_t c0 = 0; c0 < cw; c0 += 16) {
        __m512i t[16];
        for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_si512(rows + (r0 + i) * cw + c0);
        transpose16(t);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(words + (c0 + i) * rpad + r0, t[i]);
      }
  } else
#endif
  if constexpr (BF) {
    std::fill(qp, qp + (d / 2) * rpad, 0u);
    for (int64_t r = 0; r < R; ++r) {
      const Q* qr = q0 + (r / g) * s.qs0 + (r % g) * s.qs1;
      for (int64_t x = 0; x < d; x += 2)
        qp[(x / 2) * rpad + r] = uint32_t{c10::BFloat16(pagedkv::to_float(qr[x]) * s.scale).x} |
                                 (uint32_t{c10::BFloat16(pagedkv::to_float(qr[x + 1]) * s.scale).x} << 16);
    }
  } else {
    std::fill(qt, qt + d * rpad, 0.f);
    for (int64_t r = 0; r < R; ++r) {
      const Q* qr = q0 + (r / g) * s.qs0 + (r % g) * s.qs1;
      for (int64_t x = 0; x < d; ++x) qt[x * rpad + r] = pagedkv::to_float(qr[x]) * s.scale;
    }
  }
  std::fill(o, o + R * d, 0.f);   // after the transposition, which used o's space
  const int64_t first_pos = c.context - c.n + i0;
  const int64_t last_key = std::min(c.context - 1, first_pos + qn - 1 + c.offset);   // of any row
  const int64_t blocks = last_key / KB + 1;
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t t0 = j * KB, kn = std::min<int64_t>(KB, last_key + 1 - t0);
    auto [kp, kstride] = kblock(j);
    auto [vp, vstride] = vblock(j);
#if defined(__AVX512F__)
    [[maybe_unused]] const uint16_t* kb16 = nullptr;
    [[maybe_unused]] int64_t kb16_stride = 0;
#if defined(PAGEDKV_PREFILL_BF16)
    if constexpr (BF) {
      if constexpr (std::is_same_v<T, float>) {   // a fresh chunk: round its float32 rows as the store does
        block_bf(kp, kstride, vp, vstride, kn, d, kbuf, vbuf);
        kb16 = kbuf;
        kb16_stride = d;
      } else {                                    // bf16 pages: K read in place
        kb16 = reinterpret_cast<const uint16_t*>(kp);
        kb16_stride = kstride;
        block_bf(kb16, kstride, reinterpret_cast<const uint16_t*>(vp), vstride, kn, d, kbuf, vbuf);
      }
    }
#endif
    for (int64_t rg = 0; rg < rpad; rg += 48) {
     const int ng = static_cast<int>(std::min<int64_t>(3, (rpad - rg) / 16));
     __m512 sts[KB][3];
#if defined(PAGEDKV_PREFILL_BF16)
     if constexpr (BF) qk_groups_bf(ng, qp + rg, rpad, kb16, kb16_stride, kn, d, sts);
     else
#endif
     qk_groups<T>(ng, qt + rg, rpad, kp, kstride, kn, d, sts);
     for (int gi = 0; gi < ng; ++gi) {
      const int64_t r0 = rg + 16 * gi;
      __m512 st[KB];
      for (int64_t t = 0; t < kn; ++t) st[t] = sts[t][gi];
      // Causal (and the plan's offset): row r sees keys t <= pos(r) + offset.
      alignas(64) int32_t lim[16];
      for (int i = 0; i < 16; ++i) lim[i] = static_cast<int32_t>(first_pos + (r0 + i) / g + c.offset - t0);
      const __m512i vlim = _mm512_load_si512(lim);
      __m512 bm = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < kn; ++t) {
        const __mmask16 ok = _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(t)), vlim, _MM_CMPINT_LE);
        st[t] = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), st[t]);
        bm = _mm512_max_ps(bm, st[t]);
      }
      const __m512 mo = _mm512_loadu_ps(m + r0);
      const __m512 mn = _mm512_max_ps(mo, bm);
      // rows that have seen no key yet keep m = -inf: exp(-inf - -inf) must not be NaN
      const __mmask16 live = _mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m512 safe = _mm512_mask_blend_ps(live, _mm512_setzero_ps(), mn);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < kn; ++t) {
        const __m512 e = _mm512_maskz_mov_ps(live, pagedkv::exp512(_mm512_sub_ps(st[t], safe)));
        const __m512 e0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(st[t], _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                               e, _mm512_setzero_ps());
        _mm512_storeu_ps(p + t * rpad + r0, e0);
        sum = _mm512_add_ps(sum, e0);
      }
      const __m512 cr = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.f),
                                             pagedkv::exp512(_mm512_sub_ps(mo, safe)));   // exp(-inf) ~ 0
      _mm512_storeu_ps(corr + r0, cr);
      _mm512_storeu_ps(l + r0, _mm512_fmadd_ps(_mm512_loadu_ps(l + r0), cr, sum));
      _mm512_storeu_ps(m + r0, mn);
     }
    }
#if defined(PAGEDKV_PREFILL_BF16)
    if constexpr (BF) {   // d is 64 or 128 (paged_prefill's dispatch)
      const int64_t kn2 = (kn + 1) / 2;
      for (int64_t jj = 0; jj < kn2; ++jj)
        for (int64_t r0 = 0; r0 < rpad; r0 += 16) {
          const __m512 lo = _mm512_loadu_ps(p + 2 * jj * rpad + r0);
          const __m512 hi = 2 * jj + 1 < kn ? _mm512_loadu_ps(p + (2 * jj + 1) * rpad + r0) : _mm512_setzero_ps();
          _mm512_storeu_si512(pp + jj * rpad + r0, pack_pairs(lo, hi));
        }
      if (d == 64)
        for (int64_t r0 = 0; r0 < R; r0 += 6) pv_tile_bf<4, 6>(o + r0 * d, d, corr + r0, pp + r0, rpad, R - r0, vbuf, kn2);
      else
        for (int64_t r0 = 0; r0 < R; r0 += 3) pv_tile_bf<8, 3>(o + r0 * d, d, corr + r0, pp + r0, rpad, R - r0, vbuf, kn2);
      continue;
    }
#endif
    if (d == 64) {
      for (int64_t r0 = 0; r0 < R; r0 += 6) pv_tile<T, 4, 6>(o + r0 * d, d, corr + r0, p + r0, rpad, R - r0, vp, vstride, kn);
      continue;
    }
    if (d == 128) {
      for (int64_t r0 = 0; r0 < R; r0 += 3) pv_tile<T, 8, 3>(o + r0 * d, d, corr + r0, p + r0, rpad, R - r0, vp, vstride, kn);
      continue;
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t x = 0; x < d; ++x) o[r * d + x] *= corr[r];
#else
    for (int64_t r = 0; r < R; ++r) {
      const int64_t lim = first_pos + r / g + c.offset - t0;
      float sc[KB];
      float bm = -INFINITY;
      for (int64_t t = 0; t < kn; ++t) {
        float a = 0.f;
        for (int64_t x = 0; x < d; ++x) a += pagedkv::to_float(kp[t * kstride + x]) * qt[x * rpad + r];
        sc[t] = t <= lim ? a : -INFINITY;
        bm = std::max(bm, sc[t]);
      }
      const float mn = std::max(m[r], bm);
      float sum = 0.f;
      for (int64_t t = 0; t < kn; ++t) sum += (p[t * rpad + r] = sc[t] == -INFINITY ? 0.f : std::exp(sc[t] - mn));
      corr[r] = mn == -INFINITY ? 1.f : std::exp(m[r] - mn);
      l[r] = l[r] * corr[r] + sum;
      m[r] = mn;
      for (int64_t x = 0; x < d; ++x) o[r * d + x] *= corr[r];
    }
#endif
    for (int64_t t = 0; t < kn; ++t)      // the generic P.V (other head sizes, no AVX-512)
      for (int64_t r = 0; r < R; ++r) {
        const float w = p[t * rpad + r];
        for (int64_t x = 0; x < d; ++x) o[r * d + x] += w * pagedkv::to_float(vp[t * vstride + x]);
      }
  }
  for (int64_t r = 0; r < R; ++r) {
    Q* dst = out + (c.start + i0 + r / g) * s.os0 + (h * g + r % g) * s.os1;
    const float inv = 1.f / l[r];
#if defined(PAGEDKV_PREFILL_BF16)
    if constexpr (!std::is_same_v<Q, float>) {   // bf16 out: rounded once (d is 64 or 128 here)
      const __m512 vi = _mm512_set1_ps(inv);
      for (int64_t x = 0; x < d; x += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * d + x), vi)));
      continue;
    }
#endif
    for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<Q>(o[r * d + x] * inv);
  }
}

template <typename T, typename Q, int64_t KB, bool BF>
void run(const std::vector<Chunk>& chunks, const Q* q, Q* out, const Q* fk, const Q* fv, const T* kc,
         const T* vc, const int32_t* bt, const Shape& s) {
  // Items: (chunk, KV head, 16 positions), the costliest (most keys) first, one at a time.
  struct Work { int64_t chunk, i0, h, keys; };
  std::vector<Work> work;
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci)
    for (int64_t i0 = 0; i0 < chunks[ci].n; i0 += QB)
      for (int64_t h = 0; h < s.hkv; ++h)
        work.push_back({ci, i0, h, chunks[ci].context - chunks[ci].n + std::min(chunks[ci].n, i0 + QB)});
  std::sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.keys > b.keys; });
  const int64_t items = static_cast<int64_t>(work.size());
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
  const int64_t R = QB * s.g;
#pragma omp parallel num_threads(nthreads)
  {
    const int64_t rpad = (R + 15) / 16 * 16;
    // qt, o, m / l / corr / spare, p; then BF's kbuf, vbuf (bf16: KB d each) and pp (KB / 2 rpad
    // pairs); 64 floats of slack for the tiles' reads past the last row.
    std::vector<float> scratch(s.d * rpad + rpad * s.d + 4 * rpad + KB * rpad + (BF ? KB * s.d + KB * rpad / 2 : 0) + 64);
#pragma omp for schedule(dynamic, 1)
    for (int64_t wi = 0; wi < items; ++wi) {
      const Work& w = work[wi];
      const Chunk& c = chunks[w.chunk];
      const int64_t qn = std::min(QB, c.n - w.i0), hoff = w.h * s.d;
      if (c.fresh) {   // keys t are rows start + t of this step's k / v
        auto kb = [&](int64_t j) { return std::make_pair(fk + (c.start + j * KB) * s.fresh_stride + hoff, s.fresh_stride); };
        auto vb = [&](int64_t j) { return std::make_pair(fv + (c.start + j * KB) * s.fresh_stride + hoff, s.fresh_stride); };
        item<Q, Q, KB, BF>(c, w.i0, qn, w.h, q, out, s, kb, vb, scratch.data());
      } else {         // keys t are in page t / ps of the chunk's block-table row
        const int32_t* row = bt + c.bt_row * s.width;
        auto at = [&](const T* base, int64_t j) {
          const int64_t t = j * KB;
          return std::make_pair(base + static_cast<int64_t>(row[t / s.ps]) * s.page_stride + (t % s.ps) * s.tok_stride + hoff,
                                s.tok_stride);
        };
        auto kb = [&](int64_t j) { return at(kc, j); };
        auto vb = [&](int64_t j) { return at(vc, j); };
        item<T, Q, KB, BF>(c, w.i0, qn, w.h, q, out, s, kb, vb, scratch.data());
      }
    }
  }
}

}  // namespace

// Whether the bf16 dots were compiled in (-march=native on a CPU with avx512_bf16).
bool prefill_bf16_dot() {
#if defined(PAGEDKV_PREFILL_BF16)
  return true;
#else
  return false;
#endif
}

// chunks [C, 6] int64: (first packed row, query count n, context c, block-table row, fresh 0/1,
// mask offset: position p sees keys t <= p + offset, 0 for the causal mask).
// q, out [T, Hq, D], k, v [T, Hkv, D] (this step's rows, any row stride): float32, or all bf16
// with bf16_dots (a native-bf16 model's rows, no widening; out rounded once);
// caches [P, ps, Hkv, D] float32 or bf16, ps a multiple of 16; block_tables [R, W] int32.
// bf16_dots: the scores and P.V in bf16 pairs with float32 sums (bf16 caches, head size 64 or
// 128, a build with avx512_bf16; the caller checks the CPU has it, as for the skinny GEMM).
void paged_prefill(const torch::Tensor& q, torch::Tensor& out, const torch::Tensor& k, const torch::Tensor& v,
                   const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& chunks, double scale, bool bf16_dots) {
  const auto ct = k_cache.scalar_type(), qt = q.scalar_type();
  TORCH_CHECK(!bf16_dots || (prefill_bf16_dot() && ct == torch::kBFloat16),
              "paged_prefill: bf16 dots need a build with avx512_bf16 and a bfloat16 cache");
  TORCH_CHECK((qt == torch::kFloat || qt == torch::kBFloat16) && out.scalar_type() == qt && k.scalar_type() == qt &&
                  v.scalar_type() == qt && (ct == torch::kFloat || ct == torch::kBFloat16) &&
                  v_cache.scalar_type() == ct,
              "paged_prefill: q / k / v / out of one dtype (float32, or bfloat16 with bf16 dots) and a float32 or "
              "bfloat16 cache only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 &&
                  out.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2) && k.stride(0) == v.stride(0),
              "paged_prefill: q, out [T, Hq, D], k, v [T, Hkv, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
                  block_tables.scalar_type() == torch::kInt && chunks.scalar_type() == torch::kLong &&
                  chunks.dim() == 2 && chunks.size(1) == 6 && chunks.is_contiguous(),
              "paged_prefill: contiguous caches, int32 block tables, int64 chunks [C, 6]");
  const int64_t ps = k_cache.size(1), hkv = k_cache.size(2), d = k_cache.size(3), hq = q.size(1);
  TORCH_CHECK(ps % KB_MIN == 0, "paged_prefill: page size ", ps, " is not a multiple of ", KB_MIN);
  TORCH_CHECK(hq % hkv == 0 && k.size(1) == hkv && k.size(2) == d && q.size(2) == d, "paged_prefill: head shapes");
  const int64_t rows = q.size(0), width = block_tables.size(1), pages = k_cache.size(0);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  std::vector<Chunk> cs;
  const int64_t* cp = chunks.data_ptr<int64_t>();
  for (int64_t i = 0; i < chunks.size(0); ++i) {
    Chunk c{cp[6 * i], cp[6 * i + 1], cp[6 * i + 2], cp[6 * i + 3], cp[6 * i + 4] != 0, cp[6 * i + 5]};
    TORCH_CHECK(c.n >= 1 && c.start >= 0 && c.start + c.n <= rows && c.context >= c.n,
                "paged_prefill: chunk ", i, " (rows ", c.start, "+", c.n, ", context ", c.context, ") does not fit");
    TORCH_CHECK(!c.fresh || (c.context == c.n && c.offset == 0), "paged_prefill: a fresh chunk is its whole context");
    TORCH_CHECK(c.offset > -c.context, "paged_prefill: chunk ", i, " mask offset ", c.offset, " hides every key");
    if (!c.fresh) {   // validate before reading: a bad id raises, never reads past the pool
      TORCH_CHECK(c.bt_row >= 0 && c.bt_row < block_tables.size(0) && (c.context + ps - 1) / ps <= width,
                  "paged_prefill: chunk ", i, " context ", c.context, " does not fit the block table");
      for (int64_t j = 0, w = (c.context + ps - 1) / ps; j < w; ++j) {
        const int32_t id = bt[c.bt_row * width + j];
        TORCH_CHECK_INDEX(id >= 0 && id < pages, "index ", id, " is out of bounds for dimension 0 with size ", pages,
                          " (paged_prefill: page id in block table row ", c.bt_row, ")");
      }
    }
    cs.push_back(c);
  }
  const Shape s{hq, hkv, hq / hkv, d, ps, ps * hkv * d, hkv * d, width, q.stride(0), q.stride(1), out.stride(0),
                out.stride(1), k.stride(0), static_cast<float>(scale)};
  const bool wide = ps % KB_PAGED == 0;
  if (qt == torch::kBFloat16) {   // a native-bf16 model's rows as they are: bf16 dots, bf16 out
    TORCH_CHECK(bf16_dots && (d == 64 || d == 128),
                "paged_prefill: bfloat16 q / k / v take bf16 dots and a head size of 64 or 128");
#if defined(PAGEDKV_PREFILL_BF16)
    using B = c10::BFloat16;
    auto* f = wide ? &run<B, B, KB_PAGED, true> : &run<B, B, KB_MIN, true>;
    f(cs, q.data_ptr<B>(), out.data_ptr<B>(), k.data_ptr<B>(), v.data_ptr<B>(), k_cache.data_ptr<B>(),
      v_cache.data_ptr<B>(), bt, s);
#endif
    return;
  }
  if (ct == torch::kFloat) {
    auto* f = wide ? &run<float, float, KB_PAGED, false> : &run<float, float, KB_MIN, false>;
    f(cs, q.data_ptr<float>(), out.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
      k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, s);
  } else {
    auto* f = wide ? &run<c10::BFloat16, float, KB_PAGED, false> : &run<c10::BFloat16, float, KB_MIN, false>;
#if defined(PAGEDKV_PREFILL_BF16)
    if (bf16_dots && (d == 64 || d == 128))   // the head sizes the pair tiles cover; others keep float32 dots
      f = wide ? &run<c10::BFloat16, float, KB_PAGED, true> : &run<c10::BFloat16, float, KB_MIN, true>;
#endif
    f(cs, q.data_ptr<float>(), out.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
      k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), bt, s);
  }
}
