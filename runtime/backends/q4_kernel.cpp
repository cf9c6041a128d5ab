// RuvLLM's CPU kernel for 4-bit weights: an onnxruntime custom operator `ruvllm.MatMulQ4` that
// computes what `com.microsoft.MatMulNBits` (bits=4, zero points, fp32 scales, accuracy_level 4) does,
// with AVX-512 VNNI. Why: MLAS's int8-compute kernel costs ~3.5x its one-row time at 16 rows (it
// unpacks the int4 weights again for every row), so a batch of 16 decode streams spends most of its
// step there. Here each 16-column tile of weights is unpacked once per block and used for up to 4 rows
// and 2 tiles per broadcast activation word.
//
// Arithmetic, per row and per quantization block of `block_size` along K (as MLAS's CompInt8):
// activations a ~ sa * qa (qa int8, symmetric, sa = max|a| / 127), weights w = s * (q - z), so
// a.w = s * sa * (qa.q - z * sum(qa)); qa.q is exact in int32 (vpdpbusd), the rest fp32. Every row is
// computed the same way whatever the batch, so a row's result does not depend on the other rows.
//
// onnxruntime's C API is reached through the function table it hands to RegisterCustomOps. Its
// header is not shipped with the Python wheel, so the few entries used are declared here by their
// fixed position in that table (the table is append-only: an entry never moves between releases);
// runtime/backends/q4_kernel.py checks the library loads and computes what MatMulNBits computes.

#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

extern "C" {
struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};
}

namespace {

// Positions in onnxruntime's OrtApi function table.
enum ApiEntry : size_t {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomain_Add = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttribute_int64 = 86,
  kKernelContext_GetInput = 90,
  kKernelContext_GetOutput = 91,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelInfoGetConstantInput_tensor = 249,
  kKernelContext_ParallelFor = 274,
};
constexpr uint32_t kApiVersion = 18;  // KernelContext_ParallelFor (the last entry used) exists from 17 on
constexpr int kOrtFail = 1;           // OrtErrorCode ORT_FAIL
constexpr int kFloat = 1, kUint8 = 2;  // ONNXTensorElementDataType

const void* const* g_api = nullptr;

template <typename F>
F api(ApiEntry e) { return reinterpret_cast<F>(const_cast<void*>(g_api[e])); }

OrtStatus* fail(const std::string& msg) {
  return api<OrtStatus* (*)(int, const char*)>(kCreateStatus)(kOrtFail, msg.c_str());
}

#define RETURN_IF(call) \
  do {                  \
    OrtStatus* st_ = (call); \
    if (st_) return st_;     \
  } while (0)

OrtStatus* tensor_shape(const OrtValue* v, std::vector<int64_t>& dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF(api<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(v, &info));
  size_t n = 0;
  OrtStatus* st = api<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &n);
  if (!st) {
    dims.resize(n);
    st = api<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, dims.data(), n);
  }
  api<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  return st;
}

template <typename T>
OrtStatus* tensor_data(const OrtValue* v, T** out) {
  void* p = nullptr;
  RETURN_IF(api<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(v), &p));
  *out = static_cast<T*>(p);
  return nullptr;
}

// ---- the kernel ----

constexpr int kTile = 16;      // output columns per zmm of int32 / fp32 lanes
constexpr int kTilesPer = 2;   // tiles sharing one broadcast activation word
constexpr int kRowsPer = 4;    // rows sharing one unpacked weight register

struct PackedWeights {
  int N = 0, K = 0, block = 0, nblk = 0, ntiles = 0;
  int Kp = 0;  // K padded to whole blocks (MatMulNBits pads the last block)
  // per tile, per block, per 8 k: 64 bytes, byte 4j+i = q(col j, k+i) | q(col j, k+4+i) << 4
  std::unique_ptr<uint8_t[], void (*)(void*)> w{nullptr, std::free};
  std::vector<float> scale;    // per tile, per block: 16 columns each
  std::vector<uint8_t> zero;   // the same, as bytes (a quarter of fp32's: a single row is memory-bound)
};

