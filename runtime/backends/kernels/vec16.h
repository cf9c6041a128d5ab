// Sixteen fp32 lanes as one type on both builds. PagedAttention's arithmetic is defined over 16 lanes (a
// score is the chain over chunks of 16 numbers, then sum16's fixed tree over the lanes; the int4 pool's
// rotation works on 16-number vectors), so a build keeps its numbers only if every lane sees the same
// operations in the same order. On AVX-512 a V16 is one register; on AVX2 it is two 8-lane halves (lanes
// 0-7, 8-15), and every operation here, horizontal ones included, adds and multiplies the same pairs in
// the same order: the AVX2 build's attention gives the AVX-512 build's numbers bit for bit (tested).
#pragma once

#include "simd_math.h"

namespace {

#if RUVLLM_AVX512
using V16 = __m512;

inline V16 v_zero() { return _mm512_setzero_ps(); }
inline V16 v_set1(float x) { return _mm512_set1_ps(x); }
inline V16 v_loadu(const float* p) { return _mm512_loadu_ps(p); }
inline V16 v_load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline void v_storeu(float* p, V16 a) { _mm512_storeu_ps(p, a); }
inline void v_store(float* p, V16 a) { _mm512_store_ps(p, a); }
// the first n <= 16 lanes (the rest zero), and their store
inline V16 v_loadn(const float* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline void v_storen(float* p, V16 a, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a); }
inline V16 v_keep(V16 a, int64_t n) { return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1), a); }  // lanes >= n zero
// lanes < n: max(a, p[i]); the rest a's
inline V16 v_max_loadn(V16 a, const float* p, int64_t n) {
  const __mmask16 k = (__mmask16)((1u << n) - 1);
  return _mm512_mask_max_ps(a, k, a, _mm512_maskz_loadu_ps(k, p));
}
// simd_math.h's Vec is this width: its operations serve V16 as they are (see the lifts below)
#define RUVLLM_V16_UNARY(name, f) \
  inline V16 name(V16 a) { return f(a); }
#define RUVLLM_V16_BINARY(name, f) \
  inline V16 name(V16 a, V16 b) { return f(a, b); }
#define RUVLLM_V16_TERNARY(name, f) \
  inline V16 name(V16 a, V16 b, V16 c) { return f(a, b, c); }
inline float v_first(V16 a) { return _mm512_cvtss_f32(a); }
inline float v_reduce_add(V16 a) { return Vec::reduce_add(a); }
inline float v_reduce_max(V16 a) { return Vec::reduce_max(a); }
inline float v_reduce_max(V16 a, int64_t n) { return _mm512_mask_reduce_max_ps((__mmask16)((1u << n) - 1), a); }  // lanes < n
inline V16 v_load_half(const uint16_t* p) { return Vec::load(p); }
inline V16 v_round_half(V16 a) { return _mm512_cvtph_ps(_mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT)); }
inline V16 v_load_i8(const int8_t* p) {  // 16 int8 numbers as floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// an int4 group's 16 possible numbers, steps 0 .. 15 times its scale plus its minimum (a multiply, then an
// add), from its fp16 (scale, minimum) pair; a chunk's numbers are then one permute of its nibbles
struct Int4Group {
  __m512 table;
  explicit Int4Group(const uint16_t* pair) {
    int32_t both;  // the scale and minimum, converted together
    std::memcpy(&both, pair, sizeof(both));
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
    const __m512 steps = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    table = _mm512_add_ps(_mm512_mul_ps(steps, _mm512_broadcastss_ps(f)), _mm512_broadcastss_ps(_mm_movehdup_ps(f)));
  }
  Int4Group() : table(_mm512_setzero_ps()) {}
  // 16 bytes' low nibbles (numbers 0-15 of their 32) and high nibbles (16-31)
  void numbers(const uint8_t* bytes, V16& low, V16& high) const {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    low = _mm512_permutexvar_ps(w, table);  // reads the index's low 4 bits
    high = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), table);
  }
};

// lane i = the sum of v[i]'s lanes: halves of pairs added level by level (45 operations, no scalar sums)
inline V16 sum16(const V16 v[16]) {
  __m512 b[8], c[4];
  for (int k = 0; k < 8; k++)  // per 128 bits: v2k, v2k+1, v2k, v2k+1 (two lanes each)
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; k++) {  // per 128 bits: v4k .. v4k+3, a quarter of each
    const __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// r[i] = row i of a 16x16 block in, column i out
inline void transpose16(V16 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {  // lane j of r[4i+k]: rows 4i..4i+3 of column 4j+k
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  __m512 out[16];
  for (int k = 0; k < 4; k++) {
    const __m512 ab_lo = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), ab_hi = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    const __m512 cd_lo = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88), cd_hi = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    out[k] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    out[8 + k] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    out[4 + k] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    out[12 + k] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; i++) r[i] = out[i];
}

