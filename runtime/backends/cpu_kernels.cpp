// RuvLLM's CPU kernels, as onnxruntime custom operators in the domain `ruvllm` (AVX-512 VNNI):
//
// MatMulQ4 computes what `com.microsoft.MatMulNBits` (bits=4, zero points, fp32 scales, accuracy_level
// 4) does. Why: MLAS's int8-compute kernel costs ~3.5x its one-row time at 16 rows (it unpacks the int4
// weights again for every row), so a batch of 16 decode streams spent most of its step there. Here
// each 16-column tile of weights is unpacked once per block and used for up to 4 rows and 2 tiles per
// broadcast activation word. MatMulQ4SwiGLU pairs each gate tile with its up tile and writes
// silu(gate) * up; MatMulQ4Split writes its columns as two tensors (q+k, v): the Split, Sigmoid and
// Mul operators after those projections, each a pass over their output, are gone.
//
// PagedAttention (further down) reads each row's keys and values from the KV pool's blocks in place.
//
// Arithmetic, per row and per quantization block of `block_size` along K (as MLAS's CompInt8):
// activations a ~ sa * qa (qa int8, symmetric, sa = max|a| / 127), weights w = s * (q - z), so
// a.w = s * sa * (qa.q - z * sum(qa)); qa.q is exact in int32 (vpdpbusd), the rest fp32. Every row is
// computed the same way whatever the batch, so a row's result does not depend on the other rows.
// With a fifth input, the blocks' float minimums m (llama.cpp's Q4_1 and Q4_K, w = s * q + m; zero
// points must then be 0): a.w = s * sa * qa.q + m * sa * sum(qa), the quantized activations' sum (as
// llama.cpp's Q8_1 carries it). Not the fp32 sum: the error would then be e.(w - m) instead of e.w, and
// a Q4_1 block's m sits ~8 steps below its weights (SmolLM2: 2.3x the error per layer, KL 0.018 vs 0.003).
// The exporter writes that as MatMulNBits + a small MatMul over block sums; this is its fused form.
// Scales and minimums are kept as fp16 pairs, one 64-byte line per tile and block (they must be exact
// in fp16, as a GGUF's are), so a block of 32 reads 256 bytes of weights and 64 of scales.
//
// onnxruntime's C API is reached through the function table it hands to RegisterCustomOps. Its
// header is not shipped with the Python wheel, so the few entries used are declared here by their
// fixed position in that table (the table is append-only: an entry never moves between releases);
// tests/runtime/test_cpu_kernels.py checks both operators against what they replace.

#include <immintrin.h>

// The full set (MatMulQ4 and its variants, PagedAttention, SkipRMSNorm) is AVX-512 (BW, VL, VNNI). On a
// CPU with AVX2, FMA and F16C only, the library holds MatMulQ4 and its variants alone, computed with
// AVX2 (vpmaddubsw + vpmaddwd where AVX-512 VNNI has vpdpbusd): the same arithmetic, rows for rows.
// `ruvllm_kernel_ops` says which operators a build has.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define RUVLLM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RUVLLM_AVX512 0
#else
#error "cpu_kernels.cpp needs AVX-512 (F, BW, VL, VNNI) or AVX2 with FMA and F16C"
#endif

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
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
  kKernelInfoGetAttribute_float = 85,
  kKernelInfoGetAttribute_int64 = 86,
  kKernelContext_GetInput = 90,
  kKernelContext_GetOutput = 91,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelInfoGetConstantInput_tensor = 249,
  kKernelContext_ParallelFor = 274,
};
constexpr uint32_t kApiVersion = 18;  // KernelContext_ParallelFor (the last entry used) exists from 17 on
constexpr int kOrtFail = 1;           // OrtErrorCode ORT_FAIL
constexpr int kFloat = 1, kUint8 = 2, kInt64 = 7, kFloat16 = 10;  // ONNXTensorElementDataType

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

// output i of the given shape, allocated by onnxruntime, as floats
OrtStatus* output_data(OrtKernelContext* ctx, size_t i, const int64_t* dims, size_t rank, float** data) {
  OrtValue* v = nullptr;
  RETURN_IF(api<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContext_GetOutput)(
      ctx, i, dims, rank, &v));
  return tensor_data(v, data);
}

#if RUVLLM_AVX512
inline __m512 exp512(__m512 x) {  // e^x, ~1e-7 relative: 2^(x log2 e) as 2^n * 2^f, |f| <= 0.5
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // ln 2^f
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// ---- the kernel ----

constexpr int kTile = 16;      // output columns per zmm of int32 / fp32 lanes
constexpr int kTilesPer = RUVLLM_AVX512 ? 2 : 1;  // tiles sharing one broadcast activation word
constexpr int kRowsPer = 4;    // rows sharing one unpacked weight register

struct PackedWeights {
  int N = 0, K = 0, block = 0, nblk = 0, ntiles = 0;
  int Kp = 0;  // K padded to whole blocks (MatMulNBits pads the last block)
  // per tile, per block, per 8 k: 64 bytes, byte 4j+i = q(col j, k+i) | q(col j, k+4+i) << 4
  std::unique_ptr<uint8_t[], void (*)(void*)> w{nullptr, std::free};
  std::vector<float> scale;    // per tile, per block: 16 columns each
  std::vector<uint8_t> zero;   // the same, as bytes (a quarter of fp32's: a single row is memory-bound)
  bool mins = false;           // minimums mode: scale and zero unused, scale_min holds both
  std::vector<uint16_t> scale_min;  // per tile, per block: 16 fp16 scales, then 16 fp16 minimums
};

inline bool fp16_exact(float x, uint16_t* h) {
  *h = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  return _cvtsh_ss(*h) == x;
}

// M: the minimums, fp16 [K/block, N] (as the exporter's MatMul over block sums reads them), or null
void pack(PackedWeights& p, int N, int K, int block, const uint8_t* B, const float* S, const uint8_t* Z,
          const uint16_t* M = nullptr) {
  p.N = N; p.K = K; p.block = block; p.nblk = (K + block - 1) / block; p.ntiles = N / kTile;
  p.Kp = p.nblk * block;
  const size_t bytes = (size_t)N * p.Kp / 2;
  p.w.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  if (!p.w) throw std::bad_alloc();
  p.mins = M != nullptr;
  if (p.mins) p.scale_min.resize((size_t)N * p.nblk * 2);
  else {
    p.scale.resize((size_t)N * p.nblk);
    p.zero.resize((size_t)N * p.nblk);
  }
  const int zp_stride = (p.nblk + 1) / 2;
  for (int t = 0; t < p.ntiles; t++)
    for (int b = 0; b < p.nblk; b++) {
      const size_t tb = (size_t)t * p.nblk + b;
      uint8_t* dst = p.w.get() + tb * (block / 8) * 64;
      for (int j = 0; j < kTile; j++) {
        const int n = t * kTile + j;
        const uint8_t* src = B + ((size_t)n * p.nblk + b) * (block / 2);  // k even in the low nibble
        auto q = [&](int k) -> uint8_t { return (k & 1) ? (src[k / 2] >> 4) : (src[k / 2] & 15); };
        const uint8_t zb = Z[(size_t)n * zp_stride + b / 2];
        const uint8_t z = (uint8_t)((b & 1) ? (zb >> 4) : (zb & 15));
        if (p.mins) {
          if (z) throw std::invalid_argument("zero points must be 0 where the blocks have minimums");
          if (!fp16_exact(S[(size_t)n * p.nblk + b], &p.scale_min[tb * 2 * kTile + j]))
            throw std::invalid_argument("scales must be exact in fp16 where the blocks have minimums");
          p.scale_min[tb * 2 * kTile + kTile + j] = M[(size_t)b * N + n];
        } else {
          p.scale[tb * kTile + j] = S[(size_t)n * p.nblk + b];
          p.zero[tb * kTile + j] = z;
        }
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

#if RUVLLM_AVX512
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
#else
inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline int hsum_epi32(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1)));
}

void quantize_rows(QuantizedRows& out, const float* A, int64_t M, int K, int block) {
  const int nblk = (K + block - 1) / block, Kp = nblk * block;  // a short last block reads as zeros
  out.q.resize((size_t)M * Kp);
  out.scale.resize((size_t)M * nblk);
  out.sum.resize((size_t)M * nblk);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  std::vector<float> pad(block);
  for (int64_t m = 0; m < M; m++)
    for (int b = 0; b < nblk; b++) {
      const int valid = std::min(block, K - b * block);
      const float* a = A + m * K + (size_t)b * block;
      if (valid < block) {  // the short last block, zero-padded
        std::fill(pad.begin(), pad.end(), 0.f);
        std::copy(a, a + valid, pad.begin());
        a = pad.data();
      }
      __m256 mx = _mm256_setzero_ps();
      for (int k = 0; k < block; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(a + k), abs_mask));
      const float amax = hmax(mx);
      const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.f / amax : 0.f);
      __m256i sum = _mm256_setzero_si256();
      int8_t* q = out.q.data() + m * Kp + (size_t)b * block;
      for (int k = 0; k < block; k += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + k), inv));  // nearest, ties to even
        sum = _mm256_add_epi32(sum, v);
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w16, w16));
      }
      out.scale[m * nblk + b] = amax / 127.f;
      out.sum[m * nblk + b] = (float)hsum_epi32(sum);
    }
}
#endif

