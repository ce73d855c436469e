// Skinny GEMM on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias, + a fused epilogue) for the
// few rows of a decode step (M <= ~48), with W in float32 or bfloat16.
//
// Why: at decode sizes a linear streams its weights once and does ~2 M flops per weight, so
// it is bound by memory for small M and by FMAs for M ~ 16-48. oneDNN's prepacked kernel
// reaches ~10 GB/s of weights at M = 24 here (30 layers, weights from DRAM); this kernel
// keeps the weights in one sequential stream per thread and every FMA fed from registers.
// With bfloat16 weights it reads half the bytes and computes in float32 (a bf16 -> fp32
// widening is a shift), which is exact for the weights and needs no bf16 instructions.
//
// Layout (pack()): W is cut into blocks of 16 output columns, each stored k-major,
// Wp[nb][k][16]: one 64-byte (fp32) or 32-byte (bf16) load gives the 16 columns' weights
// at k. The microkernel holds MR rows x 2 blocks of accumulators (12 zmm at MR = 6) and
// per k does 2 weight loads, MR broadcasts of x and 2 MR FMAs: no horizontal sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_math.h"
#include "quant_layout.h"

namespace {

using pagedkv::group_bytes;
using pagedkv::QK;
using pagedkv::widen_block;

constexpr int64_t NB = 16;   // output columns per block (one zmm of float32)
constexpr int MR = 8;        // rows per microkernel tile (16 accumulators with 2 blocks)

enum Act : int64_t { ACT_NONE = 0, ACT_SILU = 1 };
enum Bin : int64_t { BIN_NONE = 0, BIN_MUL = 1, BIN_ADD = 2 };

inline float silu_scalar(float v) { return v / (1.f + std::exp(-v)); }

#if defined(__AVX512F__)
using pagedkv::exp512;
using pagedkv::load16;

inline __m512 silu512(__m512 v) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

// The epilogue of one row's 16 columns (mask: those below N): bias, act, then bin with
// other[at] (other is null without bin).
inline void store_row(__m512 v, __m512 bias, __mmask16 mask, int64_t act, const float* other, int64_t at, int64_t bin,
                      float* y) {
  v = _mm512_add_ps(v, bias);
  if (act == ACT_SILU) v = silu512(v);
  if (bin != BIN_NONE) {
    const __m512 o = _mm512_maskz_loadu_ps(mask, other + at);
    v = bin == BIN_MUL ? _mm512_mul_ps(v, o) : _mm512_add_ps(v, o);
  }
  _mm512_mask_storeu_ps(y, mask, v);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= NB ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Ask for the next column pair's weights (into L2) while this pair's tiles compute: each
// tile covers its share of the pair's cache lines, so for M > MR the weight stream and the
// FMAs overlap instead of alternating (a pair's second tile would otherwise run with the
// memory idle, its first with the FMAs waiting).
struct Prefetch {
  const char* base = nullptr;   // the next pair's first byte, or null at the last pair
  int64_t first = 0, count = 0; // this tile's cache lines of it
};

// Tile t of `tiles`' share of `lines` cache lines from `next` (none when lines is 0).
inline Prefetch share(const void* next, int64_t lines, int64_t t, int64_t tiles) {
  if (lines <= 0) return {};
  return {static_cast<const char*>(next), t * lines / tiles, (t + 1) * lines / tiles - t * lines / tiles};
}

// One tile: rows [0, R) of x (R <= MR) against column blocks w0 (and w1 when two), then
// the epilogue, stored into y's columns [n0, n0 + 16 * blocks) masked to N.
template <typename T, int R, int BLOCKS>
inline void tile(const float* x, int64_t ldx, const T* w0, const T* w1, int64_t K, float* y, int64_t ldy,
                 int64_t n0, int64_t N, const float* bias, int64_t act, const float* other, int64_t ldo,
                 int64_t bin, Prefetch pf) {
  __m512 a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  // pf.count lines over K steps without a division per step (an idiv costs more than the FMAs).
  const char* line = pf.base ? pf.base + pf.first * 64 : nullptr;
  int64_t credit = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (line) {
      for (credit += pf.count; credit >= K; credit -= K, line += 64) _mm_prefetch(line, _MM_HINT_T1);
    }
    const __m512 b0 = load16(w0 + k * NB);
    const __m512 b1 = BLOCKS == 2 ? load16(w1 + k * NB) : b0;
    for (int m = 0; m < R; ++m) {
      const __m512 xa = _mm512_set1_ps(x[m * ldx + k]);
      a0[m] = _mm512_fmadd_ps(xa, b0, a0[m]);
      if (BLOCKS == 2) a1[m] = _mm512_fmadd_ps(xa, b1, a1[m]);
    }
  }
  for (int blk = 0; blk < BLOCKS; ++blk) {
    const int64_t n = n0 + blk * NB;
    const int64_t left = N - n;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m)
      store_row(blk == 0 ? a0[m] : a1[m], bv, mask, act, other, m * ldo + n, bin, y + m * ldy + n);
  }
}

