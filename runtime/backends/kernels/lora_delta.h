// ruvllm.LoraDelta: a target's output plus its adapters' delta, z = y + ((x A^T) * w) B, for the LoRA
// graph (exporter/builders/lora_path.py), where the adapters of a step sit side by side in columns and w
// weighs each token's columns (one-hot per token for a batch of different adapters). The graph's
// Gemm -> Mul -> MatMul -> Add computes every column for every token; here a token computes only the
// columns its w does not zero, so a batch over four rank-16 adapters does a quarter of the work, in one
// operator instead of four. With attribute scaled=1 a sixth input s [out] scales the delta (an AWQ
// package's up_proj, whose output rows carry the next projection's input scale): z = y + s * delta.
// Plain loops, vectorized by the compiler for the build's ISA.
#pragma once

#include "ort_api.h"

namespace {

struct LoraKernel {
  bool scaled = false;
};

OrtStatus* create_lora(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  int64_t scaled = 0;
  RETURN_IF(api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64)(
      info, "scaled", &scaled));
  auto* k = new (std::nothrow) LoraKernel{scaled != 0};
  if (!k) return fail("ruvllm.LoraDelta: out of memory");
  *out = k;
  return nullptr;
}

struct LoraJob {
  const float *y, *x, *at, *b, *w, *scale;  // scale: null, or [out]
  float* z;
  int64_t N, in, out, cols, rows_per_item;
};

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

void lora_rows(const LoraJob& j, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n++) {
    float* z = j.z + n * j.out;
    const float* x = j.x + n * j.in;
    const float* w = j.w + n * j.cols;
    const float* y = j.y + n * j.out;
    if (!j.scale) std::memcpy(z, y, sizeof(float) * j.out);
    else std::fill(z, z + j.out, 0.f);  // the delta alone first, scaled below
    for (int64_t c = 0; c < j.cols; c++) {
      if (w[c] == 0.f) continue;
      const float s = w[c] * dot(x, j.at + c * j.in, j.in);
      const float* b = j.b + c * j.out;
      for (int64_t o = 0; o < j.out; o++) z[o] += s * b[o];
    }
    if (j.scale)
      for (int64_t o = 0; o < j.out; o++) z[o] = y[o] + j.scale[o] * z[o];
  }
}

void lora_item(void* data, size_t i) {
  const LoraJob& j = *static_cast<LoraJob*>(data);
  const int64_t n0 = (int64_t)i * j.rows_per_item;
  lora_rows(j, n0, std::min(j.N, n0 + j.rows_per_item));
}

OrtStatus* lora_delta(void* kernel, OrtKernelContext* ctx) {
  const bool scaled = static_cast<LoraKernel*>(kernel)->scaled;
  const OrtValue* in[6] = {};
  std::vector<int64_t> d[6];
  RETURN_IF(read_inputs(ctx, scaled ? 6 : 5, in, d));
  const auto &dy = d[0], &dx = d[1], &da = d[2], &db = d[3], &dw = d[4], &ds = d[5];
  if (dy.size() != 2 || dx.size() != 2 || da.size() != 2 || db.size() != 2 || dw.size() != 2 || dx[0] != dy[0] ||
      dw[0] != dy[0] || da[1] != dx[1] || db[1] != dy[1] || da[0] != db[0] || dw[1] != da[0])
    return fail("ruvllm.LoraDelta: expected y [N, out], x [N, in], A^T [C, in], B [C, out], w [N, C]");
  LoraJob j{};
  j.N = dy[0], j.out = dy[1], j.in = dx[1], j.cols = da[0];
  if (scaled) {
    if (ds.size() != 1 || ds[0] != j.out) return fail("ruvllm.LoraDelta: the scale must be [out]");
    RETURN_IF(tensor_data(in[5], const_cast<float**>(&j.scale)));
  }
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&j.y)));
  RETURN_IF(tensor_data(in[1], const_cast<float**>(&j.x)));
  RETURN_IF(tensor_data(in[2], const_cast<float**>(&j.at)));
  RETURN_IF(tensor_data(in[3], const_cast<float**>(&j.b)));
  RETURN_IF(tensor_data(in[4], const_cast<float**>(&j.w)));
  RETURN_IF(output_data(ctx, 0, dy.data(), dy.size(), &j.z));
  if (j.N == 0 || j.out == 0) return nullptr;
  j.rows_per_item = 2;  // a row's work is its own adapter's columns: small, but worth a handoff in pairs
  const size_t items = (size_t)((j.N + j.rows_per_item - 1) / j.rows_per_item);
  if (items < 2) {
    lora_rows(j, 0, j.N);
    return nullptr;
  }
  return parallel_for(ctx, lora_item, items, &j);
}

}  // namespace