// Where output tile t's 16 columns of row m go: tiles before `split` to c0 (row stride ld0), the rest
// to c1 (MatMulQ4Split: the q/k and v parts of a fused projection as two tensors, no Split copying).
struct Output {
  float *c0, *c1;
  int64_t ld0, ld1;
  int split;
  float* at(int64_t m, int t) const {
    return t < split ? c0 + m * ld0 + (int64_t)t * kTile : c1 + m * ld1 + (int64_t)(t - split) * kTile;
  }
};

#if RUVLLM_AVX512
inline __m512 silu(__m512 x) { return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)))); }
#else
inline __m256 exp256(__m256 x) {  // as exp512, 2^n built in the exponent bits (x clamped so n fits)
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147181f));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline __m256 silu(__m256 x) { return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)))); }
#endif

// What a group of rows prefetches while it computes a tile group. The weights' scales and zero points
// are arrays apart from the weights, a line per tile and block that the hardware does not fetch ahead:
// left to demand misses they stalled each block of the first row group, most of what a 16-32 row
// product paid beyond its arithmetic when the weights come from DRAM.
//   kAhead (the first row group, which streams the tiles in): the weights 2 KB ahead, scales and zero
//     points 4 blocks ahead;
//   kNext (the second row group): the next tile group's weights, scales and zero points, so its first
//     row group finds them in cache (a thread's work items are consecutive tile groups);
//   kNone (the rest: the tiles are in L1 by then).
enum class Prefetch { kAhead, kNext, kNone };

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_row(const float* row, int lines) {  // lines of 16 floats
  for (int d = 0; d < lines; d++) prefetch(row + 16 * d);
}

// T tiles (weight tiles t0 + i * stride) x R rows. SwiGLU: T = 2, tile t0 of the gate half and its
// partner of the up half, stored as one tile silu(gate) * up (MatMulQ4SwiGLU: no Split, Sigmoid, Muls).
// `next`: how far the next tile group starts (in tiles), for Prefetch::kNext.
#if RUVLLM_AVX512
template <int T, int R, bool SwiGLU, Prefetch F, bool Mins>
inline void tiles_rows(const PackedWeights& p, const QuantizedRows& a, int t0, int64_t m0, const Output& out,
                       int stride, int next) {
  const int nblk = p.nblk, block = p.block, K = p.Kp;  // rows of qa are padded to whole blocks
  const size_t tile_bytes = (size_t)nblk * (block / 8) * 64;
  const size_t last_block = (size_t)p.ntiles * nblk - 1;
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
    if constexpr (F != Prefetch::kNone)
      for (int i = 0; i < T; i++) {
        const size_t tb = std::min(last_block, (size_t)(t0 + i * stride + (F == Prefetch::kNext ? next : 0)) * nblk + b +
                                                   (F == Prefetch::kAhead ? 4 : 0));
        if constexpr (Mins) {
          prefetch(p.scale_min.data() + tb * 2 * kTile);
        } else {
          prefetch(p.scale.data() + tb * kTile);
          prefetch(p.zero.data() + tb * kTile);
        }
      }
    for (int g = 0; g < block / 8; g++) {
      __m512i w[T][2];
      for (int i = 0; i < T; i++) {
        if constexpr (F == Prefetch::kAhead) prefetch(wp + i * stride * tile_bytes + g * 64 + 2048);
        if constexpr (F == Prefetch::kNext) prefetch(wp + (next + i * stride) * tile_bytes + g * 64);
        const __m512i v = _mm512_load_si512(wp + i * stride * tile_bytes + g * 64);
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
      const size_t tb = (size_t)(t0 + i * stride) * nblk + b;
      if constexpr (Mins) {
        const __m512i sm = _mm512_loadu_si512(p.scale_min.data() + tb * 2 * kTile);
        const __m512 s = _mm512_cvtph_ps(_mm512_castsi512_si256(sm));
        const __m512 mn = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sm, 1));
        for (int r = 0; r < R; r++) {
          const size_t mb = (size_t)(m0 + r) * nblk + b;
          acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][r]), _mm512_mul_ps(s, _mm512_set1_ps(a.scale[mb])), acc[i][r]);
          acc[i][r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.scale[mb] * a.sum[mb]), acc[i][r]);
        }
        continue;
      }
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.zero.data() + tb * kTile))));
      const __m512 s = _mm512_loadu_ps(p.scale.data() + tb * kTile);
      for (int r = 0; r < R; r++) {
        const size_t mb = (size_t)(m0 + r) * nblk + b;
        const __m512 x = _mm512_fnmadd_ps(z, _mm512_set1_ps(a.sum[mb]), _mm512_cvtepi32_ps(dot[i][r]));
        acc[i][r] = _mm512_fmadd_ps(x, _mm512_mul_ps(s, _mm512_set1_ps(a.scale[mb])), acc[i][r]);
      }
    }
  }
  if constexpr (SwiGLU) {
    static_assert(T == 2);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out.at(m0 + r, t0), _mm512_mul_ps(silu(acc[0][r]), acc[1][r]));
  } else {
    for (int i = 0; i < T; i++)
      for (int r = 0; r < R; r++) _mm512_storeu_ps(out.at(m0 + r, t0 + i), acc[i][r]);
  }
}

#else
// AVX2: a tile's 16 columns are two halves of 8 (bytes 0-31 and 32-63 of each 64-byte group); a byte pair
// product sum (vpmaddubsw: weight 0..15 times activation -127..127, twice: no int16 saturation) then
// summed in pairs into int32 (vpmaddwd by ones) is vpdpbusd's result. Tiles go one after another within
// a block, so that R rows' accumulators stay in the 16 registers.
template <int T, int R, bool SwiGLU, Prefetch F, bool Mins>
inline void tiles_rows(const PackedWeights& p, const QuantizedRows& a, int t0, int64_t m0, const Output& out,
                       int stride, int next) {
  const int nblk = p.nblk, block = p.block, K = p.Kp;
  const size_t tile_bytes = (size_t)nblk * (block / 8) * 64;
  const size_t last_block = (size_t)p.ntiles * nblk - 1;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[T][R][2];
  for (int i = 0; i < T; i++)
    for (int r = 0; r < R; r++) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_ps();
  for (int b = 0; b < nblk; b++) {
    const int8_t* ap = a.q.data() + m0 * K + (size_t)b * block;
    for (int i = 0; i < T; i++) {
      const size_t tb = (size_t)(t0 + i * stride) * nblk + b;
      const uint8_t* wp = p.w.get() + tb * (block / 8) * 64;
      if constexpr (F != Prefetch::kNone) {
        const size_t ahead = std::min(last_block, (size_t)(t0 + i * stride + (F == Prefetch::kNext ? next : 0)) * nblk + b +
                                                      (F == Prefetch::kAhead ? 4 : 0));
        if constexpr (Mins) prefetch(p.scale_min.data() + ahead * 2 * kTile);
        else {
          prefetch(p.scale.data() + ahead * kTile);
          prefetch(p.zero.data() + ahead * kTile);
        }
      }
      __m256i dot[R][2];
      for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int g = 0; g < block / 8; g++) {
        if constexpr (F == Prefetch::kAhead) prefetch(wp + g * 64 + 2048);
        if constexpr (F == Prefetch::kNext) prefetch(wp + next * tile_bytes + g * 64);
        const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + g * 64));
        const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + g * 64 + 32));
        for (int h = 0; h < 2; h++) {
          const __m256i w0 = h ? _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4) : _mm256_and_si256(v0, low4);
          const __m256i w1 = h ? _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4) : _mm256_and_si256(v1, low4);
          for (int r = 0; r < R; r++) {
            int32_t word;
            std::memcpy(&word, ap + (size_t)r * K + g * 8 + h * 4, 4);
            const __m256i x = _mm256_set1_epi32(word);
            dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x), ones));
            dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x), ones));
          }
        }
      }
      for (int c = 0; c < 2; c++) {
        __m256 s, z_or_min;
        if constexpr (Mins) {
          const uint16_t* sm = p.scale_min.data() + tb * 2 * kTile;
          s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + 8 * c)));
          z_or_min = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + kTile + 8 * c)));
        } else {
          s = _mm256_loadu_ps(p.scale.data() + tb * kTile + 8 * c);
          z_or_min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.zero.data() + tb * kTile + 8 * c))));
        }
        for (int r = 0; r < R; r++) {
          const size_t mb = (size_t)(m0 + r) * nblk + b;
          const __m256 d = _mm256_cvtepi32_ps(dot[r][c]);
          if constexpr (Mins) {
            acc[i][r][c] = _mm256_fmadd_ps(d, _mm256_mul_ps(s, _mm256_set1_ps(a.scale[mb])), acc[i][r][c]);
            acc[i][r][c] = _mm256_fmadd_ps(z_or_min, _mm256_set1_ps(a.scale[mb] * a.sum[mb]), acc[i][r][c]);
          } else {
            const __m256 x = _mm256_fnmadd_ps(z_or_min, _mm256_set1_ps(a.sum[mb]), d);
            acc[i][r][c] = _mm256_fmadd_ps(x, _mm256_mul_ps(s, _mm256_set1_ps(a.scale[mb])), acc[i][r][c]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 2; c++) {
      if constexpr (SwiGLU) {
        static_assert(T == 2);
        _mm256_storeu_ps(out.at(m0 + r, t0) + 8 * c, _mm256_mul_ps(silu(acc[0][r][c]), acc[1][r][c]));
      } else {
        for (int i = 0; i < T; i++) _mm256_storeu_ps(out.at(m0 + r, t0 + i) + 8 * c, acc[i][r][c]);
      }
    }
}
#endif

template <int T, bool SwiGLU, bool Mins>
void tiles_all_rows(const PackedWeights& p, const QuantizedRows& a, int t0, int64_t M, const Output& out, int stride) {
  const int next = SwiGLU ? 1 : T;  // the next tile group: the next gate tile (and its up partner), or the next T
  const bool has_next = t0 + next < (SwiGLU ? stride : p.ntiles);
  int64_t m = 0;
  for (; m + kRowsPer <= M; m += kRowsPer) {
    if (m == 0) tiles_rows<T, kRowsPer, SwiGLU, Prefetch::kAhead, Mins>(p, a, t0, m, out, stride, next);
    else if (m == kRowsPer && has_next) tiles_rows<T, kRowsPer, SwiGLU, Prefetch::kNext, Mins>(p, a, t0, m, out, stride, next);
    else tiles_rows<T, kRowsPer, SwiGLU, Prefetch::kNone, Mins>(p, a, t0, m, out, stride, next);
  }
  // the last 1-3 rows as one group: row by row, each would unpack the weights again (2 rows cost ~1.3x 4)
  auto tail = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if (m == 0) tiles_rows<T, R, SwiGLU, Prefetch::kAhead, Mins>(p, a, t0, m, out, stride, next);
    else tiles_rows<T, R, SwiGLU, Prefetch::kNone, Mins>(p, a, t0, m, out, stride, next);
  };
  switch (M - m) {
    case 1: return tail(std::integral_constant<int, 1>{});
    case 2: return tail(std::integral_constant<int, 2>{});
    case 3: return tail(std::integral_constant<int, 3>{});
    default: return;
  }
}