template <typename T, int BLOCKS>
inline void rows_tile(int64_t r, const float* x, int64_t ldx, const T* w0, const T* w1, int64_t K, float* y,
                      int64_t ldy, int64_t n0, int64_t N, const float* bias, int64_t act, const float* other,
                      int64_t ldo, int64_t bin, Prefetch pf) {
  switch (r) {
#define PAGEDKV_TILE(RR) \
  case RR: tile<T, RR, BLOCKS>(x, ldx, w0, w1, K, y, ldy, n0, N, bias, act, other, ldo, bin, pf); break;
    PAGEDKV_TILE(1) PAGEDKV_TILE(2) PAGEDKV_TILE(3) PAGEDKV_TILE(4) PAGEDKV_TILE(5) PAGEDKV_TILE(6) PAGEDKV_TILE(7) PAGEDKV_TILE(8)
#undef PAGEDKV_TILE
    default: break;
  }
}
#endif  // __AVX512F__

// The portable path (no AVX-512): same layout and epilogues, loops the compiler vectorises.
template <typename T>
void block_portable(const float* x, int64_t ldx, int64_t M, const T* w, int64_t K, float* y, int64_t ldy,
                    int64_t nb, int64_t N, const float* bias, int64_t act, const float* other, int64_t ldo,
                    int64_t bin) {
  float acc[NB];
  for (int64_t m = 0; m < M; ++m) {
    std::fill(acc, acc + NB, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * ldx + k];
      for (int64_t j = 0; j < NB; ++j) acc[j] += xv * pagedkv::to_float(w[k * NB + j]);
    }
    for (int64_t j = 0; j < NB && nb * NB + j < N; ++j) {
      const int64_t n = nb * NB + j;
      float v = acc[j] + (bias ? bias[n] : 0.f);
      if (act == ACT_SILU) v = silu_scalar(v);
      if (bin == BIN_MUL) v *= other[m * ldo + n];
      if (bin == BIN_ADD) v += other[m * ldo + n];
      y[m * ldy + n] = v;
    }
  }
}

template <typename T>
void run(const float* x, int64_t ldx, int64_t M, const T* wp, int64_t K, int64_t N, float* y, int64_t ldy,
         const float* bias, int64_t act, const float* other, int64_t ldo, int64_t bin) {
  const int64_t blocks = (N + NB - 1) / NB, pairs = (blocks + 1) / 2;
  // Static contiguous split over column pairs: each thread streams one contiguous run of Wp.
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b0 = 2 * p, two = b0 + 1 < blocks;
#if defined(__AVX512F__)
      const T* w0 = wp + b0 * K * NB;
      const T* w1 = two ? w0 + K * NB : w0;
      // The next pair of this thread, as cache lines, shared out over this pair's tiles.
      const int64_t nb_next = std::min<int64_t>(2, blocks - (b0 + 2));
      const int64_t lines = p + 1 < p1 ? nb_next * K * NB * static_cast<int64_t>(sizeof(T)) / 64 : 0;
      const int64_t tiles = (M + MR - 1) / MR;
      for (int64_t m0 = 0, t = 0; m0 < M; m0 += MR, ++t) {
        const int64_t r = std::min<int64_t>(MR, M - m0);
        const float* xo = x + m0 * ldx;
        float* yo = y + m0 * ldy;
        const float* oo = other ? other + m0 * ldo : nullptr;
        const Prefetch pf = share(w0 + 2 * K * NB, lines, t, tiles);
        if (two)
          rows_tile<T, 2>(r, xo, ldx, w0, w1, K, yo, ldy, b0 * NB, N, bias, act, oo, ldo, bin, pf);
        else
          rows_tile<T, 1>(r, xo, ldx, w0, w1, K, yo, ldy, b0 * NB, N, bias, act, oo, ldo, bin, pf);
      }
#else
      block_portable<T>(x, ldx, M, wp + b0 * K * NB, K, y, ldy, b0, N, bias, act, other, ldo, bin);
      if (two) block_portable<T>(x, ldx, M, wp + (b0 + 1) * K * NB, K, y, ldy, b0 + 1, N, bias, act, other, ldo, bin);
#endif
    }
  });
}

