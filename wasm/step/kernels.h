// The WASM SIMD kernels of the page's decode step (wasm/step/step.c), also timed alone by
// benchmarks/wasm_gemv: activations rounded per block of 32 to int8 (an fp32 scale of the block's
// largest magnitude / 127, as llama.cpp's Q8_0 activations), then integer dot products against GGUF
// blocks: Q8_0 rows (gemv_q8) and Q4_1 rows four at a time (gemv_q4x4). Plain SIMD128 only: Node 20's
// baseline compiler computes relaxed_dot wrongly (docs/PERFORMANCE.md, session 26).
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <wasm_simd128.h>

#define EXPORT __attribute__((visibility("default")))

// A bump arena over the module's memory, grown as needed: the benchmarks allocate once.
extern unsigned char __heap_base;
static uintptr_t top = 0;

// 0 when the memory cannot grow that far (wasm32 addresses end at 4 GB: sums are 64-bit, not wrapped)
EXPORT void* arena(uint32_t bytes) {
  if (!top) top = (uintptr_t)&__heap_base;
  const uint64_t at = (top + 63) & ~(uintptr_t)63, end = at + bytes;
  const uint64_t have = (uint64_t)__builtin_wasm_memory_size(0) * 65536;
  if (end > 0xFFFFFFFFull) return 0;
  if (end > have && __builtin_wasm_memory_grow(0, (size_t)((end - have + 65535) / 65536)) == (size_t)-1) return 0;
  top = (uintptr_t)end;
  return (void*)(uintptr_t)at;
}

EXPORT void arena_reset(void) { top = (uintptr_t)&__heap_base; }

static float absmax(const float* x, int n) {
  v128_t m = wasm_f32x4_splat(0.f);
  for (int i = 0; i < n; i += 4) m = wasm_f32x4_max(m, wasm_f32x4_abs(wasm_v128_load(x + i)));
  float a = wasm_f32x4_extract_lane(m, 0), b = wasm_f32x4_extract_lane(m, 1);
  float c = wasm_f32x4_extract_lane(m, 2), d = wasm_f32x4_extract_lane(m, 3);
  a = a > b ? a : b;
  c = c > d ? c : d;
  return a > c ? a : c;
}

// x rounded per block of 32: steps xq [K], scales xs [K/32], sums of steps xsum [K/32] (and per 16,
// xsum16 [K/16], unless null)
EXPORT void quantize_x(const float* x, int K, int8_t* xq, float* xs, float* xsum, float* xsum16) {
  for (int b = 0; b < K / 32; b++) {
    const float m = absmax(x + 32 * b, 32), s = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f;
    xs[b] = s;
    int sum = 0;
    for (int i = 0; i < 32; i += 4) {
      v128_t v = wasm_f32x4_nearest(wasm_f32x4_mul(wasm_v128_load(x + 32 * b + i), wasm_f32x4_splat(inv)));
      v128_t q = wasm_i32x4_trunc_sat_f32x4(v);
      int32_t lanes[4];
      wasm_v128_store(lanes, q);
      for (int l = 0; l < 4; l++) {
        xq[32 * b + i + l] = (int8_t)lanes[l];
        sum += lanes[l];
      }
      if (xsum16 && i == 12) xsum16[2 * b] = (float)sum;
    }
    xsum[b] = (float)sum;
    if (xsum16) xsum16[2 * b + 1] = (float)sum - xsum16[2 * b];
  }
}

static inline int32_t hsum(v128_t v) {
  return wasm_i32x4_extract_lane(v, 0) + wasm_i32x4_extract_lane(v, 1) + wasm_i32x4_extract_lane(v, 2) +
         wasm_i32x4_extract_lane(v, 3);
}

// 16 int8 pairs, i16 products summed in pairs into i32 lanes (SIMD128 i32x4.dot_i16x8_s)
static inline v128_t dot16(v128_t a, v128_t b, v128_t acc) {
  acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_low_i8x16(a), wasm_i16x8_extend_low_i8x16(b)));
  return wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_high_i8x16(a), wasm_i16x8_extend_high_i8x16(b)));
}

EXPORT void gemv_q8(const int8_t* xq, const float* xs, int K, const int8_t* w, const float* ws, int N, float* y) {
  const int blocks = K / 32;
  for (int n = 0; n < N; n++) {
    const int8_t* row = w + (size_t)n * K;
    const float* sc = ws + (size_t)n * blocks;
    v128_t acc = wasm_f32x4_splat(0.f);
    for (int b = 0; b < blocks; b++) {
      v128_t d = wasm_i32x4_splat(0);
      d = dot16(wasm_v128_load(xq + 32 * b), wasm_v128_load(row + 32 * b), d);
      d = dot16(wasm_v128_load(xq + 32 * b + 16), wasm_v128_load(row + 32 * b + 16), d);
      acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(d), wasm_f32x4_splat(xs[b] * sc[b])));
    }
    y[n] = wasm_f32x4_extract_lane(acc, 0) + wasm_f32x4_extract_lane(acc, 1) + wasm_f32x4_extract_lane(acc, 2) +
           wasm_f32x4_extract_lane(acc, 3);
  }
}