// output tiles [t_begin, t_end) of every row (with SwiGLU, an output tile is a gate tile and its up tile)
template <bool Mins>
void gemm_tiles_as(const PackedWeights& p, const QuantizedRows& a, int64_t M, const Output& out, int t_begin,
                   int t_end, bool swiglu) {
  int t = t_begin;
  if (swiglu) {
    for (; t < t_end; t++) tiles_all_rows<2, true, Mins>(p, a, t, M, out, p.ntiles / 2);
    return;
  }
  for (; t + kTilesPer <= t_end; t += kTilesPer) tiles_all_rows<kTilesPer, false, Mins>(p, a, t, M, out, 1);
  for (; t < t_end; t++) tiles_all_rows<1, false, Mins>(p, a, t, M, out, 1);
}

void gemm_tiles(const PackedWeights& p, const QuantizedRows& a, int64_t M, const Output& out, int t_begin, int t_end,
                bool swiglu) {
  if (p.mins) gemm_tiles_as<true>(p, a, M, out, t_begin, t_end, swiglu);
  else gemm_tiles_as<false>(p, a, M, out, t_begin, t_end, swiglu);
}

// ---- the custom operator ----

enum class Epilogue { kOne, kSplit, kSwiGLU };  // MatMulQ4, MatMulQ4Split, MatMulQ4SwiGLU

struct Kernel {
  PackedWeights w;
  Epilogue epilogue = Epilogue::kOne;
  int64_t split = 0;  // MatMulQ4Split: columns of the first output
};

struct CustomOp;
extern const CustomOp g_matmul_split, g_matmul_swiglu;

struct Work {
  const PackedWeights* w;
  const QuantizedRows* a;
  int64_t M;
  Output out;
  int tiles, tiles_per_item;
  bool swiglu;
};

void run_item(void* data, size_t i) {
  const Work& job = *static_cast<Work*>(data);
  const int begin = (int)i * job.tiles_per_item;
  gemm_tiles(*job.w, *job.a, job.M, job.out, begin, std::min(job.tiles, begin + job.tiles_per_item), job.swiglu);
}

