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

