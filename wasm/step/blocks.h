// A GGUF's block types at their own bits in the page's step (exporter/step_weights.py writes the layout):
// the low nibbles, the bits above them as planes, fp16 scales (widened here, exactly) and the K-quants'
// scale bytes. One kernel shape for every type: four output rows at a time, a block of 32 weights at a
// time, the block's integer sums against the activations rounded per block of 32 (kernels.h), then the
// type's scales. The kinds are runtime/formats/block_types.py's.
#pragma once
#include "kernels.h"

// QMat, `enum kind` and the types' traits (planes_of, zero_of, is_kquant, has_mins, is_q8): abi.h, generated
// from runtime/formats/ (block_types.py's types that the step reads, step_abi.py's structs).
#include "abi.h"

// four fp16 numbers as f32x4, exactly (subnormals too): the magnitude's bits moved into an f32's place,
// times 2^112 to correct the exponent's bias, then the sign
static inline v128_t half4(const uint16_t* p) {
  const v128_t h = wasm_u32x4_load16x4(p);
  const v128_t mag = wasm_i32x4_shl(wasm_v128_and(h, wasm_i32x4_splat(0x7fff)), 13);
  const v128_t sign = wasm_i32x4_shl(wasm_v128_and(h, wasm_i32x4_splat(0x8000)), 16);
  return wasm_v128_or(wasm_f32x4_mul(mag, wasm_f32x4_splat(0x1p112f)), sign);
}

static inline float half1(uint16_t h) {
  union { uint32_t i; float f; } v = {(uint32_t)(h & 0x7fff) << 13};
  const float f = v.f * 0x1p112f;
  return h & 0x8000 ? -f : f;
}

static inline v128_t bytes4_u(const uint8_t* p) {  // four bytes as f32x4
  const v128_t b = wasm_v128_load32_zero(p);
  return wasm_f32x4_convert_i32x4(wasm_u32x4_extend_low_u16x8(wasm_u16x8_extend_low_u8x16(b)));
}

static inline v128_t bytes4_s(const uint8_t* p) {  // four int8 as f32x4
  const v128_t b = wasm_v128_load32_zero(p);
  return wasm_f32x4_convert_i32x4(wasm_i32x4_extend_low_i16x8(wasm_i16x8_extend_low_i8x16(b)));
}

// 0xFF in lane i where bit i (half 0) or 16 + i (half 1) of `bits` is set
static inline v128_t plane(uint32_t bits, int half) {
  const v128_t v = wasm_i32x4_splat((int32_t)bits);
  const v128_t spread = half ? wasm_i8x16_shuffle(v, v, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
                             : wasm_i8x16_shuffle(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const v128_t mask = wasm_u64x2_splat(0x8040201008040201ull);
  return wasm_i8x16_eq(wasm_v128_and(spread, mask), mask);
}

// row `row`'s block b as two vectors of 16 unsigned weights (0 .. 63): weights 0-15 and 16-31
static inline __attribute__((always_inline)) void unpack(int kind, const QMat* W, int row, int K, int b, v128_t* lo, v128_t* hi) {
  const v128_t packed = wasm_v128_load(W->w + (size_t)row * (K / 2) + 16 * b);
  *lo = wasm_v128_and(packed, wasm_i8x16_splat(0x0F));
  *hi = wasm_u8x16_shr(packed, 4);
  const int P = planes_of(kind);
  if (P) {
    const uint32_t* bits = W->hb + ((size_t)row * (K / 32) + b) * P;
    for (int p = 0; p < P; p++) {
      const v128_t bit = wasm_i8x16_splat((int8_t)(0x10 << p));
      *lo = wasm_v128_or(*lo, wasm_v128_and(plane(bits[p], 0), bit));
      *hi = wasm_v128_or(*hi, wasm_v128_and(plane(bits[p], 1), bit));
    }
  }
}

// integer products of 16 activations (int8) and 16 weights: i32x4 partial sums. relaxed_dot_i8x16_i7x16 is
// exact here: the weights are 0 .. 63, the second operand's deterministic range, so its sums equal the
// SIMD128 ones. Correct in Chromium 150 from the first call; Node 20's baseline compiler (Liftoff)
// computes it wrongly until the function tiers up (run Node with --no-liftoff).
static inline __attribute__((always_inline)) v128_t dot_u(v128_t x, v128_t w, int relaxed) {  // w: 0 .. 127
#ifdef __wasm_relaxed_simd__
  if (relaxed) return wasm_i32x4_relaxed_dot_i8x16_i7x16_add(x, w, wasm_i32x4_splat(0));
#endif
  (void)relaxed;
  const v128_t a = wasm_i32x4_dot_i16x8(wasm_i16x8_extend_low_i8x16(x), wasm_u16x8_extend_low_u8x16(w));
  return wasm_i32x4_add(a, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_high_i8x16(x), wasm_u16x8_extend_high_u8x16(w)));
}

static inline v128_t dot_s(v128_t x, v128_t w) {  // w: int8
  const v128_t a = wasm_i32x4_dot_i16x8(wasm_i16x8_extend_low_i8x16(x), wasm_i16x8_extend_low_i8x16(w));
  return wasm_i32x4_add(a, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_high_i8x16(x), wasm_i16x8_extend_high_i8x16(w)));
}

