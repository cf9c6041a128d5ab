#pragma once

#include "vec16.h"

// ---- a step's K or V rows into an int8 KV pool (kv_pool.py), and into its fp16 tails ----
//
// kv_pool.quantize_rows in numpy is ten passes over the rows and the tails' fancy-indexed copy another
// two: ~0.35 ms of Python a decode step on SmolLM2, 7% of a one-stream step. This is one pass, with the
// same arithmetic bit for bit: per group of D / groups numbers, scale = fp16(max |x| / 127) (nearest
// even), steps = nearest-even(x / scale) kept in [-127, 127] (a zero scale divides by 1).
//
// present [layers, tokens, heads, D] fp32; pool [layers, heads, pool_slots, D] int8 and scales [layers,
// heads, pool_slots, groups] fp16 bits; token n goes to slot slots[n]. With a tail ([blocks, layers, heads,
// bs, D] fp16 bits), the tokens tail_tokens[0 .. n_tail) are also copied there in fp16 (nearest even, as
// numpy's astype(float16)), at block slot / bs, row slot % bs.
//
// An int4 pool (ruvllm_kv_write_int4, kv_pool.quantize_rows_int4) rotates each row first by the
// orthonormal Hadamard matrix of kv_rotation(D) numbers (H / sqrt(n), block by block), which spreads a
// channel's outlier over the block (QuaRot), then stores each group of 32 or 64 rotated numbers as 4-bit
// steps above their minimum: fp16 (scale, minimum) per group, scale = fp16((max - minimum) / 15), steps =
// nearest-even((y - minimum) / scale) in [0, 15] (minimum and scale held within fp16's range). Each 32
// numbers are 16 bytes: number i in the low nibble of byte i, number 16 + i in its high nibble. Scalar: a
// step's few rows; the reader (paged_attention.h, KVRow) undoes it 16 numbers a vector.

namespace {

// the rotation's block: the largest power of two dividing D (D a multiple of 32: 32 to 256 numbers)
inline int64_t kv_rotation(int64_t D) { return D & -D; }

// 1 / sqrt(n) in float, as numpy's np.float32(1 / np.sqrt(n))
inline float rotation_scale(int64_t n) { return (float)(1.0 / std::sqrt((double)n)); }

// y = H y in place (unnormalized, n a power of two): butterflies of distance 1, 2, 4, ..., n / 2, (a, b) ->
// (a + b, a - b), the order the kernel's vector form and kv_pool._fwht use, so that all three round alike
inline void fwht(float* y, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i++)
      if (!(i & h)) {
        const float a = y[i], b = y[i + h];
        y[i] = a + b;
        y[i + h] = a - b;
      }
}

// y (D numbers) times c H, block by block of kv_rotation(D) numbers: the rotation a row is stored in
inline void rotate_row(float* y, int64_t D) {
  const int64_t n = kv_rotation(D);
  const float c = rotation_scale(n);
  for (int64_t b = 0; b < D; b += n) fwht(y + b, n);
  for (int64_t i = 0; i < D; i++) y[i] *= c;
}

// v (DV vectors, a row of D = 16 DV numbers) times c H, block by block of kv_rotation(D) numbers: fwht's
// butterflies in its order (distance 1, 2, 4, 8 within a vector, 16, 32, ... across vectors), the scale c last
inline void rotate(V16* v, int DV) {
  const int rv = (int)(kv_rotation(16 * DV) / 16);
  for (int d = 0; d < DV; d++) v[d] = butterflies16(v[d]);
  for (int b = 0; b < DV; b += rv)
    for (int h = 1; h < rv; h *= 2)  // distance 16 h: whole vectors
      for (int k = b; k < b + rv; k++)
        if (!((k - b) & h)) {
          const V16 a = v[k], x = v[k + h];
          v[k] = v_add(a, x);
          v[k + h] = v_sub(a, x);
        }
  const V16 c = v_set1(rotation_scale(kv_rotation(16 * DV)));
  for (int d = 0; d < DV; d++) v[d] = v_mul(v[d], c);
}