void pack(PackedWeights& p, int N, int K, int block, const uint8_t* B, const float* S, const uint8_t* Z) {
  p.N = N; p.K = K; p.block = block; p.nblk = (K + block - 1) / block; p.ntiles = N / kTile;
  p.Kp = p.nblk * block;
  const size_t bytes = (size_t)N * p.Kp / 2;
  p.w.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  if (!p.w) throw std::bad_alloc();
  p.scale.resize((size_t)N * p.nblk);
  p.zero.resize((size_t)N * p.nblk);
  const int zp_stride = (p.nblk + 1) / 2;
  for (int t = 0; t < p.ntiles; t++)
    for (int b = 0; b < p.nblk; b++) {
      const size_t tb = (size_t)t * p.nblk + b;
      uint8_t* dst = p.w.get() + tb * (block / 8) * 64;
      for (int j = 0; j < kTile; j++) {
        const int n = t * kTile + j;
        const uint8_t* src = B + ((size_t)n * p.nblk + b) * (block / 2);  // k even in the low nibble
        auto q = [&](int k) -> uint8_t { return (k & 1) ? (src[k / 2] >> 4) : (src[k / 2] & 15); };
        p.scale[tb * kTile + j] = S[(size_t)n * p.nblk + b];
        const uint8_t zb = Z[(size_t)n * zp_stride + b / 2];
        p.zero[tb * kTile + j] = (uint8_t)((b & 1) ? (zb >> 4) : (zb & 15));
        for (int g = 0; g < block / 8; g++)
          for (int i = 0; i < 4; i++)
            dst[g * 64 + 4 * j + i] = (uint8_t)(q(8 * g + i) | (q(8 * g + 4 + i) << 4));
      }
    }
}

struct QuantizedRows {  // the activations, per row and block
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

void quantize_rows(QuantizedRows& out, const float* A, int64_t M, int K, int block) {
  const int nblk = (K + block - 1) / block, Kp = nblk * block;  // a short last block reads as zeros
  out.q.resize((size_t)M * Kp);
  out.scale.resize((size_t)M * nblk);
  out.sum.resize((size_t)M * nblk);
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; m++)
    for (int b = 0; b < nblk; b++) {
      const float* a = A + m * K + (size_t)b * block;
      const int valid = std::min(block, K - b * block);
      auto load = [&](int k) {
        const int n = std::clamp(valid - k, 0, 16);
        return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), a + k);
      };
      __m512 mx = _mm512_setzero_ps();
      for (int k = 0; k < block; k += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(load(k), abs_mask));
      const float amax = _mm512_reduce_max_ps(mx);
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
      __m512i sum = _mm512_setzero_si512();
      int8_t* q = out.q.data() + m * Kp + (size_t)b * block;
      for (int k = 0; k < block; k += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load(k), inv));  // nearest, ties to even
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(v));
      }
      out.scale[m * nblk + b] = amax / 127.f;
      out.sum[m * nblk + b] = (float)_mm512_reduce_add_epi32(sum);
    }
}

template <int T, int R>
inline void tiles_rows(const PackedWeights& p, const QuantizedRows& a, int t0, int64_t m0, float* C) {
  const int nblk = p.nblk, block = p.block, K = p.Kp;  // rows of qa are padded to whole blocks
  const size_t tile_bytes = (size_t)nblk * (block / 8) * 64;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[T][R];
  for (int i = 0; i < T; i++)
    for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
  for (int b = 0; b < nblk; b++) {
    __m512i dot[T][R];
    for (int i = 0; i < T; i++)
      for (int r = 0; r < R; r++) dot[i][r] = _mm512_setzero_si512();
    const uint8_t* wp = p.w.get() + ((size_t)t0 * nblk + b) * (block / 8) * 64;
    const int8_t* ap = a.q.data() + m0 * K + (size_t)b * block;
    for (int g = 0; g < block / 8; g++) {
      __m512i w[T][2];
      for (int i = 0; i < T; i++) {
        _mm_prefetch(reinterpret_cast<const char*>(wp + i * tile_bytes + g * 64 + 2048), _MM_HINT_T0);
        const __m512i v = _mm512_load_si512(wp + i * tile_bytes + g * 64);
        w[i][0] = _mm512_and_si512(v, low4);
        w[i][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) {
          int32_t word;
          std::memcpy(&word, ap + (size_t)r * K + g * 8 + h * 4, 4);
          const __m512i x = _mm512_set1_epi32(word);
          for (int i = 0; i < T; i++) dot[i][r] = _mm512_dpbusd_epi32(dot[i][r], w[i][h], x);
        }
    }
    for (int i = 0; i < T; i++) {
      const size_t tb = (size_t)(t0 + i) * nblk + b;
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.zero.data() + tb * kTile))));
      const __m512 s = _mm512_loadu_ps(p.scale.data() + tb * kTile);
      for (int r = 0; r < R; r++) {
        const size_t mb = (size_t)(m0 + r) * nblk + b;
        const __m512 x = _mm512_fnmadd_ps(z, _mm512_set1_ps(a.sum[mb]), _mm512_cvtepi32_ps(dot[i][r]));
        acc[i][r] = _mm512_fmadd_ps(x, _mm512_mul_ps(s, _mm512_set1_ps(a.scale[mb])), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < T; i++)
    for (int r = 0; r < R; r++) _mm512_storeu_ps(C + (m0 + r) * p.N + (size_t)(t0 + i) * kTile, acc[i][r]);
}

