// The page's quantized KV pools (kvDtype 'int8' and 'int4'), as the native engine keeps them
// (runtime/backends/kv_pool.py): rows are written quantized bit for bit as quantize_rows / quantize_rows_int4
// round them, and a two-tier pool's rows of the blocks its sequences still write are kept exact too, in tail
// slots (runtime/core/kv_tails.py says which tokens and which slot a block's rows take). A query reads its own
// block and the tail_blocks - 1 before it exact, from its row's floor on (ruvllm.PagedAttention's rule, its
// own_block), every earlier row as stored.
//
// int8: each group of 32 (or the whole row, where 32 does not divide it) is its steps of absmax / 127, the
// scale in fp16. int4: the row times the orthonormal Hadamard matrix of its largest power-of-two block, then
// per group (keys 32, values 64 where it divides the row) 4-bit steps above an fp16 minimum, (scale, minimum)
// pairs in fp16; number i of each 32 in byte i's low nibble, 16 + i in its high one. Stored int4 keys meet the
// query rotated the same way, and stored values are summed rotated and rotated back once.
#pragma once
#include "blocks.h"

// KV_FP32, KV_INT8, KV_INT4: abi.h

// float32 -> IEEE fp16 bits, rounded to nearest even, subnormals and overflow to infinity included (numpy's
// astype(float16))
static uint16_t to_half(float v) {
  union { float f; uint32_t u; } b = {v};
  const uint32_t x = b.u, sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (e == 0xffu) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int exp = (int)e - 127 + 15;
  if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00u);
  if (exp <= 0) {  // a subnormal half, or zero
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000u;
    const int shift = 14 - exp;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t half = ((uint32_t)exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;  // a carry into the exponent is right
  return (uint16_t)(sign | half);
}

static inline int kv_group8(int d) { return d % 32 ? d : 32; }
static inline int kv_group4(int d, int kind) { return kind && d % 64 == 0 ? 64 : 32; }  // kind 0 keys, 1 values
// fp16 numbers a row's scales take (kv_blocks.kv_scale_widths)
static inline int kv_width(int dtype, int d, int kind) {
  return dtype == KV_INT8 ? d / kv_group8(d) : dtype == KV_INT4 ? 2 * d / kv_group4(d, kind) : 0;
}
static inline int kv_row_bytes(int dtype, int d) { return dtype == KV_INT8 ? d : dtype == KV_INT4 ? d / 2 : 4 * d; }

// y times the orthonormal Hadamard matrix of each block of d & -d numbers: butterflies of distance 1, 2, 4,
// ..., then 1 / sqrt(n), in kv_pool._fwht's order (its own inverse)
static void fwht(float* y, int d) {
#pragma STDC FP_CONTRACT OFF
  const int n = d & -d;
  const float c = (float)(1.0 / __builtin_sqrt((double)n));
  for (int b = 0; b < d; b += n)
    for (int h = 1; h < n; h *= 2)
      for (int i = b; i < b + n; i += 2 * h)
        for (int j = i; j < i + h; j++) {
          const float a = y[j], e = y[j + h];
          y[j] = a + e;
          y[j + h] = a - e;
        }
  for (int i = 0; i < d; i++) y[i] *= c;
}

static inline float rint_clamp(float v, float lo, float hi) {
  const float r = __builtin_rintf(v);
  return r < lo ? lo : r > hi ? hi : r;
}

// one row of d numbers as kv_pool.quantize_rows writes it
static void quantize8(const float* x, int d, int8_t* q, uint16_t* s) {
#pragma STDC FP_CONTRACT OFF
  const int g = kv_group8(d);
  for (int k = 0; k < d / g; k++) {
    float top = 0.f;
    for (int i = 0; i < g; i++) {
      const float a = __builtin_fabsf(x[k * g + i]);
      top = a > top ? a : top;
    }
    s[k] = to_half(top / 127.f);
    float sc = half1(s[k]);
    if (!(sc > 0.f)) sc = 1.f;
    for (int i = 0; i < g; i++) q[k * g + i] = (int8_t)rint_clamp(x[k * g + i] / sc, -127.f, 127.f);
  }
}

// one row of d numbers as kv_pool.quantize_rows_int4 writes it, groups of g; y: room for d numbers
static void quantize4(const float* x, int d, int g, uint8_t* packed, uint16_t* pairs, float* y) {
#pragma STDC FP_CONTRACT OFF
  for (int i = 0; i < d; i++) y[i] = x[i];
  fwht(y, d);
  uint8_t q[32];
  for (int k = 0; k < d / g; k++) {
    const float* yg = y + k * g;
    float mn = yg[0], mx = yg[0];
    for (int i = 1; i < g; i++) mn = yg[i] < mn ? yg[i] : mn, mx = yg[i] > mx ? yg[i] : mx;
    const uint16_t lo = to_half(mn < -65504.f ? -65504.f : mn > 65504.f ? 65504.f : mn);
    const float lof = half1(lo), step = (mx - lof) / 15.f;
    const uint16_t sbits = to_half(step < 65504.f ? step : 65504.f);
    float sc = half1(sbits);
    if (!(sc > 0.f)) sc = 1.f;
    pairs[2 * k] = sbits, pairs[2 * k + 1] = lo;
    for (int c = 0; c < g; c += 32) {
      for (int i = 0; i < 32; i++) q[i] = (uint8_t)rint_clamp((yg[c + i] - lof) / sc, 0.f, 15.f);
      uint8_t* out = packed + (k * g + c) / 2;
      for (int i = 0; i < 16; i++) out[i] = (uint8_t)(q[i] | (q[16 + i] << 4));
    }
  }
}

static inline float lanes_sum(v128_t v) {
  return wasm_f32x4_extract_lane(v, 0) + wasm_f32x4_extract_lane(v, 1) + wasm_f32x4_extract_lane(v, 2) +
         wasm_f32x4_extract_lane(v, 3);
}

// The readers take the G query heads that share a kv head at once (qs, and accs: G rows hd apart), so a stored
// row is widened once for all of them; each head's arithmetic is the same for any G. KV_HEADS_AT_ONCE heads a
// pass keep their accumulators in registers.
#define KV_HEADS_AT_ONCE 8
#define KV_SEGMENT 128  // positions a quantized attention segment holds (step.c)
// step.c's quantized attention's scratch in floats, for G heads of hd and segments of KV_SEGMENT positions:
// the rounded queries (int16), their steps and sums per 32 and a row to rotate (KV_QUERY_WORK); a segment's
// scores, rotated value sums and a row's scores (KV_SEG_WORK); a running fold and a segment's partial
#define KV_QUERY_WORK(G, hd) ((G) * (hd) / 2 + (G) + (G) * (hd) / 32 + (hd) + 4)
#define KV_SEG_WORK(G, hd) ((G) * KV_SEGMENT + (G) * (hd) + (G) + 4)
#define KV_WORK(G, hd) (KV_QUERY_WORK(G, hd) + KV_SEG_WORK(G, hd) + 2 * ((G) * (hd) + 2 * (G)) + 4)
// and, per position of a context, its stored value row's address, scales' address, scales and minimums
#define KV_ROWS(d) (2 + 2 * ((d) < 32 ? 1 : (d) / 32))

// A query as ruvllm.PagedAttention's round_query rounds it for stored keys: steps of its largest magnitude /
// 32767 (out), the step returned. The score is then an integer sum per group (exact) times the scales.
static float round_query16(const float* q, int d, int16_t* out) {
#pragma STDC FP_CONTRACT OFF
  float m = 0.f;
  for (int i = 0; i < d; i++) {
    const float a = __builtin_fabsf(q[i]);
    m = a > m ? a : m;
  }
  const float s = m / 32767.f;
  for (int i = 0; i < d; i++) out[i] = s > 0.f ? (int16_t)rint_clamp(q[i] / s, -32767.f, 32767.f) : 0;
  return s;
}

static inline int32_t lanes_isum(v128_t v) {
  return wasm_i32x4_extract_lane(v, 0) + wasm_i32x4_extract_lane(v, 1) + wasm_i32x4_extract_lane(v, 2) +
         wasm_i32x4_extract_lane(v, 3);
}

// scores[h] = the stored int8 row . query h rounded (qs: G rows of d steps, steps: each one's step)
static void dot8(const int16_t* qs, const float* steps, int G, const int8_t* k, const uint16_t* s, int d, float* scores) {
  const int g = kv_group8(d);
  for (int h0 = 0; h0 < G; h0 += KV_HEADS_AT_ONCE) {
    const int n = G - h0 < KV_HEADS_AT_ONCE ? G - h0 : KV_HEADS_AT_ONCE;
    float total[KV_HEADS_AT_ONCE] = {0};
    for (int c = 0; c < d; c += g) {
      v128_t acc[KV_HEADS_AT_ONCE];
      for (int h = 0; h < n; h++) acc[h] = wasm_i32x4_splat(0);
      for (int i = c; i < c + g; i += 8) {
        const v128_t kv = wasm_i16x8_load8x8(k + i);
        for (int h = 0; h < n; h++)
          acc[h] = wasm_i32x4_add(acc[h], wasm_i32x4_dot_i16x8(wasm_v128_load(qs + (size_t)(h0 + h) * d + i), kv));
      }
      const float scale = half1(s[c / g]);
      for (int h = 0; h < n; h++) total[h] += (float)lanes_isum(acc[h]) * scale;
    }
    for (int h = 0; h < n; h++) scores[h0 + h] = total[h] * steps[h0 + h];
  }
}

// scores[h] = the stored int4 key row (rotated) . query h rotated and rounded (qs, steps as dot8's; qsums:
// each one's sums of steps per 32, d / 32 apart)
static void dot4(const int16_t* qs, const float* steps, const float* qsums, int G, const uint8_t* k,
                 const uint16_t* pairs, int d, float* scores) {
  for (int h0 = 0; h0 < G; h0 += KV_HEADS_AT_ONCE) {
    const int n = G - h0 < KV_HEADS_AT_ONCE ? G - h0 : KV_HEADS_AT_ONCE;
    float total[KV_HEADS_AT_ONCE] = {0};
    for (int c = 0; c < d; c += 32) {  // keys: a (scale, minimum) pair per 32
      const v128_t b = wasm_v128_load(k + c / 2), lo = wasm_v128_and(b, wasm_i8x16_splat(0x0f)), hi = wasm_u8x16_shr(b, 4);
      const v128_t n0 = wasm_u16x8_extend_low_u8x16(lo), n1 = wasm_u16x8_extend_high_u8x16(lo);
      const v128_t n2 = wasm_u16x8_extend_low_u8x16(hi), n3 = wasm_u16x8_extend_high_u8x16(hi);
      const float scale = half1(pairs[2 * (c / 32)]), minimum = half1(pairs[2 * (c / 32) + 1]);
      for (int h = 0; h < n; h++) {
        const int16_t* q = qs + (size_t)(h0 + h) * d + c;
        const v128_t acc = wasm_i32x4_add(
            wasm_i32x4_add(wasm_i32x4_dot_i16x8(wasm_v128_load(q), n0), wasm_i32x4_dot_i16x8(wasm_v128_load(q + 8), n1)),
            wasm_i32x4_add(wasm_i32x4_dot_i16x8(wasm_v128_load(q + 16), n2), wasm_i32x4_dot_i16x8(wasm_v128_load(q + 24), n3)));
        total[h] += (float)lanes_isum(acc) * scale + qsums[(size_t)(h0 + h) * (d / 32) + c / 32] * minimum;
      }
    }
    for (int h = 0; h < n; h++) scores[h0 + h] = total[h] * steps[h0 + h];
  }
}

// the rounded queries of G heads (qn: G rows of d), for dot8, or rotated first for dot4 (then with their
// sums per 32); work: d floats
static void round_queries(const float* qn, int G, int d, int rotate, int16_t* qs, float* steps, float* qsums, float* work) {
  for (int h = 0; h < G; h++) {
    const float* q = qn + (size_t)h * d;
    if (rotate) {
      for (int i = 0; i < d; i++) work[i] = q[i];
      fwht(work, d);
      q = work;
    }
    int16_t* r = qs + (size_t)h * d;
    steps[h] = round_query16(q, d, r);
    if (rotate)
      for (int c = 0; c < d; c += 32) {
        int32_t sum = 0;
        for (int i = c; i < c + 32; i++) sum += r[i];
        qsums[(size_t)h * (d / 32) + c / 32] = (float)sum;
      }
  }
}

// out[h] += sum over the count stored value rows (rows[t]; their groups' scales sf[t * groups + k], and an int4
// row's minimums mf likewise) of w[h * stride + t] times the row (int4: left rotated), for G heads (out: G rows
// of d; groups of g). Eight numbers of every row at a time, four heads' sums of them in registers: a row's
// bytes are widened once for its heads; an int4 group's minimums are summed apart and added once.
static void sum_values(const uint8_t* const* rows, const float* sf, const float* mf, int count, const float* w,
                       int stride, int G, int int4, int d, int g, float* out) {
  const int groups = d / g;
  for (int h0 = 0; h0 < G; h0 += 4) {
    const int n = G - h0 < 4 ? G - h0 : 4;
    for (int c = 0; c < d; c += 8) {
      v128_t acc[4][2];
      for (int h = 0; h < 4; h++) acc[h][0] = acc[h][1] = wasm_f32x4_splat(0.f);
      const int k = c / g, at = (c / 32) * 16 + (c % 32 < 16 ? c % 32 : c % 32 - 16), high = c % 32 >= 16;
      for (int t = 0; t < count; t++) {
        v128_t x0, x1;
        if (int4) {
          const v128_t b = wasm_v128_load64_zero(rows[t] + at);
          const v128_t nib = wasm_u16x8_extend_low_u8x16(high ? wasm_u8x16_shr(b, 4) : wasm_v128_and(b, wasm_i8x16_splat(0x0f)));
          x0 = wasm_f32x4_convert_i32x4(wasm_u32x4_extend_low_u16x8(nib));
          x1 = wasm_f32x4_convert_i32x4(wasm_u32x4_extend_high_u16x8(nib));
        } else {
          const v128_t b = wasm_i16x8_load8x8(rows[t] + c);
          x0 = wasm_f32x4_convert_i32x4(wasm_i32x4_extend_low_i16x8(b));
          x1 = wasm_f32x4_convert_i32x4(wasm_i32x4_extend_high_i16x8(b));
        }
        const float scale = sf[t * groups + k];
        for (int h = 0; h < n; h++) {
          const v128_t sw = wasm_f32x4_splat(w[(size_t)(h0 + h) * stride + t] * scale);
          acc[h][0] = wasm_f32x4_add(acc[h][0], wasm_f32x4_mul(sw, x0));
          acc[h][1] = wasm_f32x4_add(acc[h][1], wasm_f32x4_mul(sw, x1));
        }
      }
      for (int h = 0; h < n; h++) {
        float* o = out + (size_t)(h0 + h) * d + c;
        wasm_v128_store(o, wasm_f32x4_add(wasm_v128_load(o), acc[h][0]));
        wasm_v128_store(o + 4, wasm_f32x4_add(wasm_v128_load(o + 4), acc[h][1]));
      }
    }
  }
  if (!int4) return;
  for (int h = 0; h < G; h++)
    for (int k = 0; k < groups; k++) {
      float m = 0.f;
      for (int t = 0; t < count; t++) m += w[(size_t)h * stride + t] * mf[t * groups + k];
      float* o = out + (size_t)h * d + k * g;
      for (int i = 0; i < g; i += 4) wasm_v128_store(o + i, wasm_f32x4_add(wasm_v128_load(o + i), wasm_f32x4_splat(m)));
    }
}

// the count stored value rows' group scales (and an int4 row's minimums) as floats, groups a row each
static void row_scales(const uint16_t* const* scales, int count, int int4, int groups, float* sf, float* mf) {
  for (int t = 0; t < count; t++)
    for (int k = 0; k < groups; k++) {
      sf[t * groups + k] = half1(scales[t][int4 ? 2 * k : k]);
      if (int4) mf[t * groups + k] = half1(scales[t][2 * k + 1]);
    }
}
