// Vector arithmetic our CPU kernels share (span_attention.cpp,
// decode_attention.cpp, linear_kernel.cpp). Header-only; build.py
// rebuilds a kernel when a header it includes changes.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

namespace {

constexpr float kLog2E = 1.44269504089f;

// float32 -> bfloat16 bits, to nearest even (NaN stays a quiet NaN).
inline uint16_t bf16_bits(float x) {
  if (x != x) return 0x7fc0;
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

#ifdef __AVX512F__
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// 2^f for f in [-1/2, 1/2], either width (V: __m512 or __m256, GCC vectors of
// float): a degree-5 polynomial, relative error under 1e-7, fitted to 2^f.
template <typename V>
inline V exp2_fraction(V f) {
  V p = 1.3266980e-3f + V{};
  for (float c : {9.6754692e-3f, 5.5507425e-2f, 2.4022122e-1f, 6.9314694e-1f, 1.0000001f})
    p = fmadd(p, f, c + V{});
  return p;
}

#ifdef __AVX512F__

// 2^t for t <= 0 (callers fold log2(e) into their scale: exp(x) = 2^(x log2 e)):
// 2^(t - n) for the nearest integer n (exp2_fraction), then times 2^n; t
// below -126 gives about 0, NaN gives NaN: max_ps returns its second operand
// when either is NaN, so the clamp keeps a NaN score (a NaN key or query then
// makes the output NaN, as in torch's softmax). Nine instructions where
// Cephes' expf took fourteen.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(_mm512_set1_ps(-126.0f), t);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_fraction(_mm512_sub_ps(t, n)), n);
}

// x * sigmoid(z) = x / (1 + e^-z), as x e / (1 + e) with e = e^z for z < 0
// (e^-|z| never overflows). Tried: a reciprocal estimate and a Newton step
// instead of the division; no faster (benchmarks/README.md).
inline __m512 times_sigmoid(__m512 x, __m512 z) {
  const __m512 e = exp2_nonpositive(_mm512_mul_ps(_mm512_abs_ps(z), _mm512_set1_ps(-kLog2E)));
  const __mmask16 negative = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_div_ps(_mm512_mask_mul_ps(x, negative, x, e),
                       _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// bfloat16 pairs in 32-bit lanes, widened to float32: each lane's low half
// (the pair's first element, shifted up) or its high half (masked).
inline __m512 bf16_low_halves(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 bf16_high_halves(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// float32 -> bfloat16 bits in each lane's low half, to nearest even (NaN
// stays NaN); _mm512_cvtepi32_epi16 packs them to 16 values.
inline __m512i bf16_nearest(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7fc0));
}

// The first n lanes of 16 (all for n >= 16; callers pass n > 0): a row's
// tail of columns, tokens or head dimensions.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
}

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// The same on 8 lanes, for CPUs with AVX2 alone (linear_kernel.cpp): 2^n
// from its exponent bits, as AVX2 has no scalef.
inline __m256 exp2_nonpositive(__m256 t) {
  t = _mm256_max_ps(_mm256_set1_ps(-126.0f), t);  // NaN stays NaN (as above)
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i two_to_n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp2_fraction(_mm256_sub_ps(t, n)), _mm256_castsi256_ps(two_to_n));
}

inline __m256 times_sigmoid(__m256 x, __m256 z) {
  const __m256 minus_abs_z = _mm256_or_ps(z, _mm256_set1_ps(-0.0f));
  const __m256 e = exp2_nonpositive(_mm256_mul_ps(minus_abs_z, _mm256_set1_ps(kLog2E)));
  const __m256 negative = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_div_ps(_mm256_blendv_ps(x, _mm256_mul_ps(x, e), negative),
                       _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// The first n lanes of 8 (all for n >= 8; callers pass n > 0), as a
// maskload's or maskstore's mask.
inline __m256i first_lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif  // AVX2

// Over either width (GCC vectors: * is the lanes', as _mm*_mul_ps is):
// x * sigmoid(x).
template <typename V>
inline V silu(V x) { return times_sigmoid(x, x); }

// GELU with tanh's approximation: 0.5 x (1 + tanh(u)) = x sigmoid(2u),
// u = sqrt(2 / pi) (x + 0.044715 x^3). (torch's float32 form loses the far
// negative tail to cancellation in 1 + tanh(u); this one does not.)
template <typename V>
inline V gelu_tanh(V x) {
  const V two_u = ((2 * 0.7978845608f) + V{}) * x * fmadd(0.044715f + V{}, x * x, 1.0f + V{});
  return times_sigmoid(x, two_u);
}

}  // namespace