// Quantized blocks (quant_layout.h). Widening costs 3 vector uops per 16 weights on the FMA
// ports, so it is done once per weight whatever M: for M <= MR in registers inside the one
// row tile (tile_q), above that into an L1 buffer, KC inputs of a column pair at a time,
// that every row tile then reads (tile_acc). Measured here (30 layers, weights from DRAM):
// 3x the float32 skinny GEMM at 1 row, 2.2x at 8, 1.1-1.2x at 16-48.
constexpr int64_t KC = 64;
constexpr int64_t MR_ACC = 12;   // rows of a lone buffered tile: 24 accumulators

#if defined(__AVX512F__)
// A tile's partial product over one span of k: sums[R][2][16] += x[:, span] @ w[span] for the
// two blocks w0, w1 (each [kc][16]). Storing and reloading a float32 is exact, so the sums
// after the last span are the ones one pass over K gives.
// (Not `tile` with a load/store option: g++ then kept the accumulators on the stack across
// the k loop, which halved the speed.)
template <int R>
inline void tile_acc(const float* x, int64_t ldx, const float* w0, const float* w1, int64_t kc, float* sums) {
  __m512 a0[R], a1[R];
  for (int m = 0; m < R; ++m) {
    a0[m] = _mm512_loadu_ps(sums + m * 2 * NB);
    a1[m] = _mm512_loadu_ps(sums + m * 2 * NB + NB);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(w0 + k * NB), b1 = _mm512_loadu_ps(w1 + k * NB);
    for (int m = 0; m < R; ++m) {
      const __m512 xa = _mm512_set1_ps(x[m * ldx + k]);
      a0[m] = _mm512_fmadd_ps(xa, b0, a0[m]);
      a1[m] = _mm512_fmadd_ps(xa, b1, a1[m]);
    }
  }
  for (int m = 0; m < R; ++m) {
    _mm512_storeu_ps(sums + m * 2 * NB, a0[m]);
    _mm512_storeu_ps(sums + m * 2 * NB + NB, a1[m]);
  }
}

inline void rows_tile_acc(int64_t r, const float* x, int64_t ldx, const float* w0, const float* w1, int64_t kc,
                          float* sums) {
  switch (r) {
#define PAGEDKV_TILE_ACC(RR) \
  case RR: tile_acc<RR>(x, ldx, w0, w1, kc, sums); break;
    PAGEDKV_TILE_ACC(1) PAGEDKV_TILE_ACC(2) PAGEDKV_TILE_ACC(3) PAGEDKV_TILE_ACC(4) PAGEDKV_TILE_ACC(5)
    PAGEDKV_TILE_ACC(6) PAGEDKV_TILE_ACC(7) PAGEDKV_TILE_ACC(8) PAGEDKV_TILE_ACC(9) PAGEDKV_TILE_ACC(10)
    PAGEDKV_TILE_ACC(11) PAGEDKV_TILE_ACC(12)
#undef PAGEDKV_TILE_ACC
    default: break;
  }
}

// The epilogue over finished sums[rows][2][16]: bias, act, bin, stored to y's blocks n0, n0 + 16.
inline void finish_sums(const float* sums, int64_t rows, int64_t blocks, float* y, int64_t ldy, int64_t n0, int64_t N,
                        const float* bias, int64_t act, const float* other, int64_t ldo, int64_t bin) {
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n = n0 + blk * NB, left = N - n;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m)
      store_row(_mm512_loadu_ps(sums + m * 2 * NB + blk * NB), bv, mask, act, other, m * ldo + n, bin,
                y + m * ldy + n);
  }
}

// Inputs [k0, k0 + kc) of one block (k0, kc multiples of 32), widened into dst[kc][16].
template <int64_t FMT>
inline void widen_span(const uint8_t* block, int64_t k0, int64_t kc, float* dst) {
  const int64_t gb = group_bytes(FMT), off = pagedkv::quant_offset(FMT);
  for (int64_t g = k0 / QK; g < (k0 + kc) / QK; ++g, dst += QK * NB) {
    const uint8_t* grp = block + g * gb;
    const pagedkv::GroupScales sc = pagedkv::group_scales<FMT>(grp);
    for (int64_t kk = 0; kk < QK; ++kk) _mm512_storeu_ps(dst + kk * NB, pagedkv::widen16<FMT>(grp + off + kk * NB, sc));
  }
}