OrtStatus* create_kernel(const CustomOp* op, const void*, const OrtKernelInfo* info, void** out) {
  int64_t K = 0, N = 0, bits = 0, block = 0;
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  RETURN_IF(attr(info, "K", &K));
  RETURN_IF(attr(info, "N", &N));
  RETURN_IF(attr(info, "bits", &bits));
  RETURN_IF(attr(info, "block_size", &block));
  if (bits != 4 || block % 32 != 0 || N % kTile != 0)
    return fail("ruvllm.MatMulQ4: needs bits=4, block_size a multiple of 32, N a multiple of 16");
  const OrtValue* consts[5] = {};
  auto constant = api<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(kKernelInfoGetConstantInput_tensor);
  int64_t has_mins = 0;  // set by the graph rewrite on every node (1: a fifth input, the minimums)
  RETURN_IF(attr(info, "mins", &has_mins));
  for (size_t i = 1; i < (has_mins ? 5u : 4u); i++) {
    int is_const = 0;
    RETURN_IF(constant(info, i, &is_const, &consts[i]));
    if (!is_const) return fail("ruvllm.MatMulQ4: weights, scales, zero points and minimums must be initializers");
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
  const uint16_t* Mn = nullptr;
  if (consts[4]) {
    RETURN_IF(tensor_shape(consts[4], dims));
    if (dims.size() != 2 || dims[0] != nblk || dims[1] != N) return fail("ruvllm.MatMulQ4: minimums are not [K/block_size, N]");
    RETURN_IF(tensor_data(consts[4], &Mn));
  }
  const Epilogue epilogue = op == &g_matmul_split ? Epilogue::kSplit : op == &g_matmul_swiglu ? Epilogue::kSwiGLU
                                                                                              : Epilogue::kOne;
  int64_t split = 0;
  if (epilogue == Epilogue::kSplit) {
    RETURN_IF(attr(info, "split", &split));
    if (split <= 0 || split >= N || split % kTile) return fail("ruvllm.MatMulQ4Split: split must be a multiple of 16 in (0, N)");
  }
  if (epilogue == Epilogue::kSwiGLU && N % (2 * kTile)) return fail("ruvllm.MatMulQ4SwiGLU: N must be a multiple of 32");
  auto* k = new (std::nothrow) Kernel();
  if (!k) return fail("ruvllm.MatMulQ4: out of memory");
  k->epilogue = epilogue;
  k->split = split;
  try {
    pack(k->w, (int)N, (int)K, (int)block, B, S, Z, Mn);
  } catch (const std::bad_alloc&) {
    delete k;
    return fail("ruvllm.MatMulQ4: out of memory packing weights");
  } catch (const std::invalid_argument& e) {
    delete k;
    return fail(std::string("ruvllm.MatMulQ4: ") + e.what());
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
  auto output = [&](size_t i, int64_t cols, float** data) -> OrtStatus* {
    dims.back() = cols;
    return output_data(ctx, i, dims.data(), dims.size(), data);
  };
  Output out{nullptr, nullptr, w.N, 0, w.ntiles};
  int tiles = w.ntiles;
  if (k.epilogue == Epilogue::kSplit) {
    RETURN_IF(output(0, k.split, &out.c0));
    RETURN_IF(output(1, w.N - k.split, &out.c1));
    out.ld0 = k.split;
    out.ld1 = w.N - k.split;
    out.split = (int)(k.split / kTile);
  } else if (k.epilogue == Epilogue::kSwiGLU) {
    RETURN_IF(output(0, w.N / 2, &out.c0));
    out.ld0 = w.N / 2;
    tiles = out.split = w.ntiles / 2;
  } else {
    RETURN_IF(output(0, w.N, &out.c0));
  }
  const float* A = nullptr;
  RETURN_IF(tensor_data(in, &A));
  if (M == 0) return nullptr;
  thread_local QuantizedRows rows;  // one session may run on several threads at once
  quantize_rows(rows, A, M, w.K, w.block);
  const bool swiglu = k.epilogue == Epilogue::kSwiGLU;
  // items of 8 weight tiles (128 columns; 4 output tiles with SwiGLU); a small product stays on this
  // thread, where a handoff costs more
  Work job{&w, &rows, M, out, tiles, swiglu ? 4 : 8, swiglu};
  const size_t items = (size_t)(tiles + job.tiles_per_item - 1) / job.tiles_per_item;
  if (items == 1 || (double)M * w.N * w.K < 2e5) {
    gemm_tiles(w, rows, M, out, 0, tiles, swiglu);
    return nullptr;
  }
  return api<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      kKernelContext_ParallelFor)(ctx, run_item, items, 0, &job);
}


#if RUVLLM_AVX512
// ---- paged attention: each row's context read from the KV pool in place ----
//
// Replaces the exported graph's per-layer attention path (gather every row's blocks into a contiguous
// copy, write this step's K/V into it, scores, mask, softmax, weighted values): the copy is what a
// long context costs there. Inputs: qk [N*(Hq+Hkv), D] (token n's query head j at row n*(Hq+Hkv)+j,
// its key head h at n*(Hq+Hkv)+Hq+h, rotated), v [N*Hkv, D], the layer's pools [Hkv, blocks,
// block_size, D] (positions before this step), block_tables [B, max_blocks], query_index [B, S]
// (row b's tokens are query_index[b][0] .. query_index[b][S-1], consecutive), position_ids [N].
// Output [N, Hq*D]. Causal, optionally a sliding window; a row's keys before its first new position
// come from the pool, the rest from this step's rows.

// sc[t] = e^(sc[t] - mx) for t in [first, last]; returns 1 / their sum
inline float exp_in_place(float* sc, int64_t first, int64_t last, float mx) {
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  int64_t t = first;
  for (; t + 16 <= last + 1; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(&sc[t]), vmx));
    _mm512_storeu_ps(&sc[t], e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t <= last) {
    const __mmask16 m = (__mmask16)((1u << (last + 1 - t)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, &sc[t]), vmx));
    _mm512_mask_storeu_ps(&sc[t], m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  return 1.f / _mm512_reduce_add_ps(vsum);
}

struct AttnKernel {
  int64_t num_heads = 0, num_kv_heads = 0, window = 0;
  float scale = 1.f;
};

struct AttnJob {
  const AttnKernel* k;
  const float *qk, *v, *pool_k, *pool_v;
  const int64_t *tables, *qidx, *pos;
  float* out;
  int64_t B, S, MB, NB, bs, D;
  std::atomic<bool> failed{false};
  int64_t N = 0;  // tokens this step
};

// Row b's kv head h (item b * Hkv + h). Its keys and values before the row's first new position (start)
// are in the pool's blocks, the rest are this step's rows.
struct RowHead {
  int64_t Hq, Hkv, G, D, b, h, base, count, start;
  const AttnJob* j;
  const int64_t* table;
  const float *pk, *pv;
  RowHead(const AttnJob& job, size_t item, int64_t head_dim)
      : Hq(job.k->num_heads), Hkv(job.k->num_kv_heads), G(Hq / Hkv), D(head_dim), b((int64_t)item / Hkv),
        h((int64_t)item % Hkv), base(job.qidx[b * job.S]), count(job.qidx[b * job.S + job.S - 1] - base + 1),
        start(job.pos[base]), j(&job), table(job.tables + b * job.MB),
        pk(job.pool_k + h * job.NB * job.bs * D), pv(job.pool_v + h * job.NB * job.bs * D) {}
  int64_t slot(int64_t t) const { return table[t / j->bs] * j->bs + t % j->bs; }  // pool row of position t < start
  const float* key(int64_t t) const {
    return t < start ? pk + slot(t) * D : j->qk + ((base + t - start) * (Hq + Hkv) + Hq + h) * D;
  }
  const float* value(int64_t t) const {
    return t < start ? pv + slot(t) * D : j->v + ((base + t - start) * Hkv + h) * D;
  }
  int64_t lowest(int64_t p) const { return j->k->window > 0 ? std::max<int64_t>(0, p - j->k->window + 1) : 0; }
};

// lane i = the sum of v[i]'s lanes: halves of pairs added level by level (45 operations, no scalar sums)
inline __m512 sum16(const __m512 v[16]) {
  __m512 b[8], c[4];
  for (int k = 0; k < 8; k++)  // per 128 bits: v2k, v2k+1, v2k, v2k+1 (two lanes each)
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; k++) {  // per 128 bits: v4k .. v4k+3, a quarter of each
    const __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// out row g = f[g] * sum over keys lo + u of sc[g * stride + u] * value (+ fp[g] * pre[g], a partial
// result over earlier keys, when pre is given); NG heads share each value row read
template <int DV, int NG>
inline void weigh_values(const RowHead& r, int64_t lo, int64_t nk, const float* sc, int64_t stride, const float* f,
                         const float* const* pre, const float* fp, float* out) {
  __m512 acc[NG][DV];
  for (int g = 0; g < NG; g++)
    for (int d = 0; d < DV; d++) acc[g][d] = _mm512_setzero_ps();
  for (int64_t u = 0; u < nk; u++) {
    const float* vr = r.value(lo + u);
    if (u + 16 < nk) prefetch_row(r.value(lo + u + 16), DV);
    __m512 v[DV];
    for (int d = 0; d < DV; d++) v[d] = _mm512_loadu_ps(vr + 16 * d);
    for (int g = 0; g < NG; g++) {
      const __m512 w = _mm512_set1_ps(sc[g * stride + u]);
      for (int d = 0; d < DV; d++) acc[g][d] = _mm512_fmadd_ps(w, v[d], acc[g][d]);
    }
  }
  for (int g = 0; g < NG; g++) {
    const __m512 s = _mm512_set1_ps(f[g]);
    for (int d = 0; d < DV; d++) {
      __m512 o = _mm512_mul_ps(acc[g][d], s);
      if (pre) o = _mm512_fmadd_ps(_mm512_loadu_ps(pre[g] + 16 * d), _mm512_set1_ps(fp[g]), o);
      _mm512_storeu_ps(out + g * DV * 16 + 16 * d, o);
    }
  }
}

// What attention over part of a query's keys (a shared prefix, or a range of a lone row's keys) left
// for it, per query: sum of e^(score - max) * value (not divided), that sum of e^(score - max), the max.
struct Partial {
  float* o;  // D floats per query
  float *sum, *max;
};

// A lone decode row's keys cut across threads (as flash-decoding does): this part reads keys
// [from, to] of the row's one token and leaves Partial results at slot * G + g, merged afterwards.
struct KeyRange {
  const Partial* into;
  int64_t from, to, slot;
};

// One row's one kv head, few queries (decode, or a token and its drafts): for each token, its G query
// heads' scores 16 keys at a time (a key's D/16 FMAs per head, then one 16-way sum), and the weighted
// values with each value row read once for up to 4 heads. With `shared` (a row of a group sharing its first `from` keys, whose attention over them is in
// `shared`), only keys from `from` on are read here, and the two parts are merged. With `range`,
// only that range's keys, left undivided in its Partial.
template <int DV>
void attend(const AttnJob& j, const RowHead& r, const Partial* shared = nullptr, int64_t from = 0,
            const KeyRange* range = nullptr) {
  constexpr int D = DV * 16;
  const int64_t Hq = r.Hq, Hkv = r.Hkv, G = r.G, h = r.h, base = r.base, count = r.count, start = r.start;
  thread_local std::vector<float> scores, inv, qs, mx, f, fp;
  thread_local std::vector<const float*> pre;
  const __m512 scale = _mm512_set1_ps(j.k->scale);
  for (int64_t s = 0; s < count; s++) {
    const int64_t n = base + s, p = range ? range->to : start + s;
    const int64_t lo = range ? range->from : shared ? from : r.lowest(p), nk = p - lo + 1;
    const int64_t width = (nk + 15) / 16 * 16;
    scores.resize((size_t)G * width);
    inv.resize((size_t)G);
    qs.resize((size_t)G * D);
    mx.assign((size_t)G, -INFINITY);
    for (int64_t g = 0; g < G; g++) {  // the token's query heads, scaled
      const float* qp = j.qk + (n * (Hq + Hkv) + h * G + g) * D;
      for (int d = 0; d < DV; d++) _mm512_storeu_ps(&qs[g * D + 16 * d], _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * d), scale));
    }
    for (int64_t t0 = 0; t0 < nk; t0 += 16) {  // 16 keys at a time for every head: read from memory once
      const int nt = (int)std::min<int64_t>(16, nk - t0);
      const float* kr[16];
      for (int i = 0; i < nt; i++) kr[i] = r.key(lo + t0 + i);
      for (int64_t i = t0 + 16; i < std::min(nk, t0 + 32); i++) prefetch_row(r.key(lo + i), DV);  // a pool block apart
      const __mmask16 valid = (__mmask16)((1u << nt) - 1);
      for (int64_t g = 0; g < G; g++) {
        __m512 q[DV], part[16];
        for (int d = 0; d < DV; d++) q[d] = _mm512_loadu_ps(&qs[g * D + 16 * d]);
        for (int i = 0; i < nt; i++) {
          part[i] = _mm512_mul_ps(q[0], _mm512_loadu_ps(kr[i]));
          for (int d = 1; d < DV; d++) part[i] = _mm512_fmadd_ps(q[d], _mm512_loadu_ps(kr[i] + 16 * d), part[i]);
        }
        for (int i = nt; i < 16; i++) part[i] = _mm512_setzero_ps();
        const __m512 v = sum16(part);
        _mm512_storeu_ps(&scores[g * width + t0], v);
        mx[g] = std::max(mx[g], _mm512_mask_reduce_max_ps(valid, v));
      }
    }
    for (int64_t g = 0; g < G; g++) inv[g] = exp_in_place(&scores[g * width], 0, nk - 1, mx[g]);
    f.resize((size_t)G);
    fp.resize((size_t)G);
    pre.resize((size_t)G);
    for (int64_t g = 0; g < G; g++) {
      f[g] = range ? 1.f : inv[g];
      if (range) {
        range->into->max[range->slot * G + g] = mx[g];
        range->into->sum[range->slot * G + g] = 1.f / inv[g];
      }
      if (!shared) continue;
      const int64_t q = n * Hq + h * G + g;  // merge: both parts rescaled to the larger max
      const float m = std::max(mx[g], shared->max[q]);
      const float a = std::exp(mx[g] - m), b = std::exp(shared->max[q] - m);
      const float denom = a / inv[g] + b * shared->sum[q];
      f[g] = a / denom;
      fp[g] = b / denom;
      pre[g] = shared->o + q * D;
    }
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      float* o = range ? range->into->o + (range->slot * G + g0) * D : j.out + n * Hq * D + (h * G + g0) * D;
      const float* sc = &scores[g0 * width];
      const float* const* pp = shared ? &pre[g0] : nullptr;
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: weigh_values<DV, 1>(r, lo, nk, sc, width, &f[g0], pp, &fp[g0], o); break;
        case 2: weigh_values<DV, 2>(r, lo, nk, sc, width, &f[g0], pp, &fp[g0], o); break;
        case 3: weigh_values<DV, 3>(r, lo, nk, sc, width, &f[g0], pp, &fp[g0], o); break;
        default: weigh_values<DV, 4>(r, lo, nk, sc, width, &f[g0], pp, &fp[g0], o);
      }
    }
  }
}