// fwht's butterflies of distance 1, 2, 4, 8 on one vector (kv_write.h): lanes i and i ^ h, (a, b) -> (a + b, a - b)
inline V16 butterflies16(V16 v) {
  __m512 p = _mm512_permute_ps(v, 0xB1);  // distance 1: lanes i ^ 1
  v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xAAAA, p, v);
  p = _mm512_permute_ps(v, 0x4E);  // distance 2
  v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xCCCC, p, v);
  p = _mm512_shuffle_f32x4(v, v, 0xB1);  // distance 4: 128-bit lanes swapped in pairs
  v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xF0F0, p, v);
  p = _mm512_shuffle_f32x4(v, v, 0x4E);  // distance 8
  return _mm512_mask_sub_ps(_mm512_add_ps(v, p), 0xFF00, p, v);
}
#else
struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v_loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v_load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void v_storeu(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void v_store(float* p, V16 a) {
  _mm256_store_ps(p, a.lo);
  _mm256_store_ps(p + 8, a.hi);
}
inline V16 v_loadn(const float* p, int64_t n) {  // the first n <= 16 lanes (the rest zero), and their store
  if (n >= 16) return v_loadu(p);
  alignas(32) float x[16] = {};
  std::memcpy(x, p, (size_t)n * sizeof(float));
  return v_load(x);
}
inline void v_storen(float* p, V16 a, int64_t n) {
  if (n >= 16) return v_storeu(p, a);
  alignas(32) float x[16];
  v_store(x, a);
  std::memcpy(p, x, (size_t)n * sizeof(float));
}
inline __m256 lanes_below(int64_t n, int first) {  // all ones in lanes first + i < n
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(first, first + 1, first + 2,
                                                first + 3, first + 4, first + 5, first + 6, first + 7)));
}
inline V16 v_keep(V16 a, int64_t n) { return {_mm256_and_ps(a.lo, lanes_below(n, 0)), _mm256_and_ps(a.hi, lanes_below(n, 8))}; }
inline V16 v_max_loadn(V16 a, const float* p, int64_t n) {  // lanes < n: max(a, p[i]); the rest a's
  const V16 x = v_loadn(p, n);
  return {_mm256_blendv_ps(a.lo, _mm256_max_ps(a.lo, x.lo), lanes_below(n, 0)),
          _mm256_blendv_ps(a.hi, _mm256_max_ps(a.hi, x.hi), lanes_below(n, 8))};
}
// simd_math.h's Vec is 8 lanes here: its operations serve V16 on each half (see the lifts below)
#define RUVLLM_V16_UNARY(name, f) \
  inline V16 name(V16 a) { return {f(a.lo), f(a.hi)}; }
#define RUVLLM_V16_BINARY(name, f) \
  inline V16 name(V16 a, V16 b) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
#define RUVLLM_V16_TERNARY(name, f) \
  inline V16 name(V16 a, V16 b, V16 c) { return {f(a.lo, b.lo, c.lo), f(a.hi, b.hi, c.hi)}; }
inline float v_first(V16 a) { return _mm256_cvtss_f32(a.lo); }
// in the order of GCC's _mm512_reduce_add_ps: the halves, their 128-bit halves, then (0 + 2) + (1 + 3)
inline float v_reduce_add(V16 a) { return Vec::reduce_add(_mm256_add_ps(a.hi, a.lo)); }
inline float v_reduce_max(V16 a) { return Vec::reduce_max(_mm256_max_ps(a.lo, a.hi)); }
inline float v_reduce_max(V16 a, int64_t n) {  // lanes < n
  alignas(32) float x[16];
  v_store(x, a);
  float m = x[0];
  for (int64_t i = 1; i < n; i++) m = std::max(m, x[i]);
  return m;
}
inline V16 v_load_half(const uint16_t* p) { return {Vec::load(p), Vec::load(p + 8)}; }
inline __m256 round_half8(__m256 a) { return _mm256_cvtph_ps(_mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT)); }
inline V16 v_round_half(V16 a) { return {round_half8(a.lo), round_half8(a.hi)}; }
inline V16 v_load_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}