template <int T>
void tiles_all_rows(const PackedWeights& p, const QuantizedRows& a, int t0, int64_t M, float* C) {
  int64_t m = 0;
  for (; m + kRowsPer <= M; m += kRowsPer) tiles_rows<T, kRowsPer>(p, a, t0, m, C);
  for (; m < M; m++) tiles_rows<T, 1>(p, a, t0, m, C);
}

// columns [t_begin, t_end) tiles of every row
void gemm_tiles(const PackedWeights& p, const QuantizedRows& a, int64_t M, float* C, int t_begin, int t_end) {
  int t = t_begin;
  for (; t + kTilesPer <= t_end; t += kTilesPer) tiles_all_rows<kTilesPer>(p, a, t, M, C);
  for (; t < t_end; t++) tiles_all_rows<1>(p, a, t, M, C);
}

// ---- the custom operator ----

struct Kernel {
  PackedWeights w;
};

struct CustomOp;

struct Work {
  const PackedWeights* w;
  const QuantizedRows* a;
  int64_t M;
  float* C;
  int tiles_per_item;
};

void run_item(void* data, size_t i) {
  const Work& job = *static_cast<Work*>(data);
  const int begin = (int)i * job.tiles_per_item;
  gemm_tiles(*job.w, *job.a, job.M, job.C, begin, std::min(job.w->ntiles, begin + job.tiles_per_item));
}

OrtStatus* create_kernel(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  int64_t K = 0, N = 0, bits = 0, block = 0;
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  RETURN_IF(attr(info, "K", &K));
  RETURN_IF(attr(info, "N", &N));
  RETURN_IF(attr(info, "bits", &bits));
  RETURN_IF(attr(info, "block_size", &block));
  if (bits != 4 || block % 32 != 0 || N % kTile != 0)
    return fail("ruvllm.MatMulQ4: needs bits=4, block_size a multiple of 32, N a multiple of 16");
  const OrtValue* consts[4] = {};
  auto constant = api<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(kKernelInfoGetConstantInput_tensor);
  for (size_t i = 1; i < 4; i++) {
    int is_const = 0;
    RETURN_IF(constant(info, i, &is_const, &consts[i]));
    if (!is_const) return fail("ruvllm.MatMulQ4: weights, scales and zero points must be initializers");
  }
  const uint8_t *B = nullptr, *Z = nullptr;
  const float* S = nullptr;
  RETURN_IF(tensor_data(consts[1], &B));
  RETURN_IF(tensor_data(consts[2], &S));
  RETURN_IF(tensor_data(consts[3], &Z));
  std::vector<int64_t> dims;
  RETURN_IF(tensor_shape(consts[1], dims));
  const int64_t nblk = (K + block - 1) / block;
  if (dims.size() != 3 || dims[0] != N || dims[1] != nblk || dims[2] != block / 2)
    return fail("ruvllm.MatMulQ4: B is not [N, K/block_size, block_size/2]");
  RETURN_IF(tensor_shape(consts[2], dims));
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  if (count != N * nblk) return fail("ruvllm.MatMulQ4: scales are not N * K/block_size");
  RETURN_IF(tensor_shape(consts[3], dims));
  count = 1;
  for (int64_t d : dims) count *= d;
  if (count != N * ((nblk + 1) / 2)) return fail("ruvllm.MatMulQ4: zero points are not packed 4-bit");
  auto* k = new (std::nothrow) Kernel();
  if (!k) return fail("ruvllm.MatMulQ4: out of memory");
  try {
    pack(k->w, (int)N, (int)K, (int)block, B, S, Z);
  } catch (const std::bad_alloc&) {
    delete k;
    return fail("ruvllm.MatMulQ4: out of memory packing weights");
  }
  *out = k;
  return nullptr;
}

