// What the page's decode step (wasm/step/step.c) and benchmarks/wasm_gemv share: a bump arena over the
// module's memory, and activations rounded per block of 32 to int8 (an fp32 scale of the block's largest
// magnitude / 127, as llama.cpp's Q8_0 activations) for the integer products of blocks.h.
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

// lane i = the sum of the lanes of the i-th of four vectors: four rows' block dots in one vector
static inline v128_t sum4(v128_t a, v128_t b, v128_t c, v128_t d) {
  const v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 1, 5), wasm_i32x4_shuffle(a, b, 2, 6, 3, 7));
  const v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 1, 5), wasm_i32x4_shuffle(c, d, 2, 6, 3, 7));
  return wasm_i32x4_add(wasm_i32x4_shuffle(ab, cd, 0, 1, 4, 5), wasm_i32x4_shuffle(ab, cd, 2, 3, 6, 7));
}