#if RUVLLM_AVX512
inline void quantize_row_int4(const float* x, int64_t D, int64_t group, uint8_t* packed, uint16_t* sm) {
  const int DV = (int)(D / 16), per = (int)(group / 16);  // chunks of 16 in the row, in a group
  __m512 v[16];
  for (int d = 0; d < DV; d++) v[d] = _mm512_loadu_ps(x + 16 * d);
  rotate(v, DV);
  __m512i q[16];
  const float top = 65504.f;  // fp16's largest: numbers past it are held there, not made infinite
  for (int g = 0; g < DV / per; g++) {
    __m512 lo = v[g * per], hi = v[g * per];
    for (int k = 1; k < per; k++) {
      lo = _mm512_min_ps(lo, v[g * per + k]);
      hi = _mm512_max_ps(hi, v[g * per + k]);
    }
    const uint16_t lo16 = _cvtss_sh(std::min(std::max(_mm512_reduce_min_ps(lo), -top), top), _MM_FROUND_TO_NEAREST_INT);
    const float lof = _cvtsh_ss(lo16);
    const uint16_t s16 = _cvtss_sh(std::min((_mm512_reduce_max_ps(hi) - lof) / 15.f, top), _MM_FROUND_TO_NEAREST_INT);
    const float s = _cvtsh_ss(s16);
    sm[2 * g] = s16;
    sm[2 * g + 1] = lo16;
    const __m512 at = _mm512_set1_ps(lof), by = _mm512_set1_ps(s > 0.f ? s : 1.f);
    for (int k = 0; k < per; k++) {
      const __m512 steps = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(v[g * per + k], at), by),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[g * per + k] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(steps, _mm512_setzero_ps()), _mm512_set1_ps(15.f)));
    }
  }
  for (int k = 0; k < DV / 2; k++)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + 16 * k),
                     _mm512_cvtepi32_epi8(_mm512_or_si512(q[2 * k], _mm512_slli_epi32(q[2 * k + 1], 4))));
}
#else
inline void quantize_row_int4(const float* x, int64_t D, int64_t group, uint8_t* packed, uint16_t* sm) {
  float y[256];
  std::memcpy(y, x, (size_t)D * sizeof(float));
  rotate_row(y, D);
  uint8_t q[256];
  for (int64_t g = 0; g < D / group; g++) {
    const float* yg = y + g * group;
    float lo = yg[0], hi = yg[0];
    for (int64_t i = 1; i < group; i++) {
      lo = std::min(lo, yg[i]);
      hi = std::max(hi, yg[i]);
    }
    const float top = 65504.f;  // fp16's largest: numbers past it are held there, not made infinite
    const uint16_t lo16 = _cvtss_sh(std::min(std::max(lo, -top), top), _MM_FROUND_TO_NEAREST_INT);
    const float lof = _cvtsh_ss(lo16);
    const uint16_t s16 = _cvtss_sh(std::min((hi - lof) / 15.f, top), _MM_FROUND_TO_NEAREST_INT);
    const float s = _cvtsh_ss(s16), by = s > 0.f ? s : 1.f;
    sm[2 * g] = s16;
    sm[2 * g + 1] = lo16;
    for (int64_t i = 0; i < group; i++)
      q[g * group + i] = (uint8_t)std::min(15.f, std::max(0.f, std::nearbyint((yg[i] - lof) / by)));
  }
  for (int64_t k = 0; k < D / 32; k++)
    for (int i = 0; i < 16; i++) packed[16 * k + i] = (uint8_t)(q[32 * k + i] | (q[32 * k + 16 + i] << 4));
}
#endif

// n numbers (a multiple of 8) as fp16 bits, nearest even (numpy's astype(float16), overflow to infinity)
inline void to_fp16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t d = 0; d < n; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
}