// Four output rows per pass (N % 4 == 0): the activations' blocks are widened to i16 once for all four,
// each row's block dot is reduced across lanes with the other three's (one vector of four sums), then
// scaled by a vector of the four rows' block scales. Scales and mins are laid out [N / 4, blocks, 4].
static inline v128_t sum4(v128_t a, v128_t b, v128_t c, v128_t d) {  // lane i = sum of the lanes of the i-th
  const v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 1, 5), wasm_i32x4_shuffle(a, b, 2, 6, 3, 7));
  const v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 1, 5), wasm_i32x4_shuffle(c, d, 2, 6, 3, 7));
  return wasm_i32x4_add(wasm_i32x4_shuffle(ab, cd, 0, 1, 4, 5), wasm_i32x4_shuffle(ab, cd, 2, 3, 6, 7));
}

static inline v128_t nib_dot(v128_t x0l, v128_t x0h, v128_t x1l, v128_t x1h, v128_t packed) {
  const v128_t lo = wasm_v128_and(packed, wasm_i8x16_splat(0x0F)), hi = wasm_u8x16_shr(packed, 4);
  v128_t d = wasm_i32x4_dot_i16x8(x0l, wasm_u16x8_extend_low_u8x16(lo));
  d = wasm_i32x4_add(d, wasm_i32x4_dot_i16x8(x0h, wasm_u16x8_extend_high_u8x16(lo)));
  d = wasm_i32x4_add(d, wasm_i32x4_dot_i16x8(x1l, wasm_u16x8_extend_low_u8x16(hi)));
  return wasm_i32x4_add(d, wasm_i32x4_dot_i16x8(x1h, wasm_u16x8_extend_high_u8x16(hi)));
}

// one block's integer sums d (four rows' lanes) into the rows' accumulator: times the activations' and the
// weights' scales, plus the weights' minimums times the activations' sum (every kernel below, one order)
static inline v128_t accumulate(v128_t acc, v128_t d, float xs, float xsum, const float* sc4, const float* mn4) {
  acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_f32x4_mul(wasm_f32x4_convert_i32x4(d), wasm_f32x4_splat(xs)), wasm_v128_load(sc4)));
  return wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_v128_load(mn4), wasm_f32x4_splat(xs * xsum)));
}

#ifdef __wasm_relaxed_simd__  // -mrelaxed-simd
// the products by i32x4.relaxed_dot_i8x16_i7x16_add_s: 16 an instruction instead of 8 (pmaddubsw on x86).
// Exact here: the nibbles are 7-bit, the deterministic range of the second operand, so the integer sums
// equal the SIMD128 ones. Correct in Chromium 150 from the first call; Node 20's baseline compiler
// (Liftoff) computes it wrongly until the function tiers up (run Node with --no-liftoff).
static inline v128_t nib_dot_relaxed(v128_t x0, v128_t x1, v128_t packed) {
  const v128_t lo = wasm_v128_and(packed, wasm_i8x16_splat(0x0F)), hi = wasm_u8x16_shr(packed, 4);
  return wasm_i32x4_relaxed_dot_i8x16_i7x16_add(x1, hi, wasm_i32x4_relaxed_dot_i8x16_i7x16_add(x0, lo, wasm_i32x4_splat(0)));
}
#endif

// `relaxed` (a constant in each caller): relaxed-dot products, else SIMD128 i16 ones
static inline void q4x4_rows(const int8_t* xq, const float* xs, const float* xsum, int K, const uint8_t* w,
                             const float* ws, const float* wm, int N, float* y, int relaxed) {
  const int blocks = K / 32;
  const size_t stride = (size_t)K / 2;
  for (int n = 0; n < N; n += 4) {
    const uint8_t* r0 = w + (size_t)n * stride;
    const float* sc = ws + (size_t)n * blocks;  // [blocks][4]
    const float* mn = wm + (size_t)n * blocks;
    v128_t acc = wasm_f32x4_splat(0.f);
    for (int b = 0; b < blocks; b++) {
      const v128_t x0 = wasm_v128_load(xq + 32 * b), x1 = wasm_v128_load(xq + 32 * b + 16);
      const uint8_t* at = r0 + 16 * b;
      v128_t d;
#ifdef __wasm_relaxed_simd__
      if (relaxed) {
        d = sum4(nib_dot_relaxed(x0, x1, wasm_v128_load(at)), nib_dot_relaxed(x0, x1, wasm_v128_load(at + stride)),
                 nib_dot_relaxed(x0, x1, wasm_v128_load(at + 2 * stride)), nib_dot_relaxed(x0, x1, wasm_v128_load(at + 3 * stride)));
      } else
#endif
      {
        const v128_t x0l = wasm_i16x8_extend_low_i8x16(x0), x0h = wasm_i16x8_extend_high_i8x16(x0);
        const v128_t x1l = wasm_i16x8_extend_low_i8x16(x1), x1h = wasm_i16x8_extend_high_i8x16(x1);
        d = sum4(nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at)), nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at + stride)),
                 nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at + 2 * stride)),
                 nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at + 3 * stride)));
      }
      acc = accumulate(acc, d, xs[b], xsum[b], sc + 4 * b, mn + 4 * b);
    }
    wasm_v128_store(y + n, acc);
  }
}

