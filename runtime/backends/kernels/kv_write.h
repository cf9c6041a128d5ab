#pragma once

#include "isa.h"

// ---- a step's K or V rows into an int8 KV pool (kv_pool.py), and into its fp32 tails ----
//
// kv_pool.quantize_rows in numpy is ten passes over the rows and the tails' fancy-indexed copy another
// two: ~0.35 ms of Python a decode step on SmolLM2, 7% of a one-stream step. This is one pass, with the
// same arithmetic bit for bit: per group of D / groups numbers, scale = fp16(max |x| / 127) (nearest
// even), steps = nearest-even(x / scale) kept in [-127, 127] (a zero scale divides by 1).
//
// present [layers, tokens, heads, D] fp32; pool [layers, heads, pool_slots, D] int8 and scales [layers,
// heads, pool_slots, groups] fp16 bits; token n goes to slot slots[n]. With a tail ([blocks, layers, heads,
// bs, D] fp32), the tokens tail_tokens[0 .. n_tail) are also copied there exact, at block slot / bs, row
// slot % bs.

namespace {

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
                                                              uint16_t* scales, float* tail, const int64_t* tail_tokens,
                                                              int64_t n_tail, int64_t bs) {
  if (D <= 0 || groups <= 0 || D % groups || (D / groups) % 8 || (tail && bs <= 0)) return 1;
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
  for (int64_t i = 0; tail && i < n_tail; i++) {
    const int64_t n = tail_tokens[i];
    if (n < 0 || n >= tokens) return 1;
    const int64_t block = slots[n] / bs, at = slots[n] % bs;
    for (int64_t l = 0; l < layers; l++)
      for (int64_t h = 0; h < heads; h++)
        std::memcpy(tail + (((block * layers + l) * heads + h) * bs + at) * D,
                    present + ((l * tokens + n) * heads + h) * D, (size_t)D * sizeof(float));
  }
  return 0;
}

}  // extern "C"