// xt: x transposed, xt[k * ldt + m]: a k's R broadcasts come from one pointer at fixed
// offsets (R row pointers would not fit the registers, and their reloads would take the
// load ports the broadcasts need).
template <int64_t FMT, int R, int B>
inline void tile_q(const float* xt, int64_t ldt, const uint8_t* wq, int64_t bb, int64_t K, float* y, int64_t ldy,
                   int64_t n0, int64_t N, const float* bias, int64_t act, const float* other, int64_t ldo,
                   int64_t bin, Prefetch pf) {
  __m512 a[B][R];
  for (int c = 0; c < B; ++c)
    for (int m = 0; m < R; ++m) a[c][m] = _mm512_setzero_ps();
  const int64_t gb = group_bytes(FMT), off = pagedkv::quant_offset(FMT);
  const char* line = pf.base ? pf.base + pf.first * 64 : nullptr;
  int64_t credit = 0;
  for (int64_t g = 0; g < K / QK; ++g) {
    const uint8_t* grp = wq + g * gb;
    pagedkv::GroupScales sc[B];
    for (int c = 0; c < B; ++c) sc[c] = pagedkv::group_scales<FMT>(grp + c * bb);
    const float* xk = xt + g * QK * ldt;
    for (int64_t kk = 0; kk < QK; ++kk, xk += ldt) {
      if (line) {
        for (credit += pf.count; credit >= K; credit -= K, line += 64) _mm_prefetch(line, _MM_HINT_T1);
      }
      __m512 b[B];
      for (int c = 0; c < B; ++c) b[c] = pagedkv::widen16<FMT>(grp + c * bb + off + kk * NB, sc[c]);
      for (int m = 0; m < R; ++m) {
        const __m512 xv = _mm512_set1_ps(xk[m]);
        for (int c = 0; c < B; ++c) a[c][m] = _mm512_fmadd_ps(xv, b[c], a[c][m]);
      }
    }
  }
  for (int c = 0; c < B; ++c) {
    const int64_t n = n0 + c * NB, left = N - n;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) store_row(a[c][m], bv, mask, act, other, m * ldo + n, bin, y + m * ldy + n);
  }
}

template <int64_t FMT, int B>
inline void rows_tile_q(int64_t r, const float* xt, int64_t ldt, const uint8_t* wq, int64_t bb, int64_t K, float* y,
                        int64_t ldy, int64_t n0, int64_t N, const float* bias, int64_t act, const float* other,
                        int64_t ldo, int64_t bin, Prefetch pf) {
  switch (r) {
#define PAGEDKV_TILE_Q(RR) \
  case RR: tile_q<FMT, RR, B>(xt, ldt, wq, bb, K, y, ldy, n0, N, bias, act, other, ldo, bin, pf); break;
    PAGEDKV_TILE_Q(1) PAGEDKV_TILE_Q(2) PAGEDKV_TILE_Q(3) PAGEDKV_TILE_Q(4) PAGEDKV_TILE_Q(5) PAGEDKV_TILE_Q(6)
    PAGEDKV_TILE_Q(7) PAGEDKV_TILE_Q(8)
#undef PAGEDKV_TILE_Q
    default: break;
  }
}
#endif  // __AVX512F__

