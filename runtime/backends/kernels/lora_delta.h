// ruvllm.LoraDelta: a target's output plus its adapters' delta, z = y + ((x A^T) * w) B, for the LoRA
// graph (exporter/builders/lora_path.py), where the adapters of a step sit side by side in columns and w
// weighs each token's columns (one-hot per token for a batch of different adapters). The graph's
// Gemm -> Mul -> MatMul -> Add computes every column for every token; here a token computes only the
// columns its w does not zero, so a batch over four rank-16 adapters does a quarter of the work, in one
// operator instead of four. With attribute scaled=1 a sixth input s [out] scales the delta (an AWQ
// package's up_proj, whose output rows carry the next projection's input scale): z = y + s * delta.
// A^T and B come as fp32, or as fp16 where the native backend holds a quantized package's adapters so:
// the deltas read every column of a step's adapters from memory each step (four rank-16 adapters over
// SmolLM2's targets: ~78 MB in fp32), and halving those bytes is most of what they cost at 16 streams.
// w's rows hold one set of C weights for every target, or one per layer and target (layerwise X-LoRA,
// runtime/contract.py's lora_module): attribute `module` is the first target's set, target t takes set
// min(module + t, sets - 1), so a one-set w serves every target.
// A target no adapter in the bound slots adapts comes with zero columns (A^T [0, in], B [0, out]; the native
// backend binds it so): its output is y as it is, and nothing of it is read (a q,v adapter's other five
// targets were most of a step's adapter bytes).
// Written over simd_math.h's Vec: 16 lanes on the AVX-512 build, 8 on AVX2.
#pragma once

#include "ort_api.h"
#include "simd_math.h"

namespace {

struct LoraKernel {
  bool scaled = false;
  int64_t split = 0;   // LoraSplit: the columns of its first output
  int64_t module = 0;  // the first target's weight set
};

extern const CustomOp g_lora_split;

OrtStatus* create_lora(const CustomOp* op, const void*, const OrtKernelInfo* info, void** out) {
  int64_t scaled = 0, split = 0, module = 0;
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  RETURN_IF(attr(info, "scaled", &scaled));
  RETURN_IF(attr(info, "module", &module));
  if (module < 0) return fail("ruvllm.LoraDelta: module must not be negative");
  if (op == &g_lora_split) {
    RETURN_IF(attr(info, "split", &split));
    if (split <= 0) return fail("ruvllm.LoraSplit: split must be positive");
  }
  auto* k = new (std::nothrow) LoraKernel{scaled != 0, split, module};
  if (!k) return fail("ruvllm.LoraDelta: out of memory");
  *out = k;
  return nullptr;
}

struct LoraJob {
  const float *y, *x, *w, *scale;  // scale: null, or [out]
  const void *at, *b;              // float, or fp16 as uint16_t where `half`
  bool half = false;
  float* z;
  int64_t N, in, out, cols;
  int64_t ldy = 0, ldz = 0;  // row strides of y and z (LoraSwiGLU: y is the gate and up halves side by side)
  int64_t ldw = 0;           // row stride of w (sets * cols)
};

// point job j (of target t) at its set of w's [N, sets * cols] rows
OrtStatus* weight_set(const OrtValue* w_value, const std::vector<int64_t>& dw, int64_t module, int t, const char* op,
                      LoraJob& j) {
  if (dw.size() == 2 && j.cols == 0) {  // an idle target: w is the others' (or [N, 0])
    j.w = nullptr;
    j.ldw = dw[1];
    return nullptr;
  }
  if (dw.size() != 2 || (j.cols ? dw[1] % j.cols : dw[1]) != 0)
    return fail(std::string(op) + ": w must be [N, sets * C] for the adapters' C columns");
  const int64_t sets = j.cols ? dw[1] / j.cols : 1;
  const float* w = nullptr;
  RETURN_IF(tensor_data(w_value, const_cast<float**>(&w)));
  j.w = w + std::min<int64_t>(module + t, std::max<int64_t>(sets - 1, 0)) * j.cols;
  j.ldw = dw[1];
  return nullptr;
}

// Rows whose w has the same nonzero columns (a batch's tokens of one adapter, or of one X-LoRA) go
// through those columns together, up to kGroup rows at a time: each A^T and B row is read once per group
// instead of once per token, and each row's outputs stay in registers over all the columns.
constexpr int kGroup = 4;

struct RowGroup {
  int64_t rows[kGroup];
  int count;
};

// the columns that row n's weights do not zero in any of the T jobs' sets (idle targets have none)
inline void nonzero_columns(const LoraJob* jobs, int T, int64_t n, std::vector<int32_t>& cols) {
  cols.clear();
  int64_t C = 0;
  for (int t = 0; t < T; t++) C = std::max(C, jobs[t].cols);
  for (int64_t c = 0; c < C; c++)
    for (int t = 0; t < T; t++)
      if (jobs[t].cols && jobs[t].w[n * jobs[t].ldw + c] != 0.f) {
        cols.push_back((int32_t)c);
        break;
      }
}

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }

