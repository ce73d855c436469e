// Shared helpers of the compiled CPU kernels (skinny_gemm.cpp, attention's paged_decode.cpp
// and paged_prefill.cpp): bf16 widening, a vectorised exp, and the widening of GGUF's
// quantized blocks. Header-only, inline.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedkv {

// Scalar widening (the portable paths and the tails).
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// bf16 is the top half of an fp32: widen and shift, exact.
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) as 2^k * p(r), r in [-ln2/2, ln2/2], degree-6 polynomial (rel. error < 2e-7);
// inputs below -87 give ~0, as in the scalar softmax they replace.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(0.00138888624f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.00833345205f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0416666418f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166666672f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}
#endif  // __AVX512F__

}  // namespace pagedkv