template <int64_t FMT>
void run_q(const float* x, int64_t ldx, int64_t M, const uint8_t* wq, int64_t K, int64_t N, float* y, int64_t ldy,
           const float* bias, int64_t act, const float* other, int64_t ldo, int64_t bin) {
  const int64_t blocks = (N + NB - 1) / NB, bb = K / QK * group_bytes(FMT), pairs = (blocks + 1) / 2;
#if defined(__AVX512F__)
  if (M > MR) {
    at::parallel_for(0, pairs, 1, [&](int64_t c0, int64_t c1) {
      // 64-byte aligned: a weight load that splits two cache lines costs two.
      std::vector<float> store(2 * KC * NB + 16), sums(M * 2 * NB);
      float* buf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
      // Row tiles as even as M allows, of up to MR rows, or one tile up to MR_ACC rows (12 rows:
      // one tile, not 8 + 4; 24 rows: 8 + 8 + 8, which ran ~5% ahead of 12 + 12 here).
      const int64_t tiles = M <= MR_ACC ? 1 : (M + MR - 1) / MR, per = (M + tiles - 1) / tiles;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b0 = 2 * c, nb = std::min<int64_t>(2, blocks - b0);
        std::fill(sums.begin(), sums.end(), 0.f);
        // The next pair's blocks of this thread, asked for into L2 a share per span, so that
        // the weight stream overlaps the tiles' FMAs (as the unbuffered paths do).
        const int64_t next_lines = c + 1 < c1 ? std::min<int64_t>(2, blocks - b0 - 2) * bb / 64 : 0;
        const char* next = reinterpret_cast<const char*>(wq + (b0 + 2) * bb);
        const int64_t spans = (K + KC - 1) / KC;
        for (int64_t k0 = 0, si = 0; k0 < K; k0 += KC, ++si) {
          const int64_t kc = std::min<int64_t>(KC, K - k0);
          for (int64_t ln = si * next_lines / spans, le = (si + 1) * next_lines / spans; ln < le; ++ln)
            _mm_prefetch(next + ln * 64, _MM_HINT_T1);
          for (int64_t blk = 0; blk < 2; ++blk)   // a lone last block is widened twice, its copy unused
            widen_span<FMT>(wq + std::min<int64_t>(b0 + blk, blocks - 1) * bb, k0, kc, buf + blk * KC * NB);
          for (int64_t m0 = 0; m0 < M; m0 += per)
            rows_tile_acc(std::min<int64_t>(per, M - m0), x + m0 * ldx + k0, ldx, buf, buf + KC * NB, kc,
                          sums.data() + m0 * 2 * NB);
        }
        finish_sums(sums.data(), M, nb, y, ldy, b0 * NB, N, bias, act, other, ldo, bin);
      }
    });
    return;
  }
  std::vector<float> xt(K * M);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = x[m * ldx + k];
  at::parallel_for(0, pairs, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = 2 * c, nb = std::min<int64_t>(2, blocks - b0);
      const uint8_t* w = wq + b0 * bb;
      // the next pair of this thread, over this pair's k steps (one tile)
      const Prefetch pf = share(w + 2 * bb, c + 1 < c1 ? std::min<int64_t>(2, blocks - b0 - 2) * bb / 64 : 0, 0, 1);
      if (nb == 2)
        rows_tile_q<FMT, 2>(M, xt.data(), M, w, bb, K, y, ldy, b0 * NB, N, bias, act, other, ldo, bin, pf);
      else
        rows_tile_q<FMT, 1>(M, xt.data(), M, w, bb, K, y, ldy, b0 * NB, N, bias, act, other, ldo, bin, pf);
    }
  });
#else
  at::parallel_for(0, blocks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> buf(K * NB);
    for (int64_t c = c0; c < c1; ++c) {
      widen_block(wq + c * bb, K, FMT, buf.data());
      block_portable<float>(x, ldx, M, buf.data(), K, y, ldy, c, N, bias, act, other, ldo, bin);
    }
  });
#endif
}


// ---- native bf16 (avx512_bf16): bf16 activations times bf16 weights, float32 accumulate ----------
// vdpbf16ps multiplies 16 pairs of bf16 and adds both products to 16 float32 sums: 32 products a
// uop where an fp32 FMA does 16. Layout (pack_pairs()): per block of 16 output columns, per pair
// of inputs (k, k+1), the 16 columns' two weights side by side, Wd[nb][K/2][16][2]: one 64-byte
// load. A row's inputs k, k+1 are adjacent bf16 in x, so one 32-bit broadcast feeds a pair.
// The products of two bf16 are exact in float32; only the order of the float32 sums differs
// from oneDNN's bf16 kernel. The epilogue runs in float32 and rounds to bf16 once.
#if defined(__AVX512BF16__)
constexpr int MR_BF = 12;