// x_i . a for G rows at once: each element of a loaded once, 2G independent accumulator chains (one
// chain would wait on its adds' latency: ~4x slower)
template <int G, typename W>
void dots(const float* const* x, const W* a, int64_t n, float* out) {
  constexpr int L = Vec::kLanes;
  Vec::F acc[G][2];
  for (int i = 0; i < G; i++) acc[i][0] = acc[i][1] = Vec::zero();
  int64_t k = 0;
  for (; k + 2 * L <= n; k += 2 * L) {
    const Vec::F a0 = Vec::load(a + k), a1 = Vec::load(a + k + L);
    for (int i = 0; i < G; i++) {
      acc[i][0] = Vec::fmadd(Vec::load(x[i] + k), a0, acc[i][0]);
      acc[i][1] = Vec::fmadd(Vec::load(x[i] + k + L), a1, acc[i][1]);
    }
  }
  for (int i = 0; i < G; i++) {
    float s = Vec::reduce_add(Vec::add(acc[i][0], acc[i][1]));
    for (int64_t r = k; r < n; r++) s += x[i][r] * load1(a + r);
    out[i] = s;
  }
}

// z_i = y_i + sum_c d[c][i] * B[c] (times the scale), two vectors of outputs at a time kept in registers
// over every column: each B load feeds G FMAs and z is written once (an axpy per column would load and
// store z each time)
template <int G, typename W>
void delta_rows(const LoraJob& j, const RowGroup& g, const std::vector<int32_t>& cols, const float* d) {
  constexpr int L = Vec::kLanes, V = 2;
  const float* y[G];
  float* z[G];
  for (int i = 0; i < G; i++) {
    y[i] = j.y + g.rows[i] * j.ldy;
    z[i] = j.z + g.rows[i] * j.ldz;
  }
  const size_t nc = cols.size();
  int64_t o = 0;
  for (; o + V * L <= j.out; o += V * L) {
    Vec::F acc[G][V];
    for (int i = 0; i < G; i++)
      for (int v = 0; v < V; v++) acc[i][v] = Vec::zero();
    for (size_t k = 0; k < nc; k++) {
      const W* bk = static_cast<const W*>(j.b) + (int64_t)cols[k] * j.out + o;
      const float* dk = d + k * kGroup;
      for (int v = 0; v < V; v++) {
        const Vec::F b = Vec::load(bk + v * L);
        for (int i = 0; i < G; i++) acc[i][v] = Vec::fmadd(Vec::set1(dk[i]), b, acc[i][v]);
      }
    }
    for (int i = 0; i < G; i++)
      for (int v = 0; v < V; v++) {
        const int64_t at = o + v * L;
        const Vec::F yv = Vec::load(y[i] + at);
        Vec::store(z[i] + at, j.scale ? Vec::fmadd(Vec::load(j.scale + at), acc[i][v], yv) : Vec::add(yv, acc[i][v]));
      }
  }
  for (; o < j.out; o++)
    for (int i = 0; i < G; i++) {
      float acc = 0.f;
      for (size_t k = 0; k < nc; k++) acc += d[k * kGroup + i] * load1(static_cast<const W*>(j.b) + (int64_t)cols[k] * j.out + o);
      z[i][o] = y[i][o] + (j.scale ? j.scale[o] * acc : acc);
    }
}