// r[i] = row i of a 16x16 block in, column i out
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {  // lane j of r[4i+k]: rows 4i..4i+3 of column 4j+k
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  __m512 out[16];
  for (int k = 0; k < 4; k++) {
    const __m512 ab_lo = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), ab_hi = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    const __m512 cd_lo = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88), cd_hi = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    out[k] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    out[8 + k] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    out[4 + k] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    out[12 + k] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; i++) r[i] = out[i];
}

// The same for many queries at once (a prefill chunk: tokens x G heads >= 16): the row's keys are
// first transposed 16 at a time into [D][16] (one parallel pass over all such rows, before any query), so a
// query's 16 scores are D broadcast FMAs with no horizontal sums; queries then go in groups of up to
// QG, each group a work item of its own, so one long prompt keeps every thread busy.
constexpr int64_t QG = 24;  // a multiple of the score and value row groups (8, 6)

// keys key0 + 16c .. +15 (zeros past `last`) for c in [c_begin, c_end), into kt (block c at kt + c * D * 16)
template <int DV>
void transpose_keys(const RowHead& r, int64_t key0, int64_t last, float* kt, int64_t c_begin, int64_t c_end) {
  constexpr int D = DV * 16;
  for (int64_t c = c_begin; c < c_end; c++) {
    float* dst = kt + c * D * 16;
    const float* rows[16];
    for (int64_t i = 0; i < 16; i++) rows[i] = key0 + c * 16 + i <= last ? r.key(key0 + c * 16 + i) : nullptr;
    for (int64_t i = 0; i < 16 && key0 + c * 16 + 16 + i <= last; i++)  // the next 16 keys: a pool block apart
      prefetch_row(r.key(key0 + c * 16 + 16 + i), DV);
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 block[16];
      for (int i = 0; i < 16; i++) block[i] = rows[i] ? _mm512_loadu_ps(rows[i] + d0) : _mm512_setzero_ps();
      transpose16(block);
      for (int d = 0; d < 16; d++) _mm512_storeu_ps(&dst[(d0 + d) * 16], block[d]);
    }
  }
}

constexpr int kScoreRows = 8;  // queries per score_blocks call

// scores of up to kScoreRows queries (q: rows of D; all kScoreRows rows are read) against NB blocks of
// 16 transposed keys, into rows of `stride`
template <int D, int NB>
inline void score_blocks(const float* q, const float* blk, float* out, int64_t stride, int64_t nr) {
  __m512 acc[kScoreRows][NB];
  for (int r = 0; r < kScoreRows; r++)
    for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
  for (int d = 0; d < D; d++) {
    __m512 k[NB];
    for (int b = 0; b < NB; b++) k[b] = _mm512_loadu_ps(blk + (b * D + d) * 16);
    for (int r = 0; r < kScoreRows; r++) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]);
      for (int b = 0; b < NB; b++) acc[r][b] = _mm512_fmadd_ps(x, k[b], acc[r][b]);
    }
  }
  for (int r = 0; r < nr; r++)
    for (int b = 0; b < NB; b++) _mm512_storeu_ps(out + r * stride + 16 * b, acc[r][b]);
}

// the same against `blocks` (1 or 2) blocks
template <int D>
inline void score(const float* q, const float* blk, float* out, int64_t stride, int64_t nr, int64_t blocks) {
  if (blocks == 2)
    score_blocks<D, 2>(q, blk, out, stride, nr);
  else
    score_blocks<D, 1>(q, blk, out, stride, nr);
}

// queries per value row read: as many as keep their accumulators (DV registers each) in registers
template <int DV>
constexpr int kValueRows = std::clamp(24 / DV, 1, 8);

// acc[i] = sum over positions u in [u_lo, u_hi] of sc[i][u] * value(u), for kValueRows queries per value row read
template <int DV>
inline void weigh(const RowHead& r, int64_t u_lo, int64_t u_hi, const float* const* sc, __m512 acc[][DV]) {
  constexpr int NQ = kValueRows<DV>;
  for (int i = 0; i < NQ; i++)
    for (int d = 0; d < DV; d++) acc[i][d] = _mm512_setzero_ps();
  for (int64_t u = u_lo; u <= u_hi; u++) {
    const float* vr = r.value(u);
    if (u + 16 <= u_hi) prefetch_row(r.value(u + 16), DV);
    __m512 v[DV];
    for (int d = 0; d < DV; d++) v[d] = _mm512_loadu_ps(vr + 16 * d);
    for (int i = 0; i < NQ; i++) {
      const __m512 w = _mm512_set1_ps(sc[i][u]);
      for (int d = 0; d < DV; d++) acc[i][d] = _mm512_fmadd_ps(w, v[d], acc[i][d]);
    }
  }
}

// queries q0 .. q0 + nq - 1 of the row's kv head (query i: token i / G, head h * G + i % G)
template <int DV>
void attend_group(const AttnJob& j, const RowHead& r, const float* kt, int64_t key0, int64_t q0, int64_t nq) {
  constexpr int D = DV * 16;
  const int64_t Hq = r.Hq, Hkv = r.Hkv, G = r.G, h = r.h, base = r.base, start = r.start;
  thread_local std::vector<float> qs, scores, inv;
  qs.resize((size_t)(QG + kScoreRows) * D);  // rows past nq are read, not stored
  const int64_t p_first = start + q0 / G, p_last = start + (q0 + nq - 1) / G;
  const int64_t c_first = (r.lowest(p_first) - key0) / 16, lo = key0 + c_first * 16;
  const int64_t width = (p_last - lo + 16) / 16 * 16;
  scores.resize((size_t)nq * width);
  for (int64_t i = 0; i < nq; i++) {  // the group's queries, scaled
    const int64_t qi = q0 + i, n = base + qi / G, head = h * G + qi % G;
    const float* qp = j.qk + (n * (Hq + Hkv) + head) * D;
    for (int d = 0; d < D; d++) qs[i * D + d] = qp[d] * j.k->scale;
  }
  for (int64_t t0 = lo; t0 <= p_last; t0 += 32) {  // 2 key blocks x 8 queries: a key row load serves 8 FMAs
    const float* blk = kt + (t0 - key0) / 16 * D * 16;
    const int64_t blocks = t0 + 16 - lo < width ? 2 : 1;
    for (int64_t i0 = 0; i0 < nq; i0 += kScoreRows) {
      const int64_t nr = std::min<int64_t>(kScoreRows, nq - i0);
      const int64_t p_lo = start + (q0 + i0) / G, p_hi = start + (q0 + i0 + nr - 1) / G;
      if (t0 > p_hi || t0 + 32 <= r.lowest(p_lo)) continue;  // wholly outside these queries' keys
      score<D>(&qs[i0 * D], blk, &scores[i0 * width + (t0 - lo)], width, nr, blocks);
    }
  }
  inv.resize((size_t)nq);
  for (int64_t i = 0; i < nq; i++) {  // softmax of each query's scores; zero outside its keys
    const int64_t p = start + (q0 + i) / G, first = r.lowest(p);
    float* sc = &scores[i * width] - lo;  // sc[t] for t in [lo, lo + width)
    float mx = -INFINITY;
    for (int64_t t = first; t <= p; t++) mx = std::max(mx, sc[t]);
    inv[i] = exp_in_place(sc, first, p, mx);
    std::fill(sc + lo, sc + first, 0.f);
    std::fill(sc + p + 1, sc + lo + width, 0.f);
  }
  constexpr int NQ = kValueRows<DV>;
  for (int64_t i0 = 0; i0 < nq; i0 += NQ) {  // weighted values, NQ queries per value row read
    const int64_t nr = std::min<int64_t>(NQ, nq - i0);
    const int64_t u_lo = r.lowest(start + (q0 + i0) / G), u_hi = start + (q0 + i0 + nr - 1) / G;
    const float* sc[NQ];
    for (int rr = 0; rr < NQ; rr++) sc[rr] = &scores[(i0 + std::min<int64_t>(rr, nr - 1)) * width] - lo;
    __m512 acc[NQ][DV];
    weigh<DV>(r, u_lo, u_hi, sc, acc);
    for (int rr = 0; rr < nr; rr++) {
      const int64_t qi = q0 + i0 + rr, n = base + qi / G, head = h * G + qi % G;
      const __m512 s = _mm512_set1_ps(inv[i0 + rr]);
      float* o = j.out + n * Hq * D + head * D;
      for (int d = 0; d < DV; d++) _mm512_storeu_ps(o + 16 * d, _mm512_mul_ps(acc[rr][d], s));
    }
  }
}

// Decode rows whose first `keys` positions are the same pool blocks (a prompt prefix they share through
// the prefix cache): their queries attend to those keys together, each key block read and transposed
// once for all of them, as a prefill chunk's are (cascade attention); each row then reads only its own
// later keys and merges the two parts.
struct SharedGroup {
  std::vector<int64_t> rows;
  int64_t keys = 0;  // a multiple of 16
  float* kt = nullptr;  // kv head h's transposed keys at kt + h * keys * D
};

