// ruvllm.SampleTopK: the step's sampling tail in one pass per row. It computes what the exported graph's
// ScatterElements (the penalized and biased logits of each row's few sparse tokens written over its
// logits), Add (structured output's mask, [1 or rows, vocab]), Div (the row's temperature), LogSoftmax
// and TopK (largest, sorted; equal values in index order) compute, with the same fp32 operations in the
// same order, but for the sum of the exponentials (this library's e^x, summed in 16 lanes on either build),
// which moves a log-probability by an ulp or so. Why: those five operators each made a pass over [rows, vocab] and
// onnxruntime's ScatterElements copied the logits first: ~1 ms of a 16-row decode step of a 0.5B model
// with a 49,152-token vocabulary (3 % of it). Here a row's numbers stay in one buffer in L2.
//
// Inputs: logits [B, V], sparse ids [B, S] (int64; negative counts from the end, as ScatterElements),
// sparse values [B, S], temperature [B], k [1] (int64), and optionally the mask [1 or B, V]. Outputs: the k
// best log-probabilities [B, k] and their token ids [B, k] (int64).
#pragma once

#include <algorithm>
#include <cmath>

#include "ort_api.h"
#include "vec16.h"

namespace {

constexpr int64_t kInsertK = 128;  // up to this k, the best are kept by insertion; past it, a partial sort

struct SampleJob {
  const float *logits, *values, *temperature, *mask;
  const int64_t* ids;
  int64_t B, V, S, k, mask_rows;
  float* out_lp;
  int64_t* out_ids;
};

// row b: the tail's arithmetic into a log-probability per token, then the k best by insertion into a
// sorted list (value descending, index ascending: a later equal value never displaces an earlier one)
void sample_row(const SampleJob& j, int64_t b) {
  const int64_t V = j.V;
  thread_local std::vector<float> x;
  x.resize((size_t)V);
  std::copy(j.logits + b * V, j.logits + (b + 1) * V, x.begin());
  for (int64_t s = 0; s < j.S; s++) {
    int64_t id = j.ids[b * j.S + s];
    if (id < 0) id += V;
    x[(size_t)id] = j.values[b * j.S + s];
  }
  const float* m = j.mask ? j.mask + (j.mask_rows == 1 ? 0 : b) * V : nullptr;
  const Vec::F t = Vec::set1(j.temperature[b]);
  const bool divide = j.temperature[b] != 1.f;  // x / 1 is x: greedy rows skip the divisions
  constexpr int L = Vec::kLanes;
  const int64_t whole = V / L * L;
  Vec::F mx = Vec::set1(-INFINITY);
  int64_t i = 0;
  for (; i < whole; i += L) {
    Vec::F v = Vec::load(&x[(size_t)i]);
    if (m) v = Vec::add(v, Vec::load(m + i));
    if (divide) v = Vec::div(v, t);
    Vec::store(&x[(size_t)i], v);
    mx = Vec::max(mx, v);
  }
  float top = Vec::reduce_max(mx);
  for (; i < V; i++) {
    x[(size_t)i] = (m ? x[(size_t)i] + m[i] : x[(size_t)i]) / j.temperature[b];
    top = std::max(top, x[(size_t)i]);
  }
  // the exponentials summed in 16 lanes on both builds (vec16.h): a log-probability is the same on either
  V16 sum = v_zero();
  for (i = 0; i < V / 16 * 16; i += 16) sum = v_add(sum, v_exp(v_add(v_loadu(&x[(size_t)i]), v_set1(-top))));
  float total = v_reduce_add(sum);
  for (; i < V; i++) total += std::exp(x[(size_t)i] - top);
  const Vec::F negmax = Vec::set1(-top);
  const float logsum = std::log(total);
  // the log-probabilities, in place: (x - max) - log(sum), as onnxruntime's LogSoftmax forms them
  const Vec::F ls = Vec::set1(logsum);
  for (i = 0; i < whole; i += L) Vec::store(&x[(size_t)i], Vec::sub(Vec::add(Vec::load(&x[(size_t)i]), negmax), ls));
  for (; i < V; i++) x[(size_t)i] = (x[(size_t)i] - top) - logsum;
  float* lp = j.out_lp + b * j.k;
  int64_t* id = j.out_ids + b * j.k;
  if (j.k > kInsertK) {  // many: a partial sort (NaN, which onnxruntime's would not order either, last)
    thread_local std::vector<int64_t> order;
    order.resize((size_t)V);
    for (int64_t t = 0; t < V; t++) order[(size_t)t] = t;
    auto key = [&](int64_t t) { return std::isnan(x[(size_t)t]) ? -INFINITY : x[(size_t)t]; };
    std::partial_sort(order.begin(), order.begin() + j.k, order.end(), [&](int64_t a, int64_t c) {
      return key(a) > key(c) || (key(a) == key(c) && a < c);
    });
    for (int64_t t = 0; t < j.k; t++) {
      id[t] = order[(size_t)t];
      lp[t] = x[(size_t)order[(size_t)t]];
    }
    return;
  }
  // few: insertion into a sorted list; once it holds k, a vector of candidates none above the k-th is passed
  int64_t n = 0;  // entries held so far (up to k)
  auto insert = [&](int64_t t) {
    const float v = x[(size_t)t];
    if (n == j.k && !(v > lp[n - 1])) return;
    int64_t p = n < j.k ? n++ : j.k - 1;  // where it goes: after every entry >= v
    while (p > 0 && lp[p - 1] < v) {
      lp[p] = lp[p - 1];
      id[p] = id[p - 1];
      p--;
    }
    lp[p] = v;
    id[p] = t;
  };
  for (i = 0; i < whole; i += L) {
    if (n == j.k && !Vec::any_greater(Vec::load(&x[(size_t)i]), Vec::set1(lp[n - 1]))) continue;
    for (int64_t t = i; t < i + L; t++) insert(t);
  }
  for (; i < V; i++) insert(i);
}

void sample_item(void* data, size_t b) { sample_row(*static_cast<SampleJob*>(data), (int64_t)b); }

struct SampleKernel {};  // no attributes: the kernel object onnxruntime wants

OrtStatus* create_sample(const CustomOp*, const void*, const OrtKernelInfo*, void** out) {
  auto* k = new (std::nothrow) SampleKernel();
  if (!k) return fail("ruvllm.SampleTopK: out of memory");
  *out = k;
  return nullptr;
}

OrtStatus* sample_topk(void*, OrtKernelContext* ctx) {
  const char* op = "ruvllm.SampleTopK";
  const OrtValue* in[6] = {};
  std::vector<int64_t> d[6];
  RETURN_IF(read_inputs(ctx, 6, in, d, 5, op));  // the mask: optional
  SampleJob j{};
  if (d[0].size() != 2) return fail(std::string(op) + ": logits must be [rows, vocab]");
  j.B = d[0][0];
  j.V = d[0][1];
  if (d[1].size() != 2 || d[1][0] != j.B || d[2] != d[1])
    return fail(std::string(op) + ": sparse ids and values must both be [rows, n]");
  j.S = d[1][1];
  if (d[3].size() != 1 || d[3][0] != j.B) return fail(std::string(op) + ": temperature must be [rows]");
  if (d[4].size() != 1 || d[4][0] != 1) return fail(std::string(op) + ": k must be [1]");
  if (in[5]) {
    if (d[5].size() != 2 || d[5][1] != j.V || (d[5][0] != 1 && d[5][0] != j.B))
      return fail(std::string(op) + ": the mask must be [1 or rows, vocab]");
    j.mask_rows = d[5][0];
    RETURN_IF(tensor_data(in[5], const_cast<float**>(&j.mask)));
  }
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&j.logits)));
  RETURN_IF(tensor_data(in[1], const_cast<int64_t**>(&j.ids)));
  RETURN_IF(tensor_data(in[2], const_cast<float**>(&j.values)));
  RETURN_IF(tensor_data(in[3], const_cast<float**>(&j.temperature)));
  const int64_t* k = nullptr;
  RETURN_IF(tensor_data(in[4], const_cast<int64_t**>(&k)));
  j.k = *k;
  if (j.k < 0 || j.k > j.V) return fail(std::string(op) + ": k must be in [0, vocab]");
  for (int64_t n = 0; n < j.B * j.S; n++)
    if (j.ids[n] < -j.V || j.ids[n] >= j.V) return fail(std::string(op) + ": a sparse id is outside the vocabulary");
  const int64_t dims[2] = {j.B, j.k};
  RETURN_IF(output_data(ctx, 0, dims, 2, &j.out_lp));
  RETURN_IF(output_data(ctx, 1, dims, 2, &j.out_ids));
  if (j.B == 0 || j.k == 0) return nullptr;
  if (j.B == 1) {
    sample_row(j, 0);
    return nullptr;
  }
  return parallel_for(ctx, sample_item, (size_t)j.B, &j);
}

}  // namespace