EXPORT void gemv_q4x4(const int8_t* xq, const float* xs, const float* xsum, int K, const uint8_t* w, const float* ws,
                      const float* wm, int N, float* y) {
  q4x4_rows(xq, xs, xsum, K, w, ws, wm, N, y, 0);
}

#ifdef __wasm_relaxed_simd__  // -mrelaxed-simd
EXPORT void gemv_q4x4_relaxed(const int8_t* xq, const float* xs, const float* xsum, int K, const uint8_t* w,
                              const float* ws, const float* wm, int N, float* y) {
  q4x4_rows(xq, xs, xsum, K, w, ws, wm, N, y, 1);
}

// T rows of activations (xq [T, K], xs and xsum [T, K / 32]) against the same weights, y [T, N] with rows
// ldy apart (a thread's columns of a wider output): a prompt's tokens two at a time, so each block of four
// weight rows is loaded and unpacked once for both. Every token's sums are gemv_q4x4_relaxed's, operation
// for operation: a token's numbers do not depend on the tokens beside it.
EXPORT void gemm_q4x4_relaxed(const int8_t* xq, const float* xs, const float* xsum, int T, int K, const uint8_t* w,
                              const float* ws, const float* wm, int N, float* y, int ldy) {
  const int blocks = K / 32;
  const size_t stride = (size_t)K / 2;
  const v128_t zero = wasm_i32x4_splat(0), low = wasm_i8x16_splat(0x0F);
  int t = 0;
  for (; t + 2 <= T; t += 2) {
    const int8_t *xa = xq + (size_t)t * K, *xb = xa + K;
    const float *sa = xs + (size_t)t * blocks, *sb = sa + blocks, *ua = xsum + (size_t)t * blocks, *ub = ua + blocks;
    for (int n = 0; n < N; n += 4) {
      const uint8_t* r0 = w + (size_t)n * stride;
      const float* sc = ws + (size_t)n * blocks;
      const float* mn = wm + (size_t)n * blocks;
      v128_t acca = wasm_f32x4_splat(0.f), accb = wasm_f32x4_splat(0.f);
      for (int b = 0; b < blocks; b++) {
        const v128_t a0 = wasm_v128_load(xa + 32 * b), a1 = wasm_v128_load(xa + 32 * b + 16);
        const v128_t b0 = wasm_v128_load(xb + 32 * b), b1 = wasm_v128_load(xb + 32 * b + 16);
        v128_t da[4], db[4];
        for (int r = 0; r < 4; r++) {
          const v128_t packed = wasm_v128_load(r0 + r * stride + 16 * b);
          const v128_t lo = wasm_v128_and(packed, low), hi = wasm_u8x16_shr(packed, 4);
          da[r] = wasm_i32x4_relaxed_dot_i8x16_i7x16_add(a1, hi, wasm_i32x4_relaxed_dot_i8x16_i7x16_add(a0, lo, zero));
          db[r] = wasm_i32x4_relaxed_dot_i8x16_i7x16_add(b1, hi, wasm_i32x4_relaxed_dot_i8x16_i7x16_add(b0, lo, zero));
        }
        acca = accumulate(acca, sum4(da[0], da[1], da[2], da[3]), sa[b], ua[b], sc + 4 * b, mn + 4 * b);
        accb = accumulate(accb, sum4(db[0], db[1], db[2], db[3]), sb[b], ub[b], sc + 4 * b, mn + 4 * b);
      }
      wasm_v128_store(y + (size_t)t * ldy + n, acca);
      wasm_v128_store(y + (size_t)(t + 1) * ldy + n, accb);
    }
  }
  for (; t < T; t++)
    gemv_q4x4_relaxed(xq + (size_t)t * K, xs + (size_t)t * blocks, xsum + (size_t)t * blocks, K, w, ws, wm, N, y + (size_t)t * ldy);
}
#endif  // __wasm_relaxed_simd__