// the tokens tail_tokens[0 .. n_tail) of present copied into the fp16 tails (see above); false: a token
// outside the step
inline bool copy_tails(const float* present, int64_t layers, int64_t tokens, int64_t heads, int64_t D,
                       const int64_t* slots, uint16_t* tail, const int64_t* tail_tokens, int64_t n_tail, int64_t bs) {
  for (int64_t i = 0; tail && i < n_tail; i++) {
    const int64_t n = tail_tokens[i];
    if (n < 0 || n >= tokens) return false;
    const int64_t block = slots[n] / bs, at = slots[n] % bs;
    for (int64_t l = 0; l < layers; l++)
      for (int64_t h = 0; h < heads; h++)
        to_fp16(present + ((l * tokens + n) * heads + h) * D, D, tail + (((block * layers + l) * heads + h) * bs + at) * D);
  }
  return true;
}

inline void quantize_row(const float* x, int64_t D, int64_t groups, int8_t* q, uint16_t* scales) {
  const int64_t n = D / groups;  // a multiple of 8: head_dim is one of 16
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(127.f), neg = _mm256_set1_ps(-127.f);
  for (int64_t g = 0; g < groups; g++) {
    const float* xs = x + g * n;
    __m256 m = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + d)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const uint16_t h = _cvtss_sh(_mm_cvtss_f32(m4) / 127.f, _MM_FROUND_TO_NEAREST_INT);
    scales[g] = h;
    const float s = _cvtsh_ss(h);
    const __m256 by = _mm256_set1_ps(s > 0.f ? s : 1.f);
    for (int64_t d = 0; d < n; d += 8) {  // x / scale to nearest even, within [-127, 127]: numpy's arithmetic
      const __m256 steps = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xs + d), by), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(steps, neg), lim));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + g * n + d), _mm_packs_epi16(w, w));
    }
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int ruvllm_kv_write_int8(const float* present, int64_t layers, int64_t tokens,
                                                              int64_t heads, int64_t D, const int64_t* slots,
                                                              int64_t pool_slots, int64_t groups, int8_t* pool,
                                                              uint16_t* scales, uint16_t* tail, const int64_t* tail_tokens,
                                                              int64_t n_tail, int64_t bs) {
  if (D <= 0 || D % 8 || groups <= 0 || D % groups || (D / groups) % 8 || (tail && bs <= 0)) return 1;
  for (int64_t l = 0; l < layers; l++)
    for (int64_t n = 0; n < tokens; n++) {
      const int64_t slot = slots[n];
      if (slot < 0 || slot >= pool_slots) return 1;
      for (int64_t h = 0; h < heads; h++) {
        const float* x = present + ((l * tokens + n) * heads + h) * D;
        const int64_t row = (l * heads + h) * pool_slots + slot;
        quantize_row(x, D, groups, pool + row * D, scales + row * groups);
      }
    }
  return copy_tails(present, layers, tokens, heads, D, slots, tail, tail_tokens, n_tail, bs) ? 0 : 1;
}

// the same for an int4 pool [layers, heads, pool_slots, D / 2] (packed) with (scale, minimum) pairs
// [layers, heads, pool_slots, 2 * D / group] fp16 bits; group: 32 or 64 numbers
__attribute__((visibility("default"))) int ruvllm_kv_write_int4(const float* present, int64_t layers, int64_t tokens,
                                                              int64_t heads, int64_t D, const int64_t* slots,
                                                              int64_t pool_slots, int64_t group, uint8_t* pool,
                                                              uint16_t* sm, uint16_t* tail, const int64_t* tail_tokens,
                                                              int64_t n_tail, int64_t bs) {
  if (D <= 0 || D > 256 || D % 32 || (group != 32 && group != 64) || D % group || (tail && bs <= 0)) return 1;
  for (int64_t l = 0; l < layers; l++)
    for (int64_t n = 0; n < tokens; n++) {
      const int64_t slot = slots[n];
      if (slot < 0 || slot >= pool_slots) return 1;
      for (int64_t h = 0; h < heads; h++) {
        const int64_t row = (l * heads + h) * pool_slots + slot;
        quantize_row_int4(present + ((l * tokens + n) * heads + h) * D, D, group, pool + row * (D / 2),
                          sm + row * 2 * (D / group));
      }
    }
  return copy_tails(present, layers, tokens, heads, D, slots, tail, tail_tokens, n_tail, bs) ? 0 : 1;
}

}  // extern "C"
