// The vector width of this build as one type, and e^x, silu and prefetches written once over it, shared
// by the matmul and attention kernels. Why one type: the AVX-512 and AVX2 builds compute the same
// arithmetic, and two hand copies of a polynomial or a quantizer drift apart.
#pragma once

#include "isa.h"

namespace {

// The few fp32 / int32 lane operations the shared code needs, at this build's width (16 lanes on
// AVX-512, 8 on AVX2).
struct Vec {
#if RUVLLM_AVX512
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }  // fp16
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static float reduce_add(F a) { return _mm512_reduce_add_ps(a); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) { return _mm512_scalef_ps(set1(1.f), n); }  // 2^n, n integral
  static float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static bool any_greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
  static I to_int(F a) { return _mm512_cvtps_epi32(a); }  // nearest, ties to even
  static I izero() { return _mm512_setzero_si512(); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static int reduce_iadd(I a) { return _mm512_reduce_add_epi32(a); }
  static void store_i8(int8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a)); }
#else
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }  // fp16
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static float reduce_add(F a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {  // 2^n built in the exponent bits (n in [-126, 127])
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static float reduce_max(F a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static bool any_greater(F a, F b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
  static I to_int(F a) { return _mm256_cvtps_epi32(a); }
  static I izero() { return _mm256_setzero_si256(); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static int reduce_iadd(I a) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1)));
  }
  static void store_i8(int8_t* p, I a) {
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));
  }
#endif
};

// e^x, ~1e-7 relative: 2^(x log2 e) as 2^n * 2^f, |f| <= 0.5; x clamped to [-87.3, 88] so 2^n stays normal
inline Vec::F vexp(Vec::F x) {
  x = Vec::min(Vec::max(x, Vec::set1(-87.3f)), Vec::set1(88.f));
  const Vec::F t = Vec::mul(x, Vec::set1(1.44269504f));
  const Vec::F n = Vec::round(t);
  const Vec::F f = Vec::mul(Vec::sub(t, n), Vec::set1(0.693147181f));  // ln 2^f
  Vec::F p = Vec::set1(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = Vec::fmadd(p, f, Vec::set1(c));
  return Vec::mul(p, Vec::pow2(n));
}

inline Vec::F silu(Vec::F x) { return Vec::div(x, Vec::add(Vec::set1(1.f), vexp(Vec::sub(Vec::zero(), x)))); }

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_row(const float* row, int lines) {  // lines of 16 floats
  for (int d = 0; d < lines; d++) prefetch(row + 16 * d);
}
}  // namespace
