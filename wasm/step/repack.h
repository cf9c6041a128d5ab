// A GGUF matrix's raw blocks into the step's layout (the one blocks.h reads; runtime/formats/step_plan.py
// names its parts and their shapes), so the page can open a GGUF file itself: its tensors arrive in byte
// ranges, a piece of whole rows at a time, and are written where step.bin's arrays lie in the module's
// memory. The exporter writes the same bytes with numpy (exporter/step_weights.py); tests/web/test_gguf_repack.py
// holds the two equal for every type. The file's blocks are ggml's (its type traits): little-endian fp16.
#pragma once
#include "abi.h"

static inline uint16_t le16(const uint8_t* p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t le32(const uint8_t* p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

// where row r's number i of a [N/4, per_row, (extra,) 4] part lies: four rows side by side
static inline size_t four_at(int r, int per_row, int i) { return ((size_t)(r / 4) * per_row + i) * 4 + (r & 3); }

// block b (32 weights, q: 0 .. 63) of row r: nibbles (weight i low, i + 16 high) and the bit planes above them
static void put_weights(const QMat* W, int K, int r, int b, const uint8_t* q) {
  uint8_t* w = (uint8_t*)W->w + (size_t)r * (K / 2) + 16 * b;
  for (int i = 0; i < 16; i++) w[i] = (uint8_t)((q[i] & 15) | (q[i + 16] & 15) << 4);
  const int P = planes_of(W->kind);
  for (int p = 0; p < P; p++) {
    uint32_t bits = 0;
    for (int j = 0; j < 32; j++) bits |= (uint32_t)((q[j] >> (4 + p)) & 1) << j;
    ((uint32_t*)W->hb)[((size_t)r * (K / 32) + b) * P + p] = bits;
  }
}

// a K-quant's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4)
static inline void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// one row's blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
static void repack_row32(const QMat* W, int K, int r, const uint8_t* src) {
  const int kind = W->kind, blocks = K / 32, bytes = block_bytes_of(kind);
  uint16_t* d = (uint16_t*)W->d;
  uint16_t* m = (uint16_t*)W->m;
  uint8_t q[32];
  for (int b = 0; b < blocks; b++, src += bytes) {
    d[four_at(r, blocks, b)] = le16(src);
    if (kind == Q8_0) {
      int8_t* w = (int8_t*)W->w + (size_t)r * K + 32 * b;
      for (int j = 0; j < 32; j++) w[j] = (int8_t)src[2 + j];
      continue;
    }
    const int mins = has_mins(kind), high = planes_of(kind);
    if (mins) m[four_at(r, blocks, b)] = le16(src + 2);
    const uint8_t* qh = src + 2 + 2 * mins;  // Q5_*: 32 high bits before the nibbles
    const uint8_t* qs = qh + 4 * high;
    const uint32_t bits = high ? le32(qh) : 0;
    for (int j = 0; j < 16; j++) {
      q[j] = (uint8_t)((qs[j] & 15) | ((bits >> j) & 1) << 4);
      q[j + 16] = (uint8_t)((qs[j] >> 4) | ((bits >> (j + 16)) & 1) << 4);
    }
    put_weights(W, K, r, b, q);
  }
}

// one row's super-blocks of 256 (Q4_K, Q5_K, Q6_K)
static void repack_row256(const QMat* W, int K, int r, const uint8_t* src) {
  const int kind = W->kind, supers = K / 256, bytes = block_bytes_of(kind);
  uint16_t* d = (uint16_t*)W->d;
  uint8_t q[256];
  for (int s = 0; s < supers; s++, src += bytes) {
    if (kind == Q6_K) {  // ql[128], qh[64], int8 scales[16], d
      const uint8_t *ql = src, *qh = src + 128;
      const int8_t* sc = (const int8_t*)(src + 192);
      d[four_at(r, supers, s)] = le16(src + 208);
      for (int half = 0; half < 2; half++, ql += 64, qh += 32) {
        uint8_t* y = q + 128 * half;
        for (int l = 0; l < 32; l++) {
          y[l] = (uint8_t)((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4);
          y[l + 32] = (uint8_t)((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4);
          y[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
          y[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
      }
      int8_t* out = (int8_t*)W->sc;
      for (int i = 0; i < 16; i++) {  // [N/4, K/32, 2, 4]: block i / 2's half i % 2
        const int b = 8 * s + i / 2;
        out[(((size_t)(r / 4) * (K / 32) + b) * 2 + (i & 1)) * 4 + (r & 3)] = sc[i];
      }
    } else {  // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
      const uint8_t* scales = src + 4;
      const int five = kind == Q5_K;
      const uint8_t *qh = src + 16, *qs = src + 16 + 32 * five;
      d[four_at(r, supers, s)] = le16(src);
      ((uint16_t*)W->m)[four_at(r, supers, s)] = le16(src + 2);
      for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
          const uint8_t byte = qs[32 * c + l];
          q[64 * c + l] = (uint8_t)((byte & 15) | (five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0));
          q[64 * c + 32 + l] = (uint8_t)((byte >> 4) | (five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0));
        }
      }
      for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        scale_min_k4(j, scales, &sc, &m);
        ((uint8_t*)W->sc)[four_at(r, K / 32, 8 * s + j)] = sc;
        ((uint8_t*)W->mb)[four_at(r, K / 32, 8 * s + j)] = m;
      }
    }
    for (int b = 0; b < 8; b++) put_weights(W, K, r, 8 * s + b, q + 32 * b);
  }
}

// Rows [row0, row0 + rows) of W [N, K] from `src`, those rows' raw blocks as the file holds them; W's parts
// are step.bin's arrays of the whole matrix. 1: a kind the step does not read, or rows outside [0, N) or not
// whole groups of four.
EXPORT int step_repack(const QMat* W, int N, int K, const uint8_t* src, int row0, int rows) {
  const int bytes = block_bytes_of(W->kind), elems = block_elems_of(W->kind);
  if (!bytes || K % elems || row0 % 4 || rows % 4 || row0 < 0 || rows < 0 || row0 + rows > N) return 1;
  const size_t row_bytes = (size_t)(K / elems) * bytes;
  for (int r = row0; r < row0 + rows; r++, src += row_bytes) {
    if (elems == 256) repack_row256(W, K, r, src);
    else repack_row32(W, K, r, src);
  }
  return 0;
}