inline __m512 widen_bf16(__mmask16 mask, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

template <int R, int BLOCKS>
inline void tile_bf(const uint16_t* x, int64_t ldx, const uint16_t* w0, const uint16_t* w1, int64_t K2, uint16_t* y,
                    int64_t ldy, int64_t n0, int64_t N, const float* bias, int64_t act, const uint16_t* other,
                    int64_t ldo, int64_t bin, Prefetch pf) {
  __m512 a0[R], a1[R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  const int64_t ldp = ldx / 2;
  const char* line = pf.base ? pf.base + pf.first * 64 : nullptr;
  int64_t credit = 0;
  for (int64_t kp = 0; kp < K2; ++kp) {
    if (line) {
      for (credit += pf.count; credit >= K2; credit -= K2, line += 64) _mm_prefetch(line, _MM_HINT_T1);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + kp * 2 * NB);
    const __m512bh b1 = BLOCKS == 2 ? (__m512bh)_mm512_loadu_si512(w1 + kp * 2 * NB) : b0;
    for (int m = 0; m < R; ++m) {
      const __m512bh xa = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * ldp + kp]));
      a0[m] = _mm512_dpbf16_ps(a0[m], xa, b0);
      if (BLOCKS == 2) a1[m] = _mm512_dpbf16_ps(a1[m], xa, b1);
    }
  }
  for (int blk = 0; blk < BLOCKS; ++blk) {
    const int64_t n = n0 + blk * NB, left = N - n;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) {
      __m512 v = _mm512_add_ps(blk == 0 ? a0[m] : a1[m], bv);
      if (act == ACT_SILU) v = silu512(v);
      if (bin != BIN_NONE) {
        const __m512 o = widen_bf16(mask, other + m * ldo + n);
        v = bin == BIN_MUL ? _mm512_mul_ps(v, o) : _mm512_add_ps(v, o);
      }
      _mm256_mask_storeu_epi16(y + m * ldy + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int BLOCKS>
inline void rows_tile_bf(int64_t r, const uint16_t* x, int64_t ldx, const uint16_t* w0, const uint16_t* w1,
                         int64_t K2, uint16_t* y, int64_t ldy, int64_t n0, int64_t N, const float* bias, int64_t act,
                         const uint16_t* other, int64_t ldo, int64_t bin, Prefetch pf) {
  switch (r) {
#define PAGEDKV_TILE_BF(RR) \
  case RR: tile_bf<RR, BLOCKS>(x, ldx, w0, w1, K2, y, ldy, n0, N, bias, act, other, ldo, bin, pf); break;
    PAGEDKV_TILE_BF(1) PAGEDKV_TILE_BF(2) PAGEDKV_TILE_BF(3) PAGEDKV_TILE_BF(4) PAGEDKV_TILE_BF(5)
    PAGEDKV_TILE_BF(6) PAGEDKV_TILE_BF(7) PAGEDKV_TILE_BF(8) PAGEDKV_TILE_BF(9) PAGEDKV_TILE_BF(10)
    PAGEDKV_TILE_BF(11) PAGEDKV_TILE_BF(12)
#undef PAGEDKV_TILE_BF
    default: break;
  }
}

void run_bf(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wd, int64_t K, int64_t N, uint16_t* y,
            int64_t ldy, const float* bias, int64_t act, const uint16_t* other, int64_t ldo, int64_t bin) {
  const int64_t blocks = (N + NB - 1) / NB, pairs = (blocks + 1) / 2;
  // Row tiles as even as M allows (16 rows: 8 + 8, not 12 + 4).
  const int64_t tiles = (M + MR_BF - 1) / MR_BF, per = (M + tiles - 1) / tiles;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b0 = 2 * p;
      const bool two = b0 + 1 < blocks;
      const uint16_t* w0 = wd + b0 * K * NB;
      const uint16_t* w1 = two ? w0 + K * NB : w0;
      // The next pair of this thread, as cache lines shared out over this pair's tiles (as in run).
      const int64_t nb_next = std::min<int64_t>(2, blocks - (b0 + 2));
      const int64_t lines = p + 1 < p1 ? nb_next * K * NB * 2 / 64 : 0;
      for (int64_t m0 = 0, t = 0; m0 < M; m0 += per, ++t) {
        const int64_t r = std::min<int64_t>(per, M - m0);
        const uint16_t* oo = other ? other + m0 * ldo : nullptr;
        const Prefetch pf = share(w0 + 2 * K * NB, lines, t, tiles);
        if (two)
          rows_tile_bf<2>(r, x + m0 * ldx, ldx, w0, w1, K / 2, y + m0 * ldy, ldy, b0 * NB, N, bias, act, oo, ldo, bin, pf);
        else
          rows_tile_bf<1>(r, x + m0 * ldx, ldx, w0, w1, K / 2, y + m0 * ldy, ldy, b0 * NB, N, bias, act, oo, ldo, bin, pf);
      }
    }
  });
}
#endif  // __AVX512BF16__

}  // namespace

// W [N, K] (float32 or bfloat16) -> Wp [ceil(N / 16), K, 16], zero-padded past N.
torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16),
              "skinny_gemm.pack: W must be [N, K] float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  auto padded = torch::zeros({blocks * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, NB, K}).transpose(1, 2).contiguous();
}

// Wp back to W [N, K] as float32 (the large-M path of bfloat16 weights feeds a float32 GEMM).
torch::Tensor unpack_float(const torch::Tensor& wp, int64_t N) {
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NB, "skinny_gemm.unpack_float: Wp must be [blocks, K, 16]");
  return wp.transpose(1, 2).reshape({-1, wp.size(1)}).narrow(0, 0, N).to(torch::kFloat).contiguous();
}

// The checks both entry points share; returns (bias, other, ldo) pointers.
struct Epilogue {
  const float* bias = nullptr;
  const float* other = nullptr;
  int64_t ldo = 0;
};

