// GGUF's Q8_0 and Q4_1 weights in the skinny GEMM's block layout, and their exact widening.
//
// Why: a GGUF model's float32 weights *are* these blocks (the loader dequantizes them as
// d * q (+ m) in float32), so a decode-sized linear can stream the blocks instead of the
// float32 copy, ~3.6x fewer bytes, and compute on bit-identical float32 weights: with an
// fp16 scale d (11 significant bits) and q < 2^8, d * q is exact in float32, so
// fma(d, q, m) rounds once, as numpy's (d * q) + m does.
//
// Layout (engine/quant_layout.py builds it): per block of 16 output columns, per group of
// QK = 32 inputs k, 16 fp16 scales d (one per column), for Q4_1 16 fp16 minimums m, then
// the quants k-major, one byte each (int8 for Q8_0, 0..15 for Q4_1): a k's 16 columns are
// one 16-byte load and two widening instructions. Q4_1 keeps a byte, not a nibble, a
// weight: 1.125 bytes instead of 0.625, but splitting nibbles costs 4 more vector uops per
// 16 weights on the FMA ports, which at 16-24 rows is more than the bytes saved.
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedkv {

constexpr int64_t QK = 32;                          // inputs per quantization group
enum QuantFormat : int64_t { FMT_Q8_0 = 1, FMT_Q4_1 = 2 };

inline int64_t group_bytes(int64_t fmt) { return (fmt == FMT_Q8_0 ? 32 : 64) + QK * 16; }
inline int64_t quant_offset(int64_t fmt) { return fmt == FMT_Q8_0 ? 32 : 64; }

#if defined(__AVX512F__)
// A group's scales (and minimums), widened once per 32 k.
struct GroupScales {
  __m512 d, m;
};

template <int64_t FMT>
inline GroupScales group_scales(const uint8_t* g) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
  const __m512 m = FMT == FMT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32)))
                                   : _mm512_setzero_ps();
  return {d, m};
}

// The 16 columns' float32 weights at one k: d * q (Q8_0) or fma(d, q, m) (Q4_1), exact.
template <int64_t FMT>
inline __m512 widen16(const uint8_t* q, const GroupScales& s) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  if (FMT == FMT_Q8_0) return _mm512_mul_ps(s.d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
  return _mm512_fmadd_ps(s.d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), s.m);
}
#endif

// One block's K x 16 weights, widened to float32 into dst[K][16] (scalar: the same values).
inline void widen_block(const uint8_t* src, int64_t K, int64_t fmt, float* dst) {
  const int64_t gb = group_bytes(fmt), off = quant_offset(fmt);
  for (int64_t g = 0; g < K / QK; ++g, src += gb, dst += QK * 16) {
    const c10::Half* dh = reinterpret_cast<const c10::Half*>(src);
    const c10::Half* mh = reinterpret_cast<const c10::Half*>(src + 32);
    for (int64_t k = 0; k < QK; ++k)
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = src[off + k * 16 + j];
        if (fmt == FMT_Q8_0)
          dst[k * 16 + j] = static_cast<float>(dh[j]) * static_cast<float>(static_cast<int8_t>(byte));
        else  // d * q is exact, so the separate add rounds once, like the fma above
          dst[k * 16 + j] = static_cast<float>(dh[j]) * static_cast<float>(byte) + static_cast<float>(mh[j]);
      }
  }
}

}  // namespace pagedkv