// Queries q0 .. q0 + nq - 1 of a group's kv head h (query i: row rows[i / G]'s one token, head
// h * G + i % G) over the group's shared keys: Partial results.
template <int DV>
void attend_shared(const AttnJob& j, const SharedGroup& grp, int64_t h, int64_t q0, int64_t nq, const Partial& out) {
  constexpr int D = DV * 16;
  const int64_t Hq = j.k->num_heads, Hkv = j.k->num_kv_heads, G = Hq / Hkv, keys = grp.keys;
  const float* kt = grp.kt + h * keys * D;
  const RowHead r(j, (size_t)(grp.rows[0] * Hkv + h), D);  // the pool rows of the shared positions
  thread_local std::vector<float> qs, scores;
  qs.resize((size_t)(QG + kScoreRows) * D);  // rows past nq are read, not stored
  scores.resize((size_t)nq * keys);
  auto query = [&](int64_t i) { return j.qidx[grp.rows[(q0 + i) / G] * j.S] * Hq + h * G + (q0 + i) % G; };
  for (int64_t i = 0; i < nq; i++) {
    const int64_t q = query(i), n = q / Hq, head = q % Hq;
    const float* qp = j.qk + (n * (Hq + Hkv) + head) * D;
    for (int d = 0; d < D; d++) qs[i * D + d] = qp[d] * j.k->scale;
  }
  for (int64_t t0 = 0; t0 < keys; t0 += 32)
    for (int64_t i0 = 0; i0 < nq; i0 += kScoreRows)
      score<D>(&qs[i0 * D], kt + t0 * D, &scores[i0 * keys + t0], keys, std::min<int64_t>(kScoreRows, nq - i0),
               t0 + 16 < keys ? 2 : 1);
  for (int64_t i = 0; i < nq; i++) {
    float* sc = &scores[i * keys];
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < keys; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(sc + t));
    const int64_t q = query(i);
    out.max[q] = _mm512_reduce_max_ps(vmx);
    out.sum[q] = 1.f / exp_in_place(sc, 0, keys - 1, out.max[q]);
  }
  constexpr int NQ = kValueRows<DV>;
  for (int64_t i0 = 0; i0 < nq; i0 += NQ) {  // NQ queries per value row read
    const int64_t nr = std::min<int64_t>(NQ, nq - i0);
    const float* sc[NQ];
    for (int rr = 0; rr < NQ; rr++) sc[rr] = &scores[(i0 + std::min<int64_t>(rr, nr - 1)) * keys];
    __m512 acc[NQ][DV];
    weigh<DV>(r, 0, keys - 1, sc, acc);
    for (int rr = 0; rr < nr; rr++)
      for (int d = 0; d < DV; d++) _mm512_storeu_ps(out.o + query(i0 + rr) * D + 16 * d, acc[rr][d]);
  }
}

// Keys to transpose: blocks [c0, c1) of 16 keys from key0 (the last real one `last`) of a row/kv head.
struct KeyChunk {
  int64_t row_head, key0, last;
  float* kt;
  int64_t c0, c1;
};

// A row/kv head on the prefill path: where its transposed keys are.
struct ManyRow {
  int64_t row_head, key0, nblocks;
  float* kt;
};

// A work item: a prefill row/kv head's group of queries (many), a group's queries over its shared keys
// (shared), a decode row/kv head's every query, or, after the shared parts, those of a group's row.
enum class PartKind {
  kPrefill,     // a prompt row/kv head's queries a .. a + b - 1
  kSharedKeys,  // a group's queries a .. a + b - 1 of kv head `row_head` over its shared keys
  kDecode,      // a decode row/kv head
  kSharedRow,   // a row of a shared group, after the shared keys: its own keys, merged
  kKeyRange,    // a lone decode row/kv head's keys a .. b into Partial slot `slot`
  kMerge,       // a lone decode row/kv head: the b ranges from slot a merged
};

struct Part {
  PartKind kind;
  int64_t row_head;  // b * Hkv + h
  int64_t a = 0, b = 0, slot = 0;
  const ManyRow* many = nullptr;
  const SharedGroup* shared = nullptr;
};

struct Plan {
  std::vector<ManyRow> many;
  std::vector<SharedGroup> groups;
  std::vector<KeyChunk> chunks;
  std::vector<Part> parts, after;  // `after` run once every part has: rows of the shared groups, merges
  std::vector<float> kt, partial, ranges;
  Partial shared{}, split{};
  std::vector<int8_t> role;  // per row: 0 decode, 1 prefill, 2 in a shared group
};

constexpr int64_t kChunkBlocks = 8;  // key blocks (of 16) per transposition work item

template <int DV>
void transpose_item(const AttnJob& j, const Plan& plan, size_t item) {
  const KeyChunk& c = plan.chunks[item];
  const RowHead r(j, (size_t)c.row_head, DV * 16);
  transpose_keys<DV>(r, c.key0, c.last, c.kt, c.c0, c.c1);
}

// the ranges' results rescaled to their largest max, summed and divided by their summed weights
template <int DV>
void merge_ranges(const AttnJob& j, const Plan& plan, const RowHead& r, int64_t first, int64_t count) {
  constexpr int D = DV * 16;
  const Partial& p = plan.split;
  for (int64_t g = 0; g < r.G; g++) {
    float m = -INFINITY, den = 0.f;
    for (int64_t c = 0; c < count; c++) m = std::max(m, p.max[(first + c) * r.G + g]);
    __m512 acc[DV];
    for (int d = 0; d < DV; d++) acc[d] = _mm512_setzero_ps();
    for (int64_t c = 0; c < count; c++) {
      const int64_t i = (first + c) * r.G + g;
      const float w = std::exp(p.max[i] - m);
      den += w * p.sum[i];
      for (int d = 0; d < DV; d++) acc[d] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(p.o + i * D + 16 * d), acc[d]);
    }
    float* o = j.out + r.base * r.Hq * D + (r.h * r.G + g) * D;
    for (int d = 0; d < DV; d++) _mm512_storeu_ps(o + 16 * d, _mm512_mul_ps(acc[d], _mm512_set1_ps(1.f / den)));
  }
}

template <int DV>
void run_part(const AttnJob& j, const Plan& plan, const Part& part) {
  if (part.kind == PartKind::kSharedKeys) {
    attend_shared<DV>(j, *part.shared, part.row_head, part.a, part.b, plan.shared);
    return;
  }
  const RowHead r(j, (size_t)part.row_head, DV * 16);
  switch (part.kind) {
    case PartKind::kPrefill: return attend_group<DV>(j, r, part.many->kt, part.many->key0, part.a, part.b);
    case PartKind::kSharedRow: return attend<DV>(j, r, &plan.shared, part.shared->keys);
    case PartKind::kKeyRange: {
      const KeyRange range{&plan.split, part.a, part.b, part.slot};
      return attend<DV>(j, r, nullptr, 0, &range);
    }
    case PartKind::kMerge: return merge_ranges<DV>(j, plan, r, part.a, part.b);
    default: return attend<DV>(j, r);
  }
}

// head_dim / 16 as a template argument
template <template <int> class F, typename... Args>
void by_head_dim(int64_t D, Args&&... args) {
  switch (D / 16) {
    case 1: return F<1>::run(args...);
    case 2: return F<2>::run(args...);
    case 3: return F<3>::run(args...);
    case 4: return F<4>::run(args...);
    case 5: return F<5>::run(args...);
    case 6: return F<6>::run(args...);
    case 7: return F<7>::run(args...);
    case 8: return F<8>::run(args...);
    default: return F<16>::run(args...);  // head_dim 256
  }
}
template <int DV>
struct TransposeItem {
  static void run(const AttnJob& j, const Plan& p, size_t i) { transpose_item<DV>(j, p, i); }
};
template <int DV>
struct PartItem {
  static void run(const AttnJob& j, const Plan& p, size_t i) { run_part<DV>(j, p, p.parts[i]); }
};
template <int DV>
struct AfterItem {
  static void run(const AttnJob& j, const Plan& p, size_t i) { run_part<DV>(j, p, p.after[i]); }
};

struct PhaseJob {
  AttnJob* job;
  const Plan* plan;
};

template <template <int> class F>
void phase_item(void* data, size_t item) {
  const PhaseJob& pj = *static_cast<PhaseJob*>(data);
  try {
    by_head_dim<F>(pj.job->D, *pj.job, *pj.plan, item);
  } catch (...) {
    pj.job->failed = true;
  }
}

// Decode rows (one token) grouped by their first pool block; a group of 2 or more keeps the blocks all
// its rows have in common before their first new positions (whole 16-key groups of them, 32 at least).
void find_shared(const AttnJob& j, Plan& plan) {
  plan.groups.clear();
  if (j.k->window > 0) return;  // a window may start inside the prefix
  std::vector<std::pair<int64_t, int64_t>> first;  // (first block, row)
  std::vector<int64_t> start((size_t)j.B);  // each row's first new position
  for (int64_t b = 0; b < j.B; b++) {
    const RowHead r(j, (size_t)(b * j.k->num_kv_heads), j.D);
    start[b] = r.start;
    if (plan.role[b] == 0 && r.count == 1 && r.start >= 32) first.emplace_back(r.table[0], b);
  }
  std::sort(first.begin(), first.end());
  for (size_t i = 0; i < first.size();) {
    size_t e = i;
    while (e < first.size() && first[e].first == first[i].first) e++;
    if (e - i >= 2) {
      SharedGroup grp;
      const int64_t b0 = first[i].second;
      int64_t blocks = start[b0] / j.bs;  // whole blocks before the row's new token
      for (size_t k = i + 1; k < e; k++) {
        const int64_t b = first[k].second;
        int64_t same = 0;
        const int64_t limit = std::min(blocks, start[b] / j.bs);
        while (same < limit && j.tables[b * j.MB + same] == j.tables[b0 * j.MB + same]) same++;
        blocks = same;
      }
      grp.keys = blocks * j.bs / 16 * 16;
      if (grp.keys >= 32) {
        for (size_t k = i; k < e; k++) grp.rows.push_back(first[k].second);
        plan.groups.push_back(std::move(grp));
      }
    }
    i = e;
  }
}

