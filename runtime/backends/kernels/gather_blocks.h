// GatherQ: rows of a table kept in an own-bit layout (a GGUF's Q4_K, Q6_K or Q8_0 embedding,
// runtime/backends/block_layouts.py), dequantized to fp32 exactly as gguf dequantizes them: ((d * sc) * q
// - dmin * m for Q4_K, (d * sc) * (q - 32) for Q6_K). Why: a tied model's LM head and its embedding table
// are one tensor; the head runs on the layout, so the gather reads the same bytes instead of a second,
// 8-bit copy of the table in the package. A row lies across its tile (4 bytes of each 64-byte line), so a
// gather reads 16 rows' lines: a few hundred kilobytes a step, against the projections' hundreds of MB.
#pragma once

#include "matmul_q4.h"

namespace {

struct GatherKernel {
  const uint8_t* table = nullptr;  // the initializer, in place
  int64_t kind = kKindQ4_K, N = 0, K = 0;
};

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// one row of a Q4_K layout (kquant_layout): per block of 32, four nibble lines; 16 bytes of scales and 16 of
// minimums per block; fp16 d and dmin per 256
void q4k_row(const GatherKernel& g, int64_t row, float* out) {
  const int64_t nblk = g.K / 32, nsup = g.K / 256, t = row / kTile, j = row % kTile;
  const uint8_t* w = g.table;
  size_t wb, sb, hb;
  own_sections(own_bits(kKindQ4_K + 1), g.N, g.K, &wb, &sb, &hb);
  const uint8_t* scales = w + wb;
  const uint16_t* supers = reinterpret_cast<const uint16_t*>(scales + sb);
  for (int64_t b = 0; b < nblk; b++) {
    const uint16_t* dm = supers + (t * nsup + b / 8) * 2 * kTile;
    const uint8_t* sm = scales + (t * nblk + b) * 2 * kTile;
    const float s = half_to_float(dm[j]) * (float)sm[j], m = half_to_float(dm[kTile + j]) * (float)sm[kTile + j];
    for (int gr = 0; gr < 4; gr++) {
      const uint8_t* line = w + ((t * nblk + b) * 4 + gr) * 64 + 4 * j;
      for (int i = 0; i < 4; i++) {
        out[b * 32 + gr * 8 + i] = s * (float)(line[i] & 15) - m;
        out[b * 32 + gr * 8 + 4 + i] = s * (float)(line[i] >> 4) - m;
      }
    }
  }
}

// one row of a Q6_K layout (q6k_layout): per block of 16, two nibble lines then two 32-byte high-bit lines;
// int8 scales per block; fp16 d per 256
void q6k_row(const GatherKernel& g, int64_t row, float* out) {
  const int64_t nblk = g.K / 16, nsup = g.K / 256, t = row / kTile, j = row % kTile;
  const uint8_t* w = g.table;
  size_t wb, sb, hb;
  own_sections(own_bits(kKindQ6_K + 1), g.N, g.K, &wb, &sb, &hb);
  const int8_t* scales = reinterpret_cast<const int8_t*>(w + wb);
  const uint16_t* supers = reinterpret_cast<const uint16_t*>(w + wb + sb);
  for (int64_t b = 0; b < nblk; b++) {
    const float s = half_to_float(supers[(t * nsup + b / 16) * kTile + j]) * (float)scales[(t * nblk + b) * kTile + j];
    const uint8_t* blk = w + (t * nblk + b) * 192;
    for (int gr = 0; gr < 2; gr++)
      for (int i = 0; i < 4; i++) {
        const int lane = 4 * (int)j + i;  // of the 64-byte line; its high bits: byte lane % 32
        const uint8_t nib = blk[gr * 64 + lane], h = blk[128 + gr * 32 + lane % 32];
        const int shift = lane >= 32 ? 2 : 0;
        const int lo = (nib & 15) | (((h >> shift) & 3) << 4), hi = (nib >> 4) | (((h >> (4 + shift)) & 3) << 4);
        out[b * 16 + gr * 8 + i] = s * (float)(lo - 32);
        out[b * 16 + gr * 8 + 4 + i] = s * (float)(hi - 32);
      }
  }
}

// one row of a Q8_0 layout (pack_q8_own): per block of 32, eight int8 lines; then every tile and block's fp16 d
void q8_row(const GatherKernel& g, int64_t row, float* out) {
  const int64_t nblk = g.K / 32, t = row / kTile, j = row % kTile;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(g.table + g.N * g.K);
  for (int64_t b = 0; b < nblk; b++) {
    const float s = half_to_float(d[(t * nblk + b) * kTile + j]);
    for (int gr = 0; gr < 8; gr++) {
      const int8_t* line = reinterpret_cast<const int8_t*>(g.table + ((t * nblk + b) * 8 + gr) * 64 + 4 * j);
      for (int i = 0; i < 4; i++) out[b * 32 + gr * 4 + i] = s * (float)line[i];
    }
  }
}

OrtStatus* create_gather(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  auto* k = new (std::nothrow) GatherKernel();
  if (!k) return fail("ruvllm.GatherQ: out of memory");
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  OrtStatus* st = attr(info, "N", &k->N);
  if (!st) st = attr(info, "K", &k->K);
  if (!st) st = attr(info, "kquant", &k->kind);
  const uint8_t* data = nullptr;
  if (!st) {
    const OwnBits* t = k->kind >= 1 && k->kind <= kOwnKinds && kOwnBits[k->kind - 1].gather ? &kOwnBits[k->kind - 1] : nullptr;
    const size_t want = !t ? 0 : k->kind == kQ8Kind ? (size_t)(k->N * k->K + k->N * k->K / 16)
                                                     : own_bytes((int)k->kind + 1, k->N, k->K);
    if (!want) st = fail("ruvllm.GatherQ: tables of Q4_K, Q6_K or Q8_0 only (block_types.h's gather)");
    else if (k->K % t->superblock || k->N % kTile)
      st = fail("ruvllm.GatherQ: needs K a multiple of " + std::to_string(t->superblock) + " and N of 16");
    else st = constant_bytes(info, 0, want, "ruvllm.GatherQ: the table", &data);
  }
  if (st) {
    delete k;
    return st;
  }
  k->table = data;
  *out = k;
  return nullptr;
}

OrtStatus* gather_rows(void* kernel, OrtKernelContext* ctx) {
  const GatherKernel& g = *static_cast<GatherKernel*>(kernel);
  const OrtValue* in[2] = {};
  std::vector<int64_t> dims[2];
  RETURN_IF(read_inputs(ctx, 2, in, dims));
  const int64_t* ids = nullptr;
  RETURN_IF(tensor_data(in[1], &ids));
  std::vector<int64_t> shape = dims[1];
  shape.push_back(g.K);
  float* out = nullptr;
  RETURN_IF(output_data(ctx, 0, shape.data(), shape.size(), &out));
  int64_t n = 1;
  for (int64_t d : dims[1]) n *= d;
  for (int64_t r = 0; r < n; r++) {
    const int64_t id = ids[r];
    if (id < 0 || id >= g.N) return fail("ruvllm.GatherQ: a token id is outside the table");
    if (g.kind == kKindQ8_0) q8_row(g, id, out + r * g.K);
    else if (g.kind == kKindQ6_K) q6k_row(g, id, out + r * g.K);
    else q4k_row(g, id, out + r * g.K);
  }
  return nullptr;
}

}  // namespace