Epilogue check_call(const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t act,
                    const c10::optional<torch::Tensor>& other, int64_t bin) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "skinny_gemm: x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(act == ACT_NONE || act == ACT_SILU, "skinny_gemm: act must be 0 (none) or 1 (silu)");
  TORCH_CHECK(bin == BIN_NONE || ((bin == BIN_MUL || bin == BIN_ADD) && other.has_value()),
              "skinny_gemm: bin must be 0, or 1 / 2 with `other`");
  Epilogue e;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "skinny_gemm: bias must be float32 [N]");
    e.bias = bias->data_ptr<float>();
  }
  if (bin != BIN_NONE) {
    TORCH_CHECK(other->scalar_type() == torch::kFloat && other->dim() == 2 && other->size(0) == x.size(0) &&
                    other->size(1) == N && other->stride(1) == 1,
                "skinny_gemm: other must be float32 [M, N] with contiguous rows");
    e.other = other->data_ptr<float>();
    e.ldo = other->stride(0);
  }
  return e;
}

// y = epilogue(x @ W^T + bias): act 0 none / 1 silu; then bin 0 none / 1 (* other) / 2 (+ other).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& wp, int64_t N, const c10::optional<torch::Tensor>& bias,
                   int64_t act, const c10::optional<torch::Tensor>& other, int64_t bin) {
  const Epilogue e = check_call(x, N, bias, act, other, bin);
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NB && wp.is_contiguous() && wp.size(1) == x.size(1) &&
                  wp.size(0) * NB >= N && (wp.size(0) - 1) * NB < N,
              "skinny_gemm: Wp [", wp.size(0), ", ", wp.size(1), ", 16] does not fit x [", x.size(0), ", ",
              x.size(1), "] and N = ", N);
  TORCH_CHECK(wp.scalar_type() == torch::kFloat || wp.scalar_type() == torch::kBFloat16,
              "skinny_gemm: Wp must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (wp.scalar_type() == torch::kFloat)
    run<float>(x.data_ptr<float>(), x.stride(0), M, wp.data_ptr<float>(), K, N, y.data_ptr<float>(), N, e.bias, act,
               e.other, e.ldo, bin);
  else
    run<c10::BFloat16>(x.data_ptr<float>(), x.stride(0), M, wp.data_ptr<c10::BFloat16>(), K, N, y.data_ptr<float>(),
                       N, e.bias, act, e.other, e.ldo, bin);
  return y;
}

void check_quant(const torch::Tensor& wq, int64_t K, int64_t N, int64_t fmt) {
  TORCH_CHECK(fmt == pagedkv::FMT_Q8_0 || fmt == pagedkv::FMT_Q4_1,
              "skinny_gemm: fmt must be 1 (Q8_0) or 2 (Q4_1), not ", fmt);
  TORCH_CHECK(K % QK == 0, "skinny_gemm: quantized weights need K a multiple of 32, not ", K);
  TORCH_CHECK(wq.dim() == 3 && wq.scalar_type() == torch::kByte && wq.is_contiguous() && wq.size(1) == K / QK &&
                  wq.size(2) == group_bytes(fmt) && wq.size(0) * NB >= N && (wq.size(0) - 1) * NB < N,
              "skinny_gemm: quantized Wq must be uint8 [ceil(N/16), K/32, ", group_bytes(fmt), "] for K = ", K,
              ", N = ", N);
}

// The same product with W in GGUF blocks (quant_layout.h), widened exactly per call.
torch::Tensor gemm_q(const torch::Tensor& x, const torch::Tensor& wq, int64_t N, int64_t fmt,
                     const c10::optional<torch::Tensor>& bias, int64_t act, const c10::optional<torch::Tensor>& other,
                     int64_t bin) {
  const Epilogue e = check_call(x, N, bias, act, other, bin);
  const int64_t M = x.size(0), K = x.size(1);
  check_quant(wq, K, N, fmt);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto* f = fmt == pagedkv::FMT_Q8_0 ? &run_q<pagedkv::FMT_Q8_0> : &run_q<pagedkv::FMT_Q4_1>;
  f(x.data_ptr<float>(), x.stride(0), M, wq.data_ptr<uint8_t>(), K, N, y.data_ptr<float>(), N, e.bias, act, e.other,
    e.ldo, bin);
  return y;
}

