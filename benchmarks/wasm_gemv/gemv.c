// One-row projections (a decode step's GEMV) in WASM SIMD, to measure what a hand-written kernel
// reaches against onnxruntime-web's fp32 MatMul (issue 33: measure before choosing a route).
//
// x [K] fp32 is rounded per block of 32 to int8 (an fp32 scale of its max / 127, as llama.cpp's Q8_0
// activations), then y[n] = sum over blocks of (x steps . w steps) * x scale * w scale (+ w min * x sum):
//   q8:         w int8 [N, K], an fp32 scale per 32 (GGUF Q8_0), i16 products (SIMD128)
//   q4:         w nibbles [N, K/2] (0..15), an fp32 scale and min per 32 (GGUF Q4_1), i16 products
//   q4_relaxed: the same weights, i32x4.relaxed_dot_i8x16_i7x16_add_s (the nibbles are 7-bit: exact)
// Built with zig cc (PyPI ziglang) for wasm32: see build.py.
#include "../../wasm/step/kernels.h"

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

// Q4_1 blocks of 32: byte i of a block holds weight i (low nibble) and i + 16 (high nibble). `relaxed`
// (a constant in each caller): i32x4.relaxed_dot_i8x16_i7x16_add_s for the products, else i16 products.
static inline void q4_rows(const int8_t* xq, const float* xs, const float* xsum, int K, const uint8_t* w,
                           const float* ws, const float* wm, int N, float* y, int relaxed) {
  const int blocks = K / 32;
  const v128_t low = wasm_i8x16_splat(0x0F);
  for (int n = 0; n < N; n++) {
    const uint8_t* row = w + (size_t)n * K / 2;
    const float* sc = ws + (size_t)n * blocks;
    const float* mn = wm + (size_t)n * blocks;
    v128_t acc = wasm_f32x4_splat(0.f);
    float mins = 0.f;
    for (int b = 0; b < blocks; b++) {
      const v128_t packed = wasm_v128_load(row + 16 * b), x0 = wasm_v128_load(xq + 32 * b);
      const v128_t x1 = wasm_v128_load(xq + 32 * b + 16), lo = wasm_v128_and(packed, low), hi = wasm_u8x16_shr(packed, 4);
      v128_t d = wasm_i32x4_splat(0);
      if (relaxed) {
        d = wasm_i32x4_relaxed_dot_i8x16_i7x16_add(x1, hi, wasm_i32x4_relaxed_dot_i8x16_i7x16_add(x0, lo, d));
      } else {
        d = dot16(x1, hi, dot16(x0, lo, d));
      }
      acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(d), wasm_f32x4_splat(xs[b] * sc[b])));
      mins += mn[b] * xs[b] * xsum[b];
    }
    y[n] = wasm_f32x4_extract_lane(acc, 0) + wasm_f32x4_extract_lane(acc, 1) + wasm_f32x4_extract_lane(acc, 2) +
           wasm_f32x4_extract_lane(acc, 3) + mins;
  }
}

EXPORT void gemv_q4(const int8_t* xq, const float* xs, const float* xsum, int K, const uint8_t* w, const float* ws,
                    const float* wm, int N, float* y) {
  q4_rows(xq, xs, xsum, K, w, ws, wm, N, y, 0);
}

EXPORT void gemv_q4_relaxed(const int8_t* xq, const float* xs, const float* xsum, int K, const uint8_t* w,
                            const float* ws, const float* wm, int N, float* y) {
  q4_rows(xq, xs, xsum, K, w, ws, wm, N, y, 1);
}

// Four Q4_1 output rows per pass (N % 4 == 0), the step's kernel before blocks.h: the activations' blocks
// widened to i16 once for all four, the four rows' block dots reduced into one vector (sum4), scaled by a
// vector of the four rows' block scales; scales and minimums laid out [N / 4, blocks, 4].
static inline v128_t nib_dot(v128_t x0l, v128_t x0h, v128_t x1l, v128_t x1h, v128_t packed) {
  const v128_t lo = wasm_v128_and(packed, wasm_i8x16_splat(0x0F)), hi = wasm_u8x16_shr(packed, 4);
  v128_t d = wasm_i32x4_dot_i16x8(x0l, wasm_u16x8_extend_low_u8x16(lo));
  d = wasm_i32x4_add(d, wasm_i32x4_dot_i16x8(x0h, wasm_u16x8_extend_high_u8x16(lo)));
  d = wasm_i32x4_add(d, wasm_i32x4_dot_i16x8(x1l, wasm_u16x8_extend_low_u8x16(hi)));
  return wasm_i32x4_add(d, wasm_i32x4_dot_i16x8(x1h, wasm_u16x8_extend_high_u8x16(hi)));
}

EXPORT void gemv_q4x4(const int8_t* xq, const float* xs, const float* xsum, int K, const uint8_t* w, const float* ws,
                      const float* wm, int N, float* y) {
  const int blocks = K / 32;
  const size_t stride = (size_t)K / 2;
  for (int n = 0; n < N; n += 4) {
    const uint8_t* r0 = w + (size_t)n * stride;
    const float *sc = ws + (size_t)n * blocks, *mn = wm + (size_t)n * blocks;  // [blocks][4]
    v128_t acc = wasm_f32x4_splat(0.f);
    for (int b = 0; b < blocks; b++) {
      const v128_t x0 = wasm_v128_load(xq + 32 * b), x1 = wasm_v128_load(xq + 32 * b + 16);
      const v128_t x0l = wasm_i16x8_extend_low_i8x16(x0), x0h = wasm_i16x8_extend_high_i8x16(x0);
      const v128_t x1l = wasm_i16x8_extend_low_i8x16(x1), x1h = wasm_i16x8_extend_high_i8x16(x1);
      const uint8_t* at = r0 + 16 * b;
      const v128_t d = sum4(nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at)),
                            nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at + stride)),
                            nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at + 2 * stride)),
                            nib_dot(x0l, x0h, x1l, x1h, wasm_v128_load(at + 3 * stride)));
      acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_f32x4_mul(wasm_f32x4_convert_i32x4(d), wasm_f32x4_splat(xs[b])),
                                               wasm_v128_load(sc + 4 * b)));
      acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_v128_load(mn + 4 * b), wasm_f32x4_splat(xs[b] * xsum[b])));
    }
    wasm_v128_store(y + n, acc);
  }
}