// Rows on the prefill path get their keys' storage and query groups, the latest (longest) groups
// first so the longest items start early; rows sharing a prefix their shared parts, then their own;
// other decode rows are one item per kv head.
void make_plan(const AttnJob& j, Plan& plan) {
  const int64_t Hkv = j.k->num_kv_heads, G = j.k->num_heads / Hkv, D = j.D;
  plan.many.clear();
  plan.chunks.clear();
  plan.parts.clear();
  plan.after.clear();
  plan.role.assign((size_t)j.B, 0);
  size_t floats = 0;
  for (int64_t i = 0; i < j.B * Hkv; i++) {
    const RowHead r(j, (size_t)i, D);
    if (r.count * r.G < 16) continue;
    plan.role[r.b] = 1;
    const int64_t key0 = r.lowest(r.start), nblocks = (r.start + r.count - 1 - key0 + 16) / 16;
    plan.many.push_back({i, key0, nblocks, nullptr});
    floats += (size_t)nblocks * D * 16;
  }
  find_shared(j, plan);
  for (const SharedGroup& grp : plan.groups) {
    floats += (size_t)(Hkv * grp.keys * D);
    for (int64_t b : grp.rows) plan.role[b] = 2;
  }
  plan.kt.resize(floats);
  float* at = plan.kt.data();
  for (ManyRow& mr : plan.many) {
    mr.kt = at;
    at += mr.nblocks * D * 16;
    const RowHead r(j, (size_t)mr.row_head, D);
    for (int64_t c = 0; c < mr.nblocks; c += kChunkBlocks)
      plan.chunks.push_back({mr.row_head, mr.key0, r.start + r.count - 1, mr.kt, c, std::min(mr.nblocks, c + kChunkBlocks)});
  }
  for (SharedGroup& grp : plan.groups) {
    grp.kt = at;
    at += Hkv * grp.keys * D;
    for (int64_t h = 0; h < Hkv; h++)
      for (int64_t c = 0; c < grp.keys / 16; c += kChunkBlocks)
        plan.chunks.push_back({grp.rows[0] * Hkv + h, 0, grp.keys - 1, grp.kt + h * grp.keys * D, c,
                               std::min(grp.keys / 16, c + kChunkBlocks)});
  }
  if (!plan.groups.empty()) {
    const int64_t N = j.N, Hq = j.k->num_heads;
    plan.partial.resize((size_t)(N * Hq * (D + 2)));
    plan.shared = {plan.partial.data(), plan.partial.data() + N * Hq * D, plan.partial.data() + N * Hq * (D + 1)};
  }
  for (const ManyRow& mr : plan.many) {  // latest groups first, across rows
    const RowHead r(j, (size_t)mr.row_head, D);
    for (int64_t q0 = (r.count * r.G - 1) / QG * QG; q0 >= 0; q0 -= QG)
      plan.parts.push_back({PartKind::kPrefill, mr.row_head, q0, std::min(QG, r.count * r.G - q0), 0, &mr});
  }
  for (const SharedGroup& grp : plan.groups) {
    const int64_t total = (int64_t)grp.rows.size() * G;
    for (int64_t h = 0; h < Hkv; h++)
      for (int64_t q0 = 0; q0 < total; q0 += QG)
        plan.parts.push_back({PartKind::kSharedKeys, h, q0, std::min(QG, total - q0), 0, nullptr, &grp});
    for (int64_t h = 0; h < Hkv; h++)
      for (int64_t b : grp.rows) plan.after.push_back({PartKind::kSharedRow, b * Hkv + h, 0, 0, 0, nullptr, &grp});
  }
  // Decode rows alone in a step (nothing else to keep the threads busy): a long context's keys in
  // ranges of 256 or more, enough of them for ~8 items, merged afterwards.
  int64_t decode_rows = 0;
  for (int64_t b = 0; b < j.B; b++) decode_rows += plan.role[b] == 0;
  const bool cut = decode_rows == j.B && decode_rows * Hkv < 8 && j.k->window == 0;
  int64_t slots = 0;
  for (int64_t h = 0; h < Hkv; h++)  // kv head by kv head: rows sharing prefix blocks read them while cached
    for (int64_t b = 0; b < j.B; b++) {
      if (plan.role[b] != 0) continue;
      const RowHead r(j, (size_t)(b * Hkv + h), D);
      const int64_t keys = r.start + 1, ranges = std::min<int64_t>(keys / 256, (8 + decode_rows * Hkv - 1) / (decode_rows * Hkv));
      if (!cut || r.count != 1 || ranges < 2) {
        plan.parts.push_back({PartKind::kDecode, b * Hkv + h});
        continue;
      }
      for (int64_t c = 0; c < ranges; c++)
        plan.parts.push_back({PartKind::kKeyRange, b * Hkv + h, keys * c / ranges, keys * (c + 1) / ranges - 1, slots + c});
      plan.after.push_back({PartKind::kMerge, b * Hkv + h, slots, ranges});
      slots += ranges;
    }
  if (slots) {
    plan.ranges.resize((size_t)(slots * G * (D + 2)));
    plan.split = {plan.ranges.data(), plan.ranges.data() + slots * G * D, plan.ranges.data() + slots * G * (D + 1)};
  }
}

OrtStatus* create_attention(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  auto* k = new (std::nothrow) AttnKernel();
  if (!k) return fail("ruvllm.PagedAttention: out of memory");
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  OrtStatus* st = attr(info, "num_heads", &k->num_heads);
  if (!st) st = attr(info, "num_kv_heads", &k->num_kv_heads);
  if (!st) st = attr(info, "sliding_window", &k->window);
  if (!st) st = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttribute_float)(info, "scale", &k->scale);
  if (!st && (k->num_heads <= 0 || k->num_kv_heads <= 0 || k->num_heads % k->num_kv_heads))
    st = fail("ruvllm.PagedAttention: num_heads must be a multiple of num_kv_heads");
  if (st) {
    delete k;
    return st;
  }
  *out = k;
  return nullptr;
}

OrtStatus* attend_step(void* kernel, OrtKernelContext* ctx) {
  const AttnKernel& k = *static_cast<AttnKernel*>(kernel);
  auto input = api<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput);
  const OrtValue* in[7] = {};
  std::vector<int64_t> dims[7];
  for (size_t i = 0; i < 7; i++) {
    RETURN_IF(input(ctx, i, &in[i]));
    RETURN_IF(tensor_shape(in[i], dims[i]));
  }
  if (dims[0].size() != 2 || dims[2].size() != 4 || dims[4].size() != 2 || dims[5].size() != 2 || dims[6].size() != 1)
    return fail("ruvllm.PagedAttention: unexpected input ranks");
  const int64_t D = dims[0][1], N = dims[6][0];
  if (D % 16 || D > 256 || (D > 128 && D != 256) || dims[2][0] != k.num_kv_heads || dims[2][3] != D)
    return fail("ruvllm.PagedAttention: head_dim must be 16..128 in steps of 16, or 256, and match the pool");
  AttnJob job{&k, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
              dims[5][0], dims[5][1], dims[4][1], dims[2][1], dims[2][2], D};
  job.N = N;
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&job.qk)));
  RETURN_IF(tensor_data(in[1], const_cast<float**>(&job.v)));
  RETURN_IF(tensor_data(in[2], const_cast<float**>(&job.pool_k)));
  RETURN_IF(tensor_data(in[3], const_cast<float**>(&job.pool_v)));
  RETURN_IF(tensor_data(in[4], const_cast<int64_t**>(&job.tables)));
  RETURN_IF(tensor_data(in[5], const_cast<int64_t**>(&job.qidx)));
  RETURN_IF(tensor_data(in[6], const_cast<int64_t**>(&job.pos)));
  const int64_t out_dims[2] = {N, k.num_heads * D};
  RETURN_IF(output_data(ctx, 0, out_dims, 2, &job.out));
  if (N == 0 || job.B * k.num_kv_heads == 0) return nullptr;
  thread_local Plan plan;  // the calling thread's; its workers only read it
  make_plan(job, plan);
  auto parallel_for = api<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      kKernelContext_ParallelFor);
  PhaseJob phase{&job, &plan};
  if (!plan.chunks.empty()) RETURN_IF(parallel_for(ctx, phase_item<TransposeItem>, plan.chunks.size(), 0, &phase));
  if (!job.failed) RETURN_IF(parallel_for(ctx, phase_item<PartItem>, plan.parts.size(), 0, &phase));
  if (!job.failed && !plan.after.empty()) RETURN_IF(parallel_for(ctx, phase_item<AfterItem>, plan.after.size(), 0, &phase));
  return job.failed ? fail("ruvllm.PagedAttention: out of memory") : nullptr;
}

// ---- residual add + RMS norm ----
//
// ruvllm.SkipRMSNorm computes what com.microsoft.SkipSimplifiedLayerNormalization (no bias) does, the
// add of a layer's output to the residual stream and the next RMS norm: sum = x + skip, y = sum /
// sqrt(mean(sum^2) + epsilon) * gamma; outputs y and sum. Why: onnxruntime's kernel takes ~0.2 us per
// 576-wide row per thread, 60 of them a step: 0.8 ms of a 64-row decode step, 6 ms of a 512-token
// prefill. Here a row is two vector passes over data in L1.

struct NormKernel {
  float epsilon = 1e-5f;
};