// Wq back to W [N, K] float32, by the widening gemm_q itself runs (the vector one where it is
// compiled in): the load-time check compares it bit for bit with the loader's float32 weights.
torch::Tensor unpack_q(const torch::Tensor& wq, int64_t K, int64_t N, int64_t fmt) {
  check_quant(wq, K, N, fmt);
  const int64_t blocks = wq.size(0);
  auto wp = torch::empty({blocks, K, NB}, torch::kFloat);
  const int64_t bb = K / QK * group_bytes(fmt);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* src = wq.data_ptr<uint8_t>() + b * bb;
      float* dst = wp.data_ptr<float>() + b * K * NB;
#if defined(__AVX512F__)
      if (fmt == pagedkv::FMT_Q8_0)
        widen_span<pagedkv::FMT_Q8_0>(src, 0, K, dst);
      else
        widen_span<pagedkv::FMT_Q4_1>(src, 0, K, dst);
#else
      widen_block(src, K, fmt, dst);
#endif
    }
  });
  return unpack_float(wp, N);
}

// W [N, K] bfloat16 -> Wd [ceil(N / 16), K / 2, 16, 2] (gemm_bf's layout), zero-padded past N.
torch::Tensor pack_pairs(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0,
              "skinny_gemm.pack_pairs: W must be [N, K] bfloat16 with K even");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  auto padded = torch::zeros({blocks * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, NB, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

bool bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// y = epilogue(x @ W^T + b) in native bf16: x [M, K] and `other` bfloat16, bias float32, y bfloat16.
torch::Tensor gemm_bf(const torch::Tensor& x, const torch::Tensor& wd, int64_t N, const c10::optional<torch::Tensor>& bias,
                      int64_t act, const c10::optional<torch::Tensor>& other, int64_t bin) {
  TORCH_CHECK(bf16_dot(), "skinny_gemm.gemm_bf: built without avx512_bf16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1 && x.stride(0) % 2 == 0,
              "skinny_gemm.gemm_bf: x must be bfloat16 [M, K] with contiguous rows at even strides");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(wd.dim() == 4 && wd.scalar_type() == torch::kBFloat16 && wd.is_contiguous() && wd.size(1) * 2 == K &&
                  wd.size(2) == NB && wd.size(3) == 2 && wd.size(0) * NB >= N && (wd.size(0) - 1) * NB < N,
              "skinny_gemm.gemm_bf: Wd does not fit x [", M, ", ", K, "] and N = ", N);
  TORCH_CHECK(act == ACT_NONE || act == ACT_SILU, "skinny_gemm: act must be 0 (none) or 1 (silu)");
  TORCH_CHECK(bin == BIN_NONE || ((bin == BIN_MUL || bin == BIN_ADD) && other.has_value()),
              "skinny_gemm: bin must be 0, or 1 / 2 with `other`");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "skinny_gemm.gemm_bf: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  const uint16_t* o = nullptr;
  int64_t ldo = 0;
  if (bin != BIN_NONE) {
    TORCH_CHECK(other->scalar_type() == torch::kBFloat16 && other->dim() == 2 && other->size(0) == M &&
                    other->size(1) == N && other->stride(1) == 1,
                "skinny_gemm.gemm_bf: other must be bfloat16 [M, N] with contiguous rows");
    o = reinterpret_cast<const uint16_t*>(other->data_ptr<c10::BFloat16>());
    ldo = other->stride(0);
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(__AVX512BF16__)
  run_bf(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), x.stride(0), M,
         reinterpret_cast<const uint16_t*>(wd.data_ptr<c10::BFloat16>()), K, N,
         reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()), N, b, act, o, ldo, bin);
#endif
  return y;
}

bool vectorised() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W [N, K] -> Wp [ceil(N/16), K, 16] (the skinny GEMM's layout)");
  m.def("unpack_float", &unpack_float, "Wp -> W [N, K] float32");
  m.def("gemm", &gemm, "y = epilogue(x @ W^T + b) for few rows (float32 x, float32 or bfloat16 Wp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q", &gemm_q, "the same with GGUF Q8_0 / Q4_1 blocks (quant_layout.h), widened exactly",
        py::call_guard<py::gil_scoped_release>());
  m.def("unpack_q", &unpack_q, "Wq -> W [N, K] float32, by the kernel's widening");
  m.def("vectorised", &vectorised, "whether the AVX-512 microkernel was compiled in");
  m.def("pack_pairs", &pack_pairs, "W [N, K] bf16 -> Wd [ceil(N/16), K/2, 16, 2] (gemm_bf's layout)");
  m.def("gemm_bf", &gemm_bf, "y = epilogue(x @ W^T + b) in native bf16 (vdpbf16ps, float32 sums)",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot", &bf16_dot, "whether the avx512_bf16 kernel (gemm_bf) was compiled in");
}