template <typename W>
void lora_group_as(const LoraJob& j, const RowGroup& g, const std::vector<int32_t>& cols) {
  const int G = g.count;
  thread_local std::vector<float> d;  // d[c][i] = w_i[c] * (x_i . A^T[c]); per thread, reused: no allocation per call
  d.resize((size_t)cols.size() * kGroup);
  const float* x[kGroup];
  for (int i = 0; i < G; i++) x[i] = j.x + g.rows[i] * j.in;
  // B's rows, read after the dots below as as many interleaved streams as columns (which the hardware
  // prefetcher does not follow), are fetched while the dots compute
  for (size_t k = 0; k < cols.size(); k++) {
    const char* bk = static_cast<const char*>(j.b) + ((int64_t)cols[k] * j.out) * sizeof(W);
    for (int64_t off = 0; off < j.out * (int64_t)sizeof(W); off += 64) prefetch(bk + off);
  }
  for (size_t k = 0; k < cols.size(); k++) {
    const W* a = static_cast<const W*>(j.at) + (int64_t)cols[k] * j.in;
    float* dk = d.data() + k * kGroup;
    switch (G) {
      case 1: dots<1>(x, a, j.in, dk); break;
      case 2: dots<2>(x, a, j.in, dk); break;
      case 3: dots<3>(x, a, j.in, dk); break;
      default: dots<4>(x, a, j.in, dk); break;
    }
    for (int i = 0; i < G; i++) dk[i] *= j.w[g.rows[i] * j.ldw + cols[k]];
  }
  switch (G) {
    case 1: return delta_rows<1, W>(j, g, cols, d.data());
    case 2: return delta_rows<2, W>(j, g, cols, d.data());
    case 3: return delta_rows<3, W>(j, g, cols, d.data());
    default: return delta_rows<4, W>(j, g, cols, d.data());
  }
}

void lora_group(const LoraJob& j, const RowGroup& g, const std::vector<int32_t>& cols) {
  if (j.half) lora_group_as<uint16_t>(j, g, cols);
  else lora_group_as<float>(j, g, cols);
}

// whether an adapter input is fp16 (else fp32; anything else is an error)
OrtStatus* adapter_half(const OrtValue* v, const char* op, bool* half) {
  int type = 0;
  RETURN_IF(tensor_type(v, &type));
  if (type != kFloat && type != kFloat16) return fail(std::string(op) + ": adapter A and B must be float or float16");
  *half = type == kFloat16;
  return nullptr;
}

// a target's A^T and B (inputs i and i + 1) into its job: their data, and fp16 or not (both alike)
OrtStatus* adapter_inputs(const OrtValue* const* in, size_t i, const char* op, LoraJob& j) {
  bool half_b = false;
  RETURN_IF(adapter_half(in[i], op, &j.half));
  RETURN_IF(adapter_half(in[i + 1], op, &half_b));
  if (half_b != j.half) return fail(std::string(op) + ": a target's A and B must have the same type");
  RETURN_IF(tensor_data(in[i], const_cast<void**>(&j.at)));
  return tensor_data(in[i + 1], const_cast<void**>(&j.b));
}

struct LoraPlan {
  std::vector<RowGroup> groups;
  std::vector<std::vector<int32_t>> cols;  // per group
};