// The activations of TT tokens, rounded (kernels.h's quantize_x): xq [K], xs, xsum [K/32], x16 [K/16]
typedef struct {
  const int8_t* q;
  const float *s, *sum, *sum16;
} Rounded;

#define TILE_TOKENS 16  // a prompt's tokens computed against each block of four rows once it is unpacked

// Rows [lo, hi) (multiples of 4) of W times TT (<= TILE_TOKENS) tokens' rounded activations x[0 .. TT-1],
// into y[t] + n. Each block of four rows is unpacked, and its scales widened, once for all TT tokens.
// Each token's sums are computed by the same operations in the same order whatever TT is: a token's
// numbers do not depend on the tokens beside it.
static inline __attribute__((always_inline)) void qmat_rows(const int kind, const int relaxed, const QMat* W, int lo,
                                                             int hi, int K, const Rounded* x, float* const* y, int TT) {
  const int blocks = K / 32, z = zero_of(kind);
  v128_t acc[TILE_TOKENS];
  for (int n = lo; n < hi; n += 4) {
    const size_t quad = (size_t)n / 4;
    for (int t = 0; t < TT; t++) acc[t] = wasm_f32x4_splat(0.f);
    v128_t D = wasm_f32x4_splat(0.f), M = D;
    for (int b = 0; b < blocks; b++) {
      if (is_kquant(kind) && b % 8 == 0) {  // a new super-block: its d (and dmin) for the four rows
        D = half4(W->d + (quad * (K / 256) + b / 8) * 4);
        if (kind != Q6_K) M = half4(W->m + (quad * (K / 256) + b / 8) * 4);
      }
      v128_t w0[4], w1[4];  // each row's weights 0-15 and 16-31
      for (int r = 0; r < 4; r++) {
        if (is_q8(kind)) {
          const int8_t* w = (const int8_t*)W->w + (size_t)(n + r) * K + 32 * b;
          w0[r] = wasm_v128_load(w), w1[r] = wasm_v128_load(w + 16);
        } else {
          unpack(kind, W, n + r, K, b, &w0[r], &w1[r]);
        }
      }
      const size_t at = (quad * blocks + b) * 4;
      v128_t scale, mins = wasm_f32x4_splat(0.f), d1 = mins;  // the four rows' (Q6_K: each half's scale)
      if (kind == Q6_K) {
        scale = wasm_f32x4_mul(D, bytes4_s(W->sc + 2 * at)), d1 = wasm_f32x4_mul(D, bytes4_s(W->sc + 2 * at + 4));
      } else if (kind == Q4_K || kind == Q5_K) {
        scale = wasm_f32x4_mul(D, bytes4_u(W->sc + at));
        mins = wasm_f32x4_neg(wasm_f32x4_mul(M, bytes4_u(W->mb + at)));
      } else {
        scale = half4(W->d + at);
        if (has_mins(kind)) mins = half4(W->m + at);
      }
      for (int t = 0; t < TT; t++) {
        const v128_t x0 = wasm_v128_load(x[t].q + 32 * b), x1 = wasm_v128_load(x[t].q + 32 * b + 16);
        v128_t s0[4], s1[4];
        for (int r = 0; r < 4; r++) {
          s0[r] = is_q8(kind) ? dot_s(x0, w0[r]) : dot_u(x0, w0[r], relaxed);
          s1[r] = is_q8(kind) ? dot_s(x1, w1[r]) : dot_u(x1, w1[r], relaxed);
        }
        const v128_t xs = wasm_f32x4_splat(x[t].s[b]);
        if (kind == Q6_K) {  // a scale per 16, zero point 32
          const v128_t i0 = wasm_f32x4_convert_i32x4(sum4(s0[0], s0[1], s0[2], s0[3]));
          const v128_t i1 = wasm_f32x4_convert_i32x4(sum4(s1[0], s1[1], s1[2], s1[3]));
          const v128_t c0 = wasm_f32x4_sub(i0, wasm_f32x4_splat(32.f * x[t].sum16[2 * b]));
          const v128_t c1 = wasm_f32x4_sub(i1, wasm_f32x4_splat(32.f * x[t].sum16[2 * b + 1]));
          acc[t] = wasm_f32x4_add(acc[t], wasm_f32x4_mul(wasm_f32x4_mul(c0, xs), scale));
          acc[t] = wasm_f32x4_add(acc[t], wasm_f32x4_mul(wasm_f32x4_mul(c1, xs), d1));
          continue;
        }
        v128_t i = wasm_f32x4_convert_i32x4(sum4(wasm_i32x4_add(s0[0], s1[0]), wasm_i32x4_add(s0[1], s1[1]),
                                                 wasm_i32x4_add(s0[2], s1[2]), wasm_i32x4_add(s0[3], s1[3])));
        if (z) i = wasm_f32x4_sub(i, wasm_f32x4_splat((float)z * x[t].sum[b]));  // exact: integers below 2^24
        acc[t] = wasm_f32x4_add(acc[t], wasm_f32x4_mul(wasm_f32x4_mul(i, xs), scale));
        if (!z && !is_q8(kind)) acc[t] = wasm_f32x4_add(acc[t], wasm_f32x4_mul(mins, wasm_f32x4_splat(x[t].s[b] * x[t].sum[b])));
      }
    }
    for (int t = 0; t < TT; t++) wasm_v128_store(y[t] + n, acc[t]);
  }
}