OrtStatus* create_norm(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  float eps = 1e-5f;
  RETURN_IF(api<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttribute_float)(info, "epsilon", &eps));
  auto* k = new (std::nothrow) NormKernel{eps};
  if (!k) return fail("ruvllm.SkipRMSNorm: out of memory");
  *out = k;
  return nullptr;
}

struct NormJob {
  const float *x, *skip, *gamma;
  float *y, *sum;
  int64_t H, rows_per_item, M;
  float epsilon;
};

void norm_rows(const NormJob& j, int64_t m0, int64_t m1) {
  const int64_t H = j.H;
  for (int64_t m = m0; m < m1; m++) {
    const float *x = j.x + m * H, *r = j.skip + m * H;
    float *s = j.sum + m * H, *y = j.y + m * H;
    auto lanes = [H](int64_t i) { return (__mmask16)(H - i >= 16 ? 0xffff : (1u << (H - i)) - 1); };
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 k = lanes(i);
      const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, r + i));
      _mm512_mask_storeu_ps(s + i, k, v);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)H + j.epsilon));
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 k = lanes(i);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv);
      _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, j.gamma + i)));
    }
  }
}

void norm_item(void* data, size_t i) {
  const NormJob& j = *static_cast<NormJob*>(data);
  const int64_t m0 = (int64_t)i * j.rows_per_item;
  norm_rows(j, m0, std::min(j.M, m0 + j.rows_per_item));
}

OrtStatus* skip_rms_norm(void* kernel, OrtKernelContext* ctx) {
  const NormKernel& k = *static_cast<NormKernel*>(kernel);
  const OrtValue* in[3] = {};
  auto input = api<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput);
  std::vector<int64_t> dims, skip_dims, gamma_dims;
  for (size_t i = 0; i < 3; i++) RETURN_IF(input(ctx, i, &in[i]));
  RETURN_IF(tensor_shape(in[0], dims));
  RETURN_IF(tensor_shape(in[1], skip_dims));
  RETURN_IF(tensor_shape(in[2], gamma_dims));
  if (dims.empty() || skip_dims != dims || gamma_dims.size() != 1 || gamma_dims[0] != dims.back())
    return fail("ruvllm.SkipRMSNorm: input and skip must have one shape, gamma its last dimension");
  NormJob j{};
  j.H = dims.back();
  j.M = 1;
  for (size_t i = 0; i + 1 < dims.size(); i++) j.M *= dims[i];
  j.epsilon = k.epsilon;
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&j.x)));
  RETURN_IF(tensor_data(in[1], const_cast<float**>(&j.skip)));
  RETURN_IF(tensor_data(in[2], const_cast<float**>(&j.gamma)));
  RETURN_IF(output_data(ctx, 0, dims.data(), dims.size(), &j.y));
  RETURN_IF(output_data(ctx, 1, dims.data(), dims.size(), &j.sum));
  if (j.M == 0 || j.H == 0) return nullptr;
  j.rows_per_item = std::max<int64_t>(1, 65536 / j.H);  // fewer rows cost less than a handoff
  const size_t items = (size_t)((j.M + j.rows_per_item - 1) / j.rows_per_item);
  if (items < 2) {
    norm_rows(j, 0, j.M);
    return nullptr;
  }
  return api<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      kKernelContext_ParallelFor)(ctx, norm_item, items, 0, &j);
}

#endif  // RUVLLM_AVX512: attention and norm

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

// The version-1 entry points, which cannot report errors: onnxruntime calls the V2 ones (version >= 16)
using CreateFn = OrtStatus* (*)(const CustomOp*, const void*, const OrtKernelInfo*, void**);
using ComputeFn = OrtStatus* (*)(void*, OrtKernelContext*);
template <CreateFn create>
void* create_v1(const CustomOp* self, const void* a, const OrtKernelInfo* info) {
  void* k = nullptr;
  return create(self, a, info, &k) ? nullptr : k;
}
template <ComputeFn run>
void compute_v1(void* k, OrtKernelContext* ctx) {
  (void)run(k, ctx);
}

// the fields the operators share; each sets its name, types and entry points
CustomOp base_op() {
  CustomOp op{};
  op.version = kApiVersion;
  op.GetExecutionProviderType = [](const CustomOp*) { return "CPUExecutionProvider"; };
  op.GetOutputType = [](const CustomOp*, size_t) { return kFloat; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 1; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t) { return 0; };   // required
  op.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };
  op.GetInputMemoryType = [](const CustomOp*, size_t) { return 0; };       // OrtMemTypeDefault
  op.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  op.InferOutputShapeFn = nullptr;
  op.GetStartVersion = [](const CustomOp*) { return 1; };
  op.GetEndVersion = [](const CustomOp*) { return INT_MAX; };
  op.GetMayInplace = [](int**, int**) -> size_t { return 0; };
  op.ReleaseMayInplace = [](int*, int*) {};
  op.GetAliasMap = [](int**, int**) -> size_t { return 0; };
  op.ReleaseAliasMap = [](int*, int*) {};
  return op;
}

// `run`, with nothing unwinding into onnxruntime: running out of memory is `what`'s error status
template <ComputeFn run, const char* what>
OrtStatus* guarded(void* kernel, OrtKernelContext* ctx) {
  try {
    return run(kernel, ctx);
  } catch (const std::bad_alloc&) {
    return fail(std::string(what) + ": out of memory");
  }
}

constexpr char kMatMulName[] = "ruvllm.MatMulQ4", kAttentionName[] = "ruvllm.PagedAttention",
               kNormName[] = "ruvllm.SkipRMSNorm";

// the entry points of an operator whose kernel object (a K) `create` makes and `run` computes with
template <typename K, CreateFn create, ComputeFn run, const char* what>
CustomOp kernel_op() {
  CustomOp op = base_op();
  op.CreateKernel = create_v1<create>;
  op.KernelCompute = compute_v1<guarded<run, what>>;
  op.KernelDestroy = [](void* k) { delete static_cast<K*>(k); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = guarded<run, what>;
  return op;
}

CustomOp matmul_op() {
  CustomOp op = kernel_op<Kernel, create_kernel, compute_rows, kMatMulName>();
  op.GetName = [](const CustomOp*) { return "MatMulQ4"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return (i == 1 || i == 3) ? kUint8 : i == 4 ? kFloat16 : kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 5; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) { return i == 4 ? 1 : 0; };  // minimums: optional
  return op;
}

#if RUVLLM_AVX512
CustomOp attention_op() {
  CustomOp op = kernel_op<AttnKernel, create_attention, attend_step, kAttentionName>();
  op.GetName = [](const CustomOp*) { return "PagedAttention"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return i < 4 ? kFloat : kInt64; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 7; };
  return op;
}

CustomOp norm_op() {
  CustomOp op = kernel_op<NormKernel, create_norm, skip_rms_norm, kNormName>();
  op.GetName = [](const CustomOp*) { return "SkipRMSNorm"; };
  op.GetInputType = [](const CustomOp*, size_t) { return kFloat; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return 3; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 2; };
  return op;
}

#endif

CustomOp matmul_split_op() {
  CustomOp op = matmul_op();
  op.GetName = [](const CustomOp*) { return "MatMulQ4Split"; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 2; };
  return op;
}

CustomOp matmul_swiglu_op() {
  CustomOp op = matmul_op();
  op.GetName = [](const CustomOp*) { return "MatMulQ4SwiGLU"; };
  return op;
}

const CustomOp g_matmul = matmul_op();
const CustomOp g_matmul_split = matmul_split_op();
const CustomOp g_matmul_swiglu = matmul_swiglu_op();
#if RUVLLM_AVX512
const CustomOp g_attention = attention_op();
const CustomOp g_norm = norm_op();
#endif

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const void* table = base->GetApi(kApiVersion);
  if (!table) return nullptr;  // an onnxruntime older than 1.17 has no ParallelFor; nothing registered
  g_api = static_cast<const void* const*>(table);
  OrtCustomOpDomain* domain = nullptr;  // kept for the process's life, as sessions refer to it
  RETURN_IF(api<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ruvllm", &domain));
  auto add = api<OrtStatus* (*)(OrtCustomOpDomain*, const CustomOp*)>(kCustomOpDomain_Add);
#if RUVLLM_AVX512
  for (const CustomOp* op : {&g_matmul, &g_matmul_split, &g_matmul_swiglu, &g_attention, &g_norm}) RETURN_IF(add(domain, op));
#else
  for (const CustomOp* op : {&g_matmul, &g_matmul_split, &g_matmul_swiglu}) RETURN_IF(add(domain, op));
#endif
  return api<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}

// Which operators this build registers (AVX-512: all; AVX2: the 4-bit matmuls).
__attribute__((visibility("default"))) const char* ruvllm_kernel_ops() {
  return RUVLLM_AVX512 ? "MatMulQ4,PagedAttention,SkipRMSNorm" : "MatMulQ4";
}

// For the library's own test: the kernel on plain buffers, without onnxruntime.
__attribute__((visibility("default"))) int ruvllm_q4_matmul(const float* A, int64_t M, int K, int N, int block,
                                                          const uint8_t* B, const float* S, const uint8_t* Z, float* C) {
  try {
    PackedWeights w;
    pack(w, N, K, block, B, S, Z);
    QuantizedRows rows;
    quantize_rows(rows, A, M, K, block);
    gemm_tiles(w, rows, M, Output{C, nullptr, N, 0, w.ntiles}, 0, w.ntiles, false);
  } catch (...) {
    return 1;
  }
  return 0;
}

}  // extern "C"