// group the rows by their nonzero columns, in first-seen order, kGroup rows at most per group (`plan` is
// reused across calls: its vectors keep their capacity)
void plan_groups(const LoraJob* jobs, int T, LoraPlan& plan) {
  const LoraJob& j = jobs[0];
  plan.groups.clear();
  plan.cols.clear();
  std::vector<int32_t> cols;
  std::vector<size_t> open;  // per distinct column set: its last group, while not full
  for (int64_t n = 0; n < j.N; n++) {
    nonzero_columns(jobs, T, n, cols);
    size_t found = open.size();
    for (size_t k = 0; k < open.size(); k++)
      if (plan.cols[open[k]] == cols) {
        found = k;
        break;
      }
    if (found < open.size() && plan.groups[open[found]].count < kGroup) {
      RowGroup& g = plan.groups[open[found]];
      g.rows[g.count++] = n;
      continue;
    }
    plan.groups.push_back(RowGroup{{n}, 1});
    plan.cols.push_back(cols);
    if (found < open.size()) open[found] = plan.groups.size() - 1;
    else open.push_back(plan.groups.size() - 1);
  }
}

// T targets of one projection's output over the same rows (LoraDelta 1, LoraSwiGLU 2, LoraSplit 3): one
// grouping of the rows (by the columns any of their sets weighs); item i is target i / groups's delta over
// row group i % groups. One group stays on the calling thread, where a handoff costs more than it saves.
template <int T>
struct TargetsWork {
  const LoraPlan* plan;
  LoraJob jobs[T];
};

template <int T>
void targets_item(void* data, size_t i) {
  const TargetsWork<T>& work = *static_cast<TargetsWork<T>*>(data);
  const size_t groups = work.plan->groups.size();
  static const std::vector<int32_t> kNone;  // an idle target: z = y, its (absent) A and B never read
  const LoraJob& j = work.jobs[i / groups];
  lora_group(j, work.plan->groups[i % groups], j.cols ? work.plan->cols[i % groups] : kNone);
}

template <int T>
OrtStatus* run_targets(OrtKernelContext* ctx, TargetsWork<T>& work) {
  thread_local LoraPlan plan;
  plan_groups(work.jobs, T, plan);
  work.plan = &plan;
  const size_t items = T * plan.groups.size();
  if (plan.groups.size() >= 2) return parallel_for(ctx, targets_item<T>, items, &work);
  for (size_t i = 0; i < items; i++) targets_item<T>(&work, i);
  return nullptr;
}

OrtStatus* lora_delta(void* kernel, OrtKernelContext* ctx) {
  const bool scaled = static_cast<LoraKernel*>(kernel)->scaled;
  const int64_t module = static_cast<LoraKernel*>(kernel)->module;
  const OrtValue* in[6] = {};
  std::vector<int64_t> d[6];
  RETURN_IF(read_inputs(ctx, scaled ? 6 : 5, in, d));
  const auto &dy = d[0], &dx = d[1], &da = d[2], &db = d[3], &dw = d[4], &ds = d[5];
  if (dy.size() != 2 || dx.size() != 2 || da.size() != 2 || db.size() != 2 || dw.size() != 2 || dx[0] != dy[0] ||
      dw[0] != dy[0] || da[1] != dx[1] || db[1] != dy[1] || da[0] != db[0])
    return fail("ruvllm.LoraDelta: expected y [N, out], x [N, in], A^T [C, in], B [C, out], w [N, sets * C]");
  TargetsWork<1> work{};
  LoraJob& j = work.jobs[0];
  j.N = dy[0], j.out = dy[1], j.in = dx[1], j.cols = da[0];
  j.ldy = j.ldz = j.out;
  if (scaled) {
    if (ds.size() != 1 || ds[0] != j.out) return fail("ruvllm.LoraDelta: the scale must be [out]");
    RETURN_IF(tensor_data(in[5], const_cast<float**>(&j.scale)));
  }
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&j.y)));
  RETURN_IF(tensor_data(in[1], const_cast<float**>(&j.x)));
  RETURN_IF(adapter_inputs(in, 2, "ruvllm.LoraDelta", j));
  RETURN_IF(weight_set(in[4], dw, module, 0, "ruvllm.LoraDelta", j));
  RETURN_IF(output_data(ctx, 0, dy.data(), dy.size(), &j.z));
  if (j.N == 0 || j.out == 0) return nullptr;
  return run_targets(ctx, work);
}