#define QMAT_KIND(kind, relaxed)                                                                                     \
  static void rows_##kind##_##relaxed(const QMat* W, int lo, int hi, int K, const Rounded* x, float* const* y, int TT) { \
    if (TT == 1) qmat_rows(kind, relaxed, W, lo, hi, K, x, y, 1); /* a decode: its sums in registers */           \
    else qmat_rows(kind, relaxed, W, lo, hi, K, x, y, TT);                                                           \
  }
#define QMAT_KINDS(relaxed) STEP_KINDS(QMAT_KIND, relaxed)

#ifdef PLAIN_SIMD
#define RELAXED 0
#else
#define RELAXED 1
#endif

#if RELAXED
QMAT_KINDS(1)
#define ROWS(kind) rows_##kind##_1
#else
QMAT_KINDS(0)
#define ROWS(kind) rows_##kind##_0
#endif

typedef void (*rows_fn)(const QMat*, int, int, int, const Rounded*, float* const*, int);

static rows_fn rows_of(int kind) {
#define ROWS_CASE(kind, _) case kind: return ROWS(kind);
  switch (kind) {
    STEP_KINDS(ROWS_CASE, 0)
    default: return 0;  // not a kind of the step's: step_weights.py writes none
  }
}

// y [T, ldy] columns [lo, hi) = T rows of rounded activations (x: q [T, K], s and sum [T, K/32], sum16
// [T, K/16]) times W's rows [lo, hi), TILE_TOKENS tokens at a time
static void qmat_gemm(const QMat* W, int lo, int hi, int K, int T, const int8_t* xq, const float* xs, const float* xsum,
                      const float* xsum16, float* y, int ldy) {
  const rows_fn f = rows_of(W->kind);
  for (int t = 0; t < T; t += TILE_TOKENS) {
    const int TT = T - t < TILE_TOKENS ? T - t : TILE_TOKENS;
    Rounded x[TILE_TOKENS];
    float* out[TILE_TOKENS];
    for (int i = 0; i < TT; i++) {
      const size_t u = (size_t)(t + i);
      x[i] = (Rounded){xq + u * K, xs + u * (K / 32), xsum + u * (K / 32), xsum16 + u * (K / 16)};
      out[i] = y + u * ldy;
    }
    f(W, lo, hi, K, x, out, TT);
  }
}

// row n of W in fp32, as gguf dequantizes it (the embedding's lookup)
static void qmat_row(const QMat* W, int n, int K, float* out) {
#pragma clang fp contract(off)  // gguf's products and sums, each rounded: no fused multiply-adds
  const int blocks = K / 32, kind = W->kind, P = planes_of(kind), z = zero_of(kind), lane = n % 4;
  const size_t quad = (size_t)n / 4;
  for (int b = 0; b < blocks; b++) {
    const size_t at = (quad * blocks + b) * 4 + lane, sup = (quad * (K / 256) + b / 8) * 4 + lane;
    for (int i = 0; i < 32; i++) {
      float w;
      if (is_q8(kind)) {
        w = (float)((const int8_t*)W->w)[(size_t)n * K + 32 * b + i] * half1(W->d[at]);
      } else {
        const uint8_t byte = W->w[(size_t)n * (K / 2) + 16 * b + (i & 15)];
        int q = i < 16 ? byte & 15 : byte >> 4;
        for (int p = 0; p < P; p++) q |= ((W->hb[((size_t)n * blocks + b) * P + p] >> i) & 1) << (4 + p);
        if (kind == Q6_K) {
          const float d = half1(W->d[sup]) * (float)(int8_t)W->sc[2 * (at - lane) + 4 * (i / 16) + lane];
          w = d * (float)(q - z);
        } else if (kind == Q4_K || kind == Q5_K) {
          const float d = half1(W->d[sup]) * (float)W->sc[at], m = half1(W->m[sup]) * (float)W->mb[at];
          w = d * (float)q - m;
        } else if (has_mins(kind)) {
          w = half1(W->d[at]) * (float)q + half1(W->m[at]);
        } else {
          w = half1(W->d[at]) * (float)(q - z);
        }
      }
      out[32 * b + i] = w;
    }
  }
}