// an int4 group: each nibble's step times its scale plus its minimum (a multiply, then an add: the
// numbers of the AVX-512 build's table)
struct Int4Group {
  __m256 scale, minimum;
  explicit Int4Group(const uint16_t* pair) {
    scale = _mm256_set1_ps(_cvtsh_ss(pair[0]));
    minimum = _mm256_set1_ps(_cvtsh_ss(pair[1]));
  }
  Int4Group() : scale(_mm256_setzero_ps()), minimum(_mm256_setzero_ps()) {}
  __m256 of(__m256i steps) const { return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(steps), scale), minimum); }
  // 16 bytes' low nibbles (numbers 0-15 of their 32) and high nibbles (16-31)
  void numbers(const uint8_t* bytes, V16& low, V16& high) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m256i w0 = _mm256_cvtepu8_epi32(b), w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i m = _mm256_set1_epi32(15);
    low = {of(_mm256_and_si256(w0, m)), of(_mm256_and_si256(w1, m))};
    high = {of(_mm256_srli_epi32(w0, 4)), of(_mm256_srli_epi32(w1, 4))};
  }
};

// [x.L0 + x.L1, x.L2 + x.L3, y.L0 + y.L1, y.L2 + y.L3] over 128-bit lanes L: the AVX-512 build's
// shuffle_f32x4(x, y, 0x88) + shuffle_f32x4(x, y, 0xDD)
inline V16 pair_sums(V16 x, V16 y) {
  return {_mm256_add_ps(_mm256_permute2f128_ps(x.lo, x.hi, 0x20), _mm256_permute2f128_ps(x.lo, x.hi, 0x31)),
          _mm256_add_ps(_mm256_permute2f128_ps(y.lo, y.hi, 0x20), _mm256_permute2f128_ps(y.lo, y.hi, 0x31))};
}

// lane i = the sum of v[i]'s lanes, in the AVX-512 build's tree: each 128-bit lane's pairs, then its quarters
inline V16 sum16(const V16 v[16]) {
  V16 b[8], c[4];
  for (int k = 0; k < 8; k++)
    b[k] = {_mm256_add_ps(_mm256_unpacklo_ps(v[2 * k].lo, v[2 * k + 1].lo), _mm256_unpackhi_ps(v[2 * k].lo, v[2 * k + 1].lo)),
            _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k].hi, v[2 * k + 1].hi), _mm256_unpackhi_ps(v[2 * k].hi, v[2 * k + 1].hi))};
  auto quarter = [](__m256 x, __m256 y) {
    const __m256d a = _mm256_castps_pd(x), b = _mm256_castps_pd(y);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  };
  for (int k = 0; k < 4; k++) c[k] = {quarter(b[2 * k].lo, b[2 * k + 1].lo), quarter(b[2 * k].hi, b[2 * k + 1].hi)};
  return pair_sums(pair_sums(c[0], c[1]), pair_sums(c[2], c[3]));
}

// an 8x8 block transposed in registers
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// r[i] = row i of a 16x16 block in, column i out
inline void transpose16(V16 r[16]) {
  __m256 q[4][8];  // the quarters: rows 0-7 / 8-15 by columns 0-7 / 8-15
  for (int i = 0; i < 8; i++) {
    q[0][i] = r[i].lo;
    q[1][i] = r[i].hi;
    q[2][i] = r[8 + i].lo;
    q[3][i] = r[8 + i].hi;
  }
  for (auto& block : q) transpose8(block);
  for (int i = 0; i < 8; i++) {
    r[i] = {q[0][i], q[2][i]};
    r[8 + i] = {q[1][i], q[3][i]};
  }
}

// fwht's butterflies of distance 1, 2, 4, 8 on one vector (kv_write.h): lanes i and i ^ h, (a, b) -> (a + b, a - b)
inline __m256 butterflies8(__m256 v) {
  __m256 p = _mm256_permute_ps(v, 0xB1);  // distance 1
  v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xAA);
  p = _mm256_permute_ps(v, 0x4E);  // distance 2
  v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xCC);
  p = _mm256_permute2f128_ps(v, v, 0x01);  // distance 4
  return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xF0);
}
inline V16 butterflies16(V16 v) {
  const __m256 a = butterflies8(v.lo), b = butterflies8(v.hi);
  return {_mm256_add_ps(a, b), _mm256_sub_ps(a, b)};  // distance 8
}
#endif

// The elementwise operations, simd_math.h's Vec lifted to 16 lanes
RUVLLM_V16_BINARY(v_add, Vec::add)
RUVLLM_V16_BINARY(v_sub, Vec::sub)
RUVLLM_V16_BINARY(v_mul, Vec::mul)
RUVLLM_V16_BINARY(v_div, Vec::div)
RUVLLM_V16_BINARY(v_max, Vec::max)
RUVLLM_V16_BINARY(v_min, Vec::min)
RUVLLM_V16_TERNARY(v_fmadd, Vec::fmadd)
RUVLLM_V16_UNARY(v_abs, Vec::abs)
RUVLLM_V16_UNARY(v_round, Vec::round)
RUVLLM_V16_UNARY(v_exp, vexp)
#undef RUVLLM_V16_UNARY
#undef RUVLLM_V16_BINARY
#undef RUVLLM_V16_TERNARY

}  // namespace