OrtStatus* compute_rows(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<Kernel*>(kernel);
  const PackedWeights& w = k.w;
  const OrtValue* in = nullptr;
  RETURN_IF(api<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput)(ctx, 0, &in));
  std::vector<int64_t> dims;
  RETURN_IF(tensor_shape(in, dims));
  if (dims.empty() || dims.back() != w.K) return fail("ruvllm.MatMulQ4: A's last dimension is not K");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < dims.size(); i++) M *= dims[i];
  dims.back() = w.N;
  OrtValue* out = nullptr;
  RETURN_IF(api<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContext_GetOutput)(
      ctx, 0, dims.data(), dims.size(), &out));
  const float* A = nullptr;
  float* C = nullptr;
  RETURN_IF(tensor_data(in, &A));
  RETURN_IF(tensor_data(out, &C));
  if (M == 0) return nullptr;
  thread_local QuantizedRows rows;  // one session may run on several threads at once
  quantize_rows(rows, A, M, w.K, w.block);
  Work job{&w, &rows, M, C, 8};
  // items of 8 tiles (128 columns); a small product stays on this thread, where a handoff costs more
  const size_t items = (size_t)(w.ntiles + job.tiles_per_item - 1) / job.tiles_per_item;
  if (items == 1 || (double)M * w.N * w.K < 2e5) {
    gemm_tiles(w, rows, M, C, 0, w.ntiles);
    return nullptr;
  }
  return api<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      kKernelContext_ParallelFor)(ctx, run_item, items, 0, &job);
}

OrtStatus* compute(void* kernel, OrtKernelContext* ctx) {
  try {  // nothing may unwind into onnxruntime
    return compute_rows(kernel, ctx);
  } catch (const std::bad_alloc&) {
    return fail("ruvllm.MatMulQ4: out of memory");
  }
}

// onnxruntime's OrtCustomOp, version 18 layout
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void*, const OrtKernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  int (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  int (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  OrtStatus* (*CreateKernelV2)(const CustomOp*, const void*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const CustomOp*, void*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

CustomOp make_op() {
  CustomOp op{};
  op.version = kApiVersion;
  op.CreateKernel = [](const CustomOp* self, const void* a, const OrtKernelInfo* info) -> void* {
    void* k = nullptr;
    OrtStatus* st = create_kernel(self, a, info, &k);
    return st ? nullptr : k;  // the V1 entry cannot report errors; onnxruntime calls V2
  };
  op.GetName = [](const CustomOp*) { return "MatMulQ4"; };
  op.GetExecutionProviderType = [](const CustomOp*) { return "CPUExecutionProvider"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return (i == 1 || i == 3) ? kUint8 : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 4; };
  op.GetOutputType = [](const CustomOp*, size_t) { return kFloat; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 1; };
  op.KernelCompute = [](void* k, OrtKernelContext* ctx) { (void)compute(k, ctx); };
  op.KernelDestroy = [](void* k) { delete static_cast<Kernel*>(k); };
  op.GetInputCharacteristic = [](const CustomOp*, size_t) { return 0; };   // required
  op.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };
  op.GetInputMemoryType = [](const CustomOp*, size_t) { return 0; };       // OrtMemTypeDefault
  op.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.InferOutputShapeFn = nullptr;
  op.GetStartVersion = [](const CustomOp*) { return 1; };
  op.GetEndVersion = [](const CustomOp*) { return INT_MAX; };
  op.GetMayInplace = [](int**, int**) -> size_t { return 0; };
  op.ReleaseMayInplace = [](int*, int*) {};
  op.GetAliasMap = [](int**, int**) -> size_t { return 0; };
  op.ReleaseAliasMap = [](int*, int*) {};
  return op;
}

CustomOp g_op = make_op();

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const void* table = base->GetApi(kApiVersion);
  if (!table) return nullptr;  // an onnxruntime older than 1.17 has no ParallelFor; nothing registered
  g_api = static_cast<const void* const*>(table);
  OrtCustomOpDomain* domain = nullptr;  // kept for the process's life, as sessions refer to it
  RETURN_IF(api<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ruvllm", &domain));
  RETURN_IF(api<OrtStatus* (*)(OrtCustomOpDomain*, const CustomOp*)>(kCustomOpDomain_Add)(domain, &g_op));
  return api<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}

// For the library's own test: the kernel on plain buffers, without onnxruntime.
__attribute__((visibility("default"))) int ruvllm_q4_matmul(const float* A, int64_t M, int K, int N, int block,
                                                          const uint8_t* B, const float* S, const uint8_t* Z, float* C) {
  try {
    PackedWeights w;
    pack(w, N, K, block, B, S, Z);
    QuantizedRows rows;
    quantize_rows(rows, A, M, K, block);
    gemm_tiles(w, rows, M, C, 0, w.ntiles);
  } catch (...) {
    return 1;
  }
  return 0;
}

}  // extern "C"