// ruvllm.LoraSwiGLU: the MLP's gate and up targets and what follows them in one operator,
// out = silu(y_g + delta_g) * (y_u + delta_u) with y = [y_g | y_u] the fused gate/up projection's output.
// Why: in the LoRA graph the projection's SwiGLU epilogue cannot fold into MatMulQ4 (the deltas come
// between), and the Split, two deltas, Sigmoid and two Muls were six operators and passes per layer.
// Inputs: y [N, 2F], x [N, in], A_g^T [C, in], B_g [C, F], A_u^T [C, in], B_u [C, F], w [N, sets * C].

OrtStatus* lora_swiglu(void* kernel, OrtKernelContext* ctx) {
  const int64_t module = static_cast<LoraKernel*>(kernel)->module;
  const OrtValue* in[7] = {};
  std::vector<int64_t> d[7];
  RETURN_IF(read_inputs(ctx, 7, in, d));
  const auto &dy = d[0], &dx = d[1], &dw = d[6];
  if (dy.size() != 2 || dx.size() != 2 || dw.size() != 2 || dx[0] != dy[0] || dw[0] != dy[0] || dy[1] % 2)
    return fail("ruvllm.LoraSwiGLU: expected y [N, 2F], x [N, in], w [N, C]");
  const int64_t N = dy[0], F = dy[1] / 2;
  const int64_t C = std::max(d[2].size() == 2 ? d[2][0] : 0, d[4].size() == 2 ? d[4][0] : 0);
  for (int k : {2, 4})
    if (d[k].size() != 2 || d[k + 1].size() != 2 || d[k][1] != dx[1] || d[k + 1][1] != F ||
        (d[k][0] != C && d[k][0] != 0) || d[k + 1][0] != d[k][0])
      return fail("ruvllm.LoraSwiGLU: expected A^T [C, in] and B [C, F] (or [0, ...]) for the gate and the up target");
  TargetsWork<2> work{};
  const float* y = nullptr;
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&y)));
  thread_local std::vector<float> halves;  // the gate's and up's outputs with their deltas, [2][N][F]
  halves.resize((size_t)(2 * N * F));
  for (int h = 0; h < 2; h++) {
    LoraJob& j = work.jobs[h];
    j.N = N, j.out = F, j.in = dx[1], j.cols = d[2 + 2 * h][0], j.ldy = 2 * F, j.ldz = F;
    j.y = y + h * F;
    j.z = halves.data() + (size_t)h * N * F;
    RETURN_IF(tensor_data(in[1], const_cast<float**>(&j.x)));
    RETURN_IF(adapter_inputs(in, 2 + 2 * h, "ruvllm.LoraSwiGLU", j));
    RETURN_IF(weight_set(in[6], dw, module, h, "ruvllm.LoraSwiGLU", j));
  }
  std::vector<int64_t> out_dims{N, F};
  float* out = nullptr;
  RETURN_IF(output_data(ctx, 0, out_dims.data(), out_dims.size(), &out));
  if (N == 0 || F == 0) return nullptr;
  RETURN_IF(run_targets(ctx, work));
  const float *g = halves.data(), *u = halves.data() + N * F;
  const int64_t n = N * F;
  int64_t k = 0;
  for (; k + Vec::kLanes <= n; k += Vec::kLanes) {
    const Vec::F v = Vec::mul(silu(Vec::load(g + k)), Vec::load(u + k));
    std::memcpy(out + k, &v, sizeof v);
  }
  if (k < n) {  // the last numbers through the same vector arithmetic, so none depends on N (batch invariance)
    alignas(64) float gt[Vec::kLanes] = {}, ut[Vec::kLanes] = {}, ot[Vec::kLanes];
    std::memcpy(gt, g + k, (n - k) * sizeof(float));
    std::memcpy(ut, u + k, (n - k) * sizeof(float));
    const Vec::F v = Vec::mul(silu(Vec::load(gt)), Vec::load(ut));
    std::memcpy(ot, &v, sizeof v);
    std::memcpy(out + k, ot, (n - k) * sizeof(float));
  }
  return nullptr;
}

// ruvllm.LoraSplit: the attention's fused q/k/v projection output with its three targets' deltas,
// written as two tensors (q+k, v), as MatMulQ4Split writes the base graph's. Why: in the LoRA graph the
// projection's output was split into three, each target's delta added, and q and k concatenated again:
// five operators and two copies per layer. Inputs: y [N, Q+K+V], x [N, in], A_q^T, B_q, A_k^T, B_k, A_v^T,
// B_v, w [N, sets * C]; attribute split: the first output's columns (Q+K: each target lies in one output).

OrtStatus* lora_split(void* kernel, OrtKernelContext* ctx) {
  const int64_t split = static_cast<LoraKernel*>(kernel)->split, module = static_cast<LoraKernel*>(kernel)->module;
  const OrtValue* in[9] = {};
  std::vector<int64_t> d[9];
  RETURN_IF(read_inputs(ctx, 9, in, d));
  const auto &dy = d[0], &dx = d[1], &dw = d[8];
  if (dy.size() != 2 || dx.size() != 2 || dw.size() != 2 || dx[0] != dy[0] || dw[0] != dy[0] || split >= dy[1])
    return fail("ruvllm.LoraSplit: expected y [N, Q+K+V] (wider than split), x [N, in], w [N, C]");
  const int64_t N = dy[0], total = dy[1];
  std::vector<int64_t> dims0{N, split}, dims1{N, total - split};
  float *out0 = nullptr, *out1 = nullptr;
  RETURN_IF(output_data(ctx, 0, dims0.data(), 2, &out0));
  RETURN_IF(output_data(ctx, 1, dims1.data(), 2, &out1));
  const float* y = nullptr;
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&y)));
  TargetsWork<3> work{};
  int64_t col = 0, C = 0;
  for (int t = 0; t < 3; t++)
    if (d[2 + 2 * t].size() == 2) C = std::max(C, d[2 + 2 * t][0]);
  for (int t = 0; t < 3; t++) {
    const auto &da = d[2 + 2 * t], &db = d[3 + 2 * t];
    if (da.size() != 2 || db.size() != 2 || da[1] != dx[1] || (da[0] != C && da[0] != 0) || db[0] != da[0])
      return fail("ruvllm.LoraSplit: expected A^T [C, in] and B [C, out] (or [0, ...]) for each of the three targets");
    const int64_t out = db[1];
    if (!(col + out <= split || col >= split) || col + out > total)
      return fail("ruvllm.LoraSplit: the targets' outputs do not tile y with each inside one output");
    LoraJob& j = work.jobs[t];
    j.N = N, j.out = out, j.in = dx[1], j.cols = da[0], j.ldy = total;
    j.y = y + col;
    if (col < split) j.z = out0 + col, j.ldz = split;
    else j.z = out1 + (col - split), j.ldz = total - split;
    RETURN_IF(tensor_data(in[1], const_cast<float**>(&j.x)));
    RETURN_IF(weight_set(in[8], dw, module, t, "ruvllm.LoraSplit", j));
    RETURN_IF(adapter_inputs(in, 2 + 2 * t, "ruvllm.LoraSplit", j));
    col += out;
  }
  if (col != total) return fail("ruvllm.LoraSplit: the targets' outputs do not add up to y's columns");
  if (N == 0) return nullptr;
  return run_targets(ctx, work);
}

}  // namespace
