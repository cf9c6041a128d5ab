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
// The other modes hold a GGUF's block types at the file's own bits, in layouts the exporter writes
// (runtime/backends/block_layouts.py) and the kernel reads where onnxruntime maps them (OwnBits below):
// per tile and block, the weights' bits as fields of 4, 2 and 1 bits (the nibble lines above where a type has
// 4 or more bits, then lines of 2 and of 1 bit: Q6_K 4 + 2, Q5 4 + 1, Q3_K 2 + 1, Q2_K 2); then each type's own
// scales (6-bit scales and minimums as bytes with fp16 d and dmin per 256 for Q4_K and Q5_K, 4-bit ones as
// a byte's nibbles for Q2_K, int8 scales with fp16 d per 256 for Q6_K and Q3_K, fp16 d (and m) per block for
// Q4_0, Q5_0, Q4_1, Q5_1), from which the kernel forms each block's scale and minimum (or zero point) in
// fp32 as gguf's dequantization does.
#pragma once

#include "ort_api.h"
#include "simd_math.h"
#include "weight_arena.h"
#include "block_types.h"

namespace {

// ---- the kernel ----

constexpr int kTile = 16;      // output columns per zmm of int32 / fp32 lanes
constexpr int kTilesPer = RUVLLM_AVX512 ? 2 : 1;  // tiles sharing one broadcast activation word
constexpr int kRowsPer = 4;    // rows sharing one unpacked weight register

struct PackedWeights {
  int N = 0, K = 0, block = 0, nblk = 0, ntiles = 0;
  int Kp = 0;  // K padded to whole blocks (MatMulNBits pads the last block)
  // per tile, per block, per 8 k: 64 bytes, byte 4j+i = q(col j, k+i) | q(col j, k+4+i) << 4
  std::unique_ptr<uint8_t[], void (*)(void*)> w{nullptr, WeightArena::free};
  const uint8_t* wdata = nullptr;  // the weights: w's copy, or (k-quant layout) the initializer itself
  std::vector<float> scale;    // per tile, per block: 16 columns each
  std::vector<uint8_t> zero;   // the same, as bytes (a quarter of fp32's: a single row is memory-bound)
  const float* sc = nullptr;   // where mode 0 reads them: the vectors, or an exporter-written grid in place
  const uint8_t* zp = nullptr;
  bool mins = false;           // minimums mode: scale and zero unused, scale_min holds both
  std::vector<uint16_t> scale_min;  // per tile, per block: 16 fp16 scales, then 16 fp16 minimums
  // an own-bit layout (OwnBits::mode, 2 and up; 0: packed from MatMulNBits at load): its scale sections
  int own = 0;
  const uint8_t* ksc = nullptr;   // per tile and block: K-quants' scale bytes (Q4_K, Q5_K: 16 sc, 16 m; Q6_K: 16 int8)
  const uint16_t* kd = nullptr;   // fp16: per tile and super-block (K-quants: d, then dmin), or per tile and block
  int nsuper = 0;
  int mode() const { return own ? own : mins ? 1 : 0; }
};

// The own-bit layouts (kOwnBits, by the operator's `kquant` attribute 1-10; the kernel's mode is kquant + 1):
// block_types.h, generated from runtime/formats/block_types.py.
constexpr const OwnBits& own_bits(int mode) { return kOwnBits[mode - 2]; }

// Bytes of each section for N columns and K inputs: weights (nibble and high-bit lines), scale bytes, fp16 scales
inline void own_sections(const OwnBits& t, int64_t N, int64_t K, size_t* weights, size_t* sc, size_t* half) {
  *weights = (size_t)(N * K * t.bits / 8);
  const int64_t blocks = N * (K / t.block), supers = N * (K / 256);
  switch (t.scales) {
    case Scales::kKQuant: *sc = (size_t)blocks * 2; *half = (size_t)supers * 4; break;
    case Scales::kSix: *sc = (size_t)blocks; *half = (size_t)supers * 2; break;
    case Scales::kHalf: *sc = 0; *half = (size_t)blocks * 2; break;
    case Scales::kHalfMin: *sc = 0; *half = (size_t)blocks * 4; break;
    case Scales::kKQuant4: *sc = (size_t)blocks; *half = (size_t)supers * 4; break;
  }
}
inline size_t own_bytes(int mode, int64_t N, int64_t K) {
  size_t w, sc, half;
  own_sections(own_bits(mode), N, K, &w, &sc, &half);
  return w + sc + half;
}

// The exporter's bytes for a kernel: read where they lie when aligned as the exporter writes them
// (onnxruntime maps the package's weights file: nothing copied, the page cache shared), else, or with
// RUVLLM_COPY_WEIGHTS=1, copied whole into the arena (W: PackedWeights, matmul_q8.h's PackedQ8)
template <typename W>
void map_or_copy(W& wts, const uint8_t* blob, size_t bytes) {
  const char* copy = std::getenv("RUVLLM_COPY_WEIGHTS");
  if (reinterpret_cast<uintptr_t>(blob) % 64 == 0 && !(copy && copy[0] == '1')) {
    wts.wdata = blob;
    populate(blob, bytes);
  } else {
    wts.w.reset(static_cast<uint8_t*>(WeightArena::instance().allocate(bytes)));
    std::memcpy(wts.w.get(), blob, bytes);
    wts.wdata = wts.w.get();
  }
}

// A layout the exporter wrote (own_bytes(mode, N, K))
void pack_own(PackedWeights& wts, int mode, int N, int K, const uint8_t* blob) {
  const OwnBits& t = own_bits(mode);
  if (K % t.superblock || N % kTile)
    throw std::invalid_argument(std::string(t.name) + " needs K a multiple of " + std::to_string(t.superblock) + ", N of 16");
  wts.N = N; wts.K = K; wts.block = t.block; wts.nblk = K / t.block; wts.ntiles = N / kTile; wts.Kp = K;
  wts.nsuper = K / 256;
  wts.own = mode;
  size_t weights, sc, half;
  own_sections(t, N, K, &weights, &sc, &half);
  map_or_copy(wts, blob, weights + sc + half);
  wts.ksc = wts.wdata + weights;
  wts.kd = reinterpret_cast<const uint16_t*>(wts.ksc + sc);
}

// An int4 grid (zero points, fp32 scales: RTN, AWQ, GPTQ) the exporter wrote in mode 0's layout
// (block_layouts.grid_layout, kquant kGridKind): pack()'s weights, then its scales and zero points, each
// [tile, block, column]; read in place as pack_own's are (kGridKind: block_types.h)
inline size_t grid_bytes(int64_t N, int64_t K, int64_t block) { return (size_t)(N * K / 2 + N * (K / block) * 5); }
void pack_grid(PackedWeights& wts, int N, int K, int block, const uint8_t* blob) {
  if (block % 32 || K % block || N % kTile)
    throw std::invalid_argument("an int4 grid needs its block a multiple of 32, K of the block, N of 16");
  wts.N = N; wts.K = K; wts.block = block; wts.nblk = K / block; wts.ntiles = N / kTile; wts.Kp = K;
  const size_t weights = (size_t)N * K / 2, scales = (size_t)N * wts.nblk * 4;
  map_or_copy(wts, blob, grid_bytes(N, K, block));
  wts.sc = reinterpret_cast<const float*>(wts.wdata + weights);
  wts.zp = wts.wdata + weights + scales;
}

inline bool fp16_exact(float x, uint16_t* h) {
  *h = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  return _cvtsh_ss(*h) == x;
}

// M: the minimums, fp16 [K/block, N] (as the exporter's MatMul over block sums reads them), or null
void pack(PackedWeights& wts, int N, int K, int block, const uint8_t* B, const float* S, const uint8_t* Z,
          const uint16_t* M = nullptr) {
  wts.N = N; wts.K = K; wts.block = block; wts.nblk = (K + block - 1) / block; wts.ntiles = N / kTile;
  wts.Kp = wts.nblk * block;
  const size_t bytes = (size_t)N * wts.Kp / 2;
  wts.w.reset(static_cast<uint8_t*>(WeightArena::instance().allocate(bytes)));
  wts.wdata = wts.w.get();
  wts.mins = M != nullptr;
  if (wts.mins) wts.scale_min.resize((size_t)N * wts.nblk * 2);
  else {
    wts.scale.resize((size_t)N * wts.nblk);
    wts.zero.resize((size_t)N * wts.nblk);
    wts.sc = wts.scale.data();
    wts.zp = wts.zero.data();
  }
  const int zp_stride = (wts.nblk + 1) / 2;
  for (int t = 0; t < wts.ntiles; t++)
    for (int b = 0; b < wts.nblk; b++) {
      const size_t tb = (size_t)t * wts.nblk + b;
      uint8_t* dst = wts.w.get() + tb * (block / 8) * 64;
      for (int j = 0; j < kTile; j++) {
        const int n = t * kTile + j;
        const uint8_t* src = B + ((size_t)n * wts.nblk + b) * (block / 2);  // k even in the low nibble
        auto q = [&](int k) -> uint8_t { return (k & 1) ? (src[k / 2] >> 4) : (src[k / 2] & 15); };
        const uint8_t zb = Z[(size_t)n * zp_stride + b / 2];
        const uint8_t z = (uint8_t)((b & 1) ? (zb >> 4) : (zb & 15));
        if (wts.mins) {
          if (z) throw std::invalid_argument("zero points must be 0 where the blocks have minimums");
          if (!fp16_exact(S[(size_t)n * wts.nblk + b], &wts.scale_min[tb * 2 * kTile + j]))
            throw std::invalid_argument("scales must be exact in fp16 where the blocks have minimums");
          wts.scale_min[tb * 2 * kTile + kTile + j] = M[(size_t)b * N + n];
        } else {
          wts.scale[tb * kTile + j] = S[(size_t)n * wts.nblk + b];
          wts.zero[tb * kTile + j] = z;
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

// Each row's blocks rounded to int8 (symmetric, scale max|a| / 127) with their integer sums; a short last
// block reads as zeros. Rows [m_begin, m_end) of `out`, sized for M rows by size_rows.
void size_rows(QuantizedRows& out, int64_t M, int K, int block) {
  const int nblk = (K + block - 1) / block;
  out.q.resize((size_t)M * nblk * block);
  out.scale.resize((size_t)M * nblk);
  out.sum.resize((size_t)M * nblk);
}
void quantize_row_range(QuantizedRows& out, const float* A, int64_t m_begin, int64_t m_end, int K, int block) {
  const int nblk = (K + block - 1) / block, Kp = nblk * block;
  std::vector<float> pad(block);
  for (int64_t m = m_begin; m < m_end; m++)
    for (int b = 0; b < nblk; b++) {
      const int valid = std::min(block, K - b * block);
      const float* a = A + m * K + (size_t)b * block;
      if (valid < block) {
        std::fill(pad.begin(), pad.end(), 0.f);
        std::copy(a, a + valid, pad.begin());
        a = pad.data();
      }
      Vec::F mx = Vec::zero();
      for (int k = 0; k < block; k += Vec::kLanes) mx = Vec::max(mx, Vec::abs(Vec::load(a + k)));
      const float amax = Vec::reduce_max(mx);
      const Vec::F inv = Vec::set1(amax > 0 ? 127.f / amax : 0.f);
      Vec::I sum = Vec::izero();
      int8_t* q = out.q.data() + m * Kp + (size_t)b * block;
      for (int k = 0; k < block; k += Vec::kLanes) {
        const Vec::I v = Vec::to_int(Vec::mul(Vec::load(a + k), inv));
        sum = Vec::iadd(sum, v);
        Vec::store_i8(q + k, v);
      }
      out.scale[m * nblk + b] = amax / 127.f;
      out.sum[m * nblk + b] = (float)Vec::reduce_iadd(sum);
    }
}
void quantize_rows(QuantizedRows& out, const float* A, int64_t M, int K, int block) {
  size_rows(out, M, K, block);
  quantize_row_range(out, A, 0, M, K, block);
}

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

// T tiles (weight tiles t0 + i * stride) x R rows. SwiGLU: T = 2, tile t0 of the gate half and its
// partner of the up half, stored as one tile silu(gate) * up (MatMulQ4SwiGLU: no Split, Sigmoid, Muls).
// `next`: how far the next tile group starts (in tiles), for Prefetch::kNext.
// The layout traits of a kernel mode (0: MatMulNBits' zero points, 1: fp16 scale and minimum pairs, 2 and up:
// an own-bit layout)
template <int Mode>
constexpr OwnBits traits() {
  if constexpr (Mode >= 2) return kOwnBits[Mode - 2];
  else return OwnBits{"", 0, 4, 32, 0, 32, Mode == 1 ? Scales::kHalfMin : Scales::kHalf, false};
}
// A type with one zero point z (w = s (q - z)) starts each row's sums at -z sum(qa), in integers (exact as
// the fp32 correction it replaces: both are below 2^24), so the block's epilogue has one operation less
template <int Mode>
constexpr bool fold_zero() {
  return Mode >= 2 && (traits<Mode>().scales == Scales::kSix || traits<Mode>().scales == Scales::kHalf);
}

// The scales a later block reads, into the cache: block b + 4 of the same tile (kAhead), or block b of the
// tile `next` tiles on (kNext); tb indexes blocks tile by tile. A super-block's d line serves several
// blocks: left to the hardware.
template <Prefetch F, int Mode>
inline void prefetch_scales(const PackedWeights& wts, int tile, int next, int b, size_t last_block) {
  constexpr OwnBits L = traits<Mode>();
  const size_t tb = std::min(last_block, (size_t)(tile + (F == Prefetch::kNext ? next : 0)) * wts.nblk + b +
                                             (F == Prefetch::kAhead ? 4 : 0));
  if constexpr (Mode >= 2) {
    if constexpr (L.scales == Scales::kKQuant) prefetch(wts.ksc + tb * 2 * kTile);
    else if constexpr (L.scales == Scales::kSix || L.scales == Scales::kKQuant4) prefetch(wts.ksc + tb * kTile);
    else if constexpr (L.scales == Scales::kHalf) prefetch(wts.kd + tb * kTile);
    else prefetch(wts.kd + tb * 2 * kTile);
  } else if constexpr (Mode == 1) {
    prefetch(wts.scale_min.data() + tb * 2 * kTile);
  } else {
    prefetch(wts.sc + tb * kTile);
    prefetch(wts.zp + tb * kTile);
  }
}

#if RUVLLM_AVX512
// How a 2- or 1-bit field line (block_layouts.py) reaches its place `at` in a weight register's bytes: in
// the line broadcast to the register, the field of a lane in 256-bit half x (2 bits) or 128-bit quarter q
// (1 bit) sits at bit 2x (q) of its byte, plus 4 in the high register (`high`: 4). Each 16-bit lane is
// shifted by at - that bit: left where every count is >= 0, right where every one is <= 0 (a 16-bit shift
// moves a byte's field within its byte for these counts: the spill into the other byte is masked off),
// else (`mixed`: Q3_K's 1-bit low register) right to bit 0, masked, then left.
struct FieldShift {
  int width, at;  // the field's bits and its place in the weight
  bool left, mixed;
  int base;  // the count of lane group 0; group j's is base - j * step, negated for right shifts
};
constexpr FieldShift field_shift(int width, int at, int high) {
  const int step = width == 2 ? 2 : 1, groups = width == 2 ? 2 : 4;
  const int first = at - high, last = at - high - step * (groups - 1);
  if (last >= 0) return {width, at, true, false, first};
  if (first <= 0) return {width, at, false, false, first};
  return {width, at, false, true, -high};  // right by each lane group's own bit, then left by `at`
}
// the 16-bit shift counts of a field's lanes (non-negative: the direction is FieldShift::left's)
inline __m512i field_counts(FieldShift f) {
  const int step = f.width == 2 ? 2 : 1, per = f.width == 2 ? 16 : 8;  // 16-bit lanes a lane group
  alignas(64) int16_t c[32];
  for (int l = 0; l < 32; l++) {
    const int count = f.base - (l / per) * step;
    c[l] = (int16_t)(f.left ? count : -count);
  }
  return _mm512_load_si512(c);
}
// w with each byte's field from line h at its place (mask: the field's bits there); Merge: w holds other
// fields' bits already (else it is zero, and only the field is kept)
template <int Width, int At, bool Left, bool Mixed, bool Merge>
inline __m512i merge_field(__m512i w, __m512i h, __m512i counts, __m512i mask) {
  __m512i t;
  if constexpr (Mixed)
    t = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, counts), _mm512_set1_epi8((char)((1 << Width) - 1))), At);
  else if constexpr (Left)
    t = _mm512_sllv_epi16(h, counts);
  else
    t = _mm512_srlv_epi16(h, counts);
  if constexpr (Merge) return _mm512_ternarylogic_epi32(w, t, mask, 0xF8);  // w | (t & mask)
  return _mm512_and_si512(t, mask);
}

// Mode: 0 zero points and fp32 scales, 1 fp16 scales and minimums, 2 and up an own-bit layout (PackedWeights::mode)
template <int T, int R, bool SwiGLU, Prefetch F, int Mode>
inline void tiles_rows(const PackedWeights& wts, const QuantizedRows& acts, int t0, int64_t m0, const Output& out,
                       int stride, int next) {
  constexpr OwnBits L = traits<Mode>();
  constexpr int GB = 16 * L.bits;  // bytes a group of 8 k takes in a tile (all its fields)
  constexpr bool nib = L.bits & 4, two = L.bits & 2, one = L.bits & 1;  // the fields (see OwnBits::bits)
  constexpr int two_at = nib ? 4 : 0, one_at = two_at + (two ? 2 : 0);  // where they go in a weight
  constexpr bool kFoldZero = fold_zero<Mode>();
  const int nblk = wts.nblk, block = wts.block, K = wts.Kp;  // rows of qa are padded to whole blocks
  const size_t tile_bytes = (size_t)nblk * (block / 8) * GB;
  const size_t two_off = (size_t)(block / 8) * 64 * nib, one_off = two_off + (size_t)(block / 8) * 32 * two;
  const size_t last_block = (size_t)wts.ntiles * nblk - 1;
  const __m512i low4 = _mm512_set1_epi8(15);
  // each 2- and 1-bit field moved to its place in the weight by one shift per 16-bit lane (field_shift) and
  // merged under its mask
  constexpr FieldShift two0 = field_shift(2, two_at, 0), two1 = field_shift(2, two_at, 4);
  constexpr FieldShift one0 = field_shift(1, one_at, 0), one1 = field_shift(1, one_at, 4);
  const __m512i two_c0 = field_counts(two0), two_c1 = field_counts(two1);
  const __m512i one_c0 = field_counts(one0), one_c1 = field_counts(one1);
  const __m512i two_m = _mm512_set1_epi8((char)(3 << two_at)), one_m = _mm512_set1_epi8((char)(1 << one_at));
  __m512 acc[T][R];
  for (int i = 0; i < T; i++)
    for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
  for (int b = 0; b < nblk; b++) {
    __m512i dot[T][R];  // with one zero point, each row's sums start at -z sum(qa) (fold_zero)
    for (int r = 0; r < R; r++) {
      const __m512i start = kFoldZero ? _mm512_set1_epi32(-L.zero * (int32_t)acts.sum[(size_t)(m0 + r) * nblk + b])
                                      : _mm512_setzero_si512();
      for (int i = 0; i < T; i++) dot[i][r] = start;
    }
    const uint8_t* wp = wts.wdata + ((size_t)t0 * nblk + b) * (block / 8) * GB;
    const int8_t* ap = acts.q.data() + m0 * K + (size_t)b * block;
    if constexpr (F != Prefetch::kNone)
      for (int i = 0; i < T; i++) prefetch_scales<F, Mode>(wts, t0 + i * stride, next, b, last_block);
    for (int g = 0; g < block / 8; g++) {
      __m512i w[T][2];
      for (int i = 0; i < T; i++) {
        const uint8_t* tp = wp + i * stride * tile_bytes;
        const uint8_t* gp = tp + g * 64;
        if constexpr (F == Prefetch::kAhead) prefetch(gp + 2048);
        if constexpr (F == Prefetch::kNext) prefetch(gp + next * tile_bytes);
        if constexpr (nib) {
          const __m512i v = _mm512_load_si512(gp);
          w[i][0] = _mm512_and_si512(v, low4);
          w[i][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        } else {
          w[i][0] = w[i][1] = _mm512_setzero_si512();
        }
        if constexpr (two) {
          const __m512i h = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(tp + two_off + g * 32)));
          w[i][0] = merge_field<2, two_at, two0.left, two0.mixed, nib>(w[i][0], h, two_c0, two_m);
          w[i][1] = merge_field<2, two_at, two1.left, two1.mixed, nib>(w[i][1], h, two_c1, two_m);
        }
        if constexpr (one) {
          const __m512i h = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(tp + one_off + g * 16)));
          w[i][0] = merge_field<1, one_at, one0.left, one0.mixed, nib || two>(w[i][0], h, one_c0, one_m);
          w[i][1] = merge_field<1, one_at, one1.left, one1.mixed, nib || two>(w[i][1], h, one_c1, one_m);
        }
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
      // this tile and block's scale s and minimum mn (w = s q + mn) or zero point z (w = s (q - z)), in fp32
      // as gguf's dequantization forms them
      __m512 s, mn_or_z;
      constexpr bool minimums = L.scales == Scales::kKQuant || L.scales == Scales::kKQuant4 || L.scales == Scales::kHalfMin;
      if constexpr (Mode == 0) {
        mn_or_z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wts.zp + tb * kTile))));
        s = _mm512_loadu_ps(wts.sc + tb * kTile);
      } else if constexpr (Mode == 1) {
        const __m512i sm = _mm512_loadu_si512(wts.scale_min.data() + tb * 2 * kTile);
        s = _mm512_cvtph_ps(_mm512_castsi512_si256(sm));
        mn_or_z = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sm, 1));
      } else if constexpr (L.scales == Scales::kKQuant) {  // s = d * sc, mn = -(dmin * m)
        const size_t ts = (size_t)(t0 + i * stride) * wts.nsuper + b / (256 / L.block);
        const __m512i dm = _mm512_loadu_si512(wts.kd + ts * 2 * kTile);
        const __m256i scm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wts.ksc + tb * 2 * kTile));
        s = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(dm)),
                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(scm))));
        mn_or_z = _mm512_sub_ps(_mm512_setzero_ps(),
                                _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)),
                                              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(scm, 1)))));
      } else if constexpr (L.scales == Scales::kKQuant4) {  // as kKQuant, sc and m a byte's two nibbles
        const size_t ts = (size_t)(t0 + i * stride) * wts.nsuper + b / (256 / L.block);
        const __m512i dm = _mm512_loadu_si512(wts.kd + ts * 2 * kTile);
        const __m128i scm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wts.ksc + tb * kTile));
        const __m128i nib4 = _mm_set1_epi8(15);
        s = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(dm)),
                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(scm, nib4))));
        mn_or_z = _mm512_sub_ps(_mm512_setzero_ps(),
                                _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)),
                                              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(scm, 4), nib4)))));
      } else if constexpr (L.scales == Scales::kSix) {  // s = d * sc (int8), a zero point
        const size_t ts = (size_t)(t0 + i * stride) * wts.nsuper + b / (256 / L.block);
        s = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wts.kd + ts * kTile))),
                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wts.ksc + tb * kTile)))));
        mn_or_z = _mm512_set1_ps((float)L.zero);
      } else if constexpr (L.scales == Scales::kHalf) {  // s = d, the type's zero point
        s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wts.kd + tb * kTile)));
        mn_or_z = _mm512_set1_ps((float)L.zero);
      } else {  // s = d, mn = m
        const __m512i sm = _mm512_loadu_si512(wts.kd + tb * 2 * kTile);
        s = _mm512_cvtph_ps(_mm512_castsi512_si256(sm));
        mn_or_z = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sm, 1));
      }
      for (int r = 0; r < R; r++) {
        const size_t mb = (size_t)(m0 + r) * nblk + b;
        if constexpr (minimums) {
          acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][r]), _mm512_mul_ps(s, _mm512_set1_ps(acts.scale[mb])), acc[i][r]);
          acc[i][r] = _mm512_fmadd_ps(mn_or_z, _mm512_set1_ps(acts.scale[mb] * acts.sum[mb]), acc[i][r]);
        } else if constexpr (kFoldZero) {
          acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][r]), _mm512_mul_ps(s, _mm512_set1_ps(acts.scale[mb])), acc[i][r]);
        } else {
          const __m512 x = _mm512_fnmadd_ps(mn_or_z, _mm512_set1_ps(acts.sum[mb]), _mm512_cvtepi32_ps(dot[i][r]));
          acc[i][r] = _mm512_fmadd_ps(x, _mm512_mul_ps(s, _mm512_set1_ps(acts.scale[mb])), acc[i][r]);
        }
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
// AVX2: a's bytes' bits moved by S (left where S > 0, right where S < 0) in 16-bit lanes; a field of a byte
// that moves within the byte lands where the mask after it keeps it (the spill into the other byte is masked)
template <int S>
inline __m256i shift_bytes(__m256i a) {
  if constexpr (S > 0) return _mm256_slli_epi16(a, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(a, -S);
  else return a;
}
// the same with S0 for the low 128-bit half and S1 for the high one (32-bit lanes), both of one sign
template <int S0, int S1>
inline __m256i shift_halves(__m256i a) {
  static_assert((S0 >= 0 && S1 >= 0) || (S0 <= 0 && S1 <= 0), "a field line's halves move one way");
  if constexpr (S0 >= 0 && S1 >= 0) return _mm256_sllv_epi32(a, _mm256_setr_epi32(S0, S0, S0, S0, S1, S1, S1, S1));
  else return _mm256_srlv_epi32(a, _mm256_setr_epi32(-S0, -S0, -S0, -S0, -S1, -S1, -S1, -S1));
}

template <int T, int R, bool SwiGLU, Prefetch F, int Mode>
inline void tiles_rows(const PackedWeights& wts, const QuantizedRows& acts, int t0, int64_t m0, const Output& out,
                       int stride, int next) {
  constexpr OwnBits L = traits<Mode>();
  constexpr int GB = 16 * L.bits;  // bytes a group of 8 k takes in a tile (all its fields)
  constexpr bool nib = L.bits & 4, two = L.bits & 2, one = L.bits & 1;  // the fields (see OwnBits::bits)
  constexpr int two_at = nib ? 4 : 0, one_at = two_at + (two ? 2 : 0);  // where they go in a weight
  constexpr bool minimums = L.scales == Scales::kKQuant || L.scales == Scales::kKQuant4 || L.scales == Scales::kHalfMin;
  const int nblk = wts.nblk, block = wts.block, K = wts.Kp;
  const size_t tile_bytes = (size_t)nblk * (block / 8) * GB;
  const size_t two_off = (size_t)(block / 8) * 64 * nib, one_off = two_off + (size_t)(block / 8) * 32 * two;
  const size_t last_block = (size_t)wts.ntiles * nblk - 1;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i two_m = _mm256_set1_epi8((char)(3 << two_at)), one_m = _mm256_set1_epi8((char)(1 << one_at));
  constexpr bool kFoldZero = fold_zero<Mode>();
  __m256 acc[T][R][2];
  for (int i = 0; i < T; i++)
    for (int r = 0; r < R; r++) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_ps();
  for (int b = 0; b < nblk; b++) {
    const int8_t* ap = acts.q.data() + m0 * K + (size_t)b * block;
    for (int i = 0; i < T; i++) {
      const size_t tb = (size_t)(t0 + i * stride) * nblk + b;
      const uint8_t* wp = wts.wdata + tb * (block / 8) * GB;
      if constexpr (F != Prefetch::kNone) prefetch_scales<F, Mode>(wts, t0 + i * stride, next, b, last_block);
      __m256i dot[R][2];
      for (int r = 0; r < R; r++)
        dot[r][0] = dot[r][1] = kFoldZero ? _mm256_set1_epi32(-L.zero * (int32_t)acts.sum[(size_t)(m0 + r) * nblk + b])
                                          : _mm256_setzero_si256();
      for (int g = 0; g < block / 8; g++) {
        if constexpr (F == Prefetch::kAhead) prefetch(wp + g * 64 + 2048);
        if constexpr (F == Prefetch::kNext) prefetch(wp + next * tile_bytes + g * 64);
        __m256i v0 = _mm256_setzero_si256(), v1 = v0, h2 = v0, h1 = v0;
        if constexpr (nib) {
          v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + g * 64));
          v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + g * 64 + 32));
        }
        if constexpr (two) h2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + two_off + g * 32));
        if constexpr (one) h1 = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(wp + one_off + g * 16)));
        // each field moved to its place `at` by one shift (a 2-bit field sits at bit 4h + 2c of its byte for
        // register c; a 1-bit one at q + 4h, q = 2c and 2c + 1 in the two 128-bit halves), then merged under its mask
        auto half = [&](auto hc) {
          constexpr int H = decltype(hc)::value;
          __m256i w0 = H ? _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4) : _mm256_and_si256(v0, low4);
          __m256i w1 = H ? _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4) : _mm256_and_si256(v1, low4);
          if constexpr (two) {
            w0 = _mm256_or_si256(w0, _mm256_and_si256(shift_bytes<two_at - 4 * H>(h2), two_m));
            w1 = _mm256_or_si256(w1, _mm256_and_si256(shift_bytes<two_at - 4 * H - 2>(h2), two_m));
          }
          if constexpr (one) {
            w0 = _mm256_or_si256(w0, _mm256_and_si256(shift_halves<one_at - 4 * H, one_at - 4 * H - 1>(h1), one_m));
            w1 = _mm256_or_si256(w1, _mm256_and_si256(shift_halves<one_at - 4 * H - 2, one_at - 4 * H - 3>(h1), one_m));
          }
          for (int r = 0; r < R; r++) {
            int32_t word;
            std::memcpy(&word, ap + (size_t)r * K + g * 8 + H * 4, 4);
            const __m256i x = _mm256_set1_epi32(word);
            dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x), ones));
            dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x), ones));
          }
        };
        half(std::integral_constant<int, 0>{});
        half(std::integral_constant<int, 1>{});
      }
      auto half8 = [](const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
      for (int c = 0; c < 2; c++) {
        __m256 s, mn_or_z;  // as the AVX-512 path: w = s q + mn, or s (q - z)
        if constexpr (Mode == 0) {
          s = _mm256_loadu_ps(wts.sc + tb * kTile + 8 * c);
          mn_or_z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wts.zp + tb * kTile + 8 * c))));
        } else if constexpr (Mode == 1) {
          const uint16_t* sm = wts.scale_min.data() + tb * 2 * kTile;
          s = half8(sm + 8 * c);
          mn_or_z = half8(sm + kTile + 8 * c);
        } else if constexpr (L.scales == Scales::kKQuant) {  // s = d * sc, mn = -(dmin * m)
          const uint16_t* dm = wts.kd + ((size_t)(t0 + i * stride) * wts.nsuper + b / (256 / L.block)) * 2 * kTile;
          const uint8_t* scm = wts.ksc + tb * 2 * kTile;
          auto bytes8 = [](const uint8_t* p) {
            return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
          };
          s = _mm256_mul_ps(half8(dm + 8 * c), bytes8(scm + 8 * c));
          mn_or_z = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(half8(dm + kTile + 8 * c), bytes8(scm + kTile + 8 * c)));
        } else if constexpr (L.scales == Scales::kKQuant4) {  // as kKQuant, sc and m a byte's two nibbles
          const uint16_t* dm = wts.kd + ((size_t)(t0 + i * stride) * wts.nsuper + b / (256 / L.block)) * 2 * kTile;
          const __m128i scm = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wts.ksc + tb * kTile + 8 * c));
          const __m128i nib4 = _mm_set1_epi8(15);
          s = _mm256_mul_ps(half8(dm + 8 * c), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(scm, nib4))));
          mn_or_z = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(half8(dm + kTile + 8 * c),
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(scm, 4), nib4)))));
        } else if constexpr (L.scales == Scales::kSix) {  // s = d * sc (int8), a zero point
          const uint16_t* dp = wts.kd + ((size_t)(t0 + i * stride) * wts.nsuper + b / (256 / L.block)) * kTile;
          s = _mm256_mul_ps(half8(dp + 8 * c),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wts.ksc + tb * kTile + 8 * c)))));
          mn_or_z = _mm256_set1_ps((float)L.zero);
        } else if constexpr (L.scales == Scales::kHalf) {  // s = d, the type's zero point
          s = half8(wts.kd + tb * kTile + 8 * c);
          mn_or_z = _mm256_set1_ps((float)L.zero);
        } else {  // s = d, mn = m
          s = half8(wts.kd + tb * 2 * kTile + 8 * c);
          mn_or_z = half8(wts.kd + tb * 2 * kTile + kTile + 8 * c);
        }
        for (int r = 0; r < R; r++) {
          const size_t mb = (size_t)(m0 + r) * nblk + b;
          const __m256 d = _mm256_cvtepi32_ps(dot[r][c]);
          if constexpr (minimums) {
            acc[i][r][c] = _mm256_fmadd_ps(d, _mm256_mul_ps(s, _mm256_set1_ps(acts.scale[mb])), acc[i][r][c]);
            acc[i][r][c] = _mm256_fmadd_ps(mn_or_z, _mm256_set1_ps(acts.scale[mb] * acts.sum[mb]), acc[i][r][c]);
          } else if constexpr (kFoldZero) {
            acc[i][r][c] = _mm256_fmadd_ps(d, _mm256_mul_ps(s, _mm256_set1_ps(acts.scale[mb])), acc[i][r][c]);
          } else {
            const __m256 x = _mm256_fnmadd_ps(mn_or_z, _mm256_set1_ps(acts.sum[mb]), d);
            acc[i][r][c] = _mm256_fmadd_ps(x, _mm256_mul_ps(s, _mm256_set1_ps(acts.scale[mb])), acc[i][r][c]);
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

template <int T, bool SwiGLU, int Mode>
void tiles_all_rows(const PackedWeights& wts, const QuantizedRows& acts, int t0, int64_t M, const Output& out, int stride) {
  const int next = SwiGLU ? 1 : T;  // the next tile group: the next gate tile (and its up partner), or the next T
  const bool has_next = t0 + next < (SwiGLU ? stride : wts.ntiles);
  int64_t m = 0;
  for (; m + kRowsPer <= M; m += kRowsPer) {
    if (m == 0) tiles_rows<T, kRowsPer, SwiGLU, Prefetch::kAhead, Mode>(wts, acts, t0, m, out, stride, next);
    else if (m == kRowsPer && has_next) tiles_rows<T, kRowsPer, SwiGLU, Prefetch::kNext, Mode>(wts, acts, t0, m, out, stride, next);
    else tiles_rows<T, kRowsPer, SwiGLU, Prefetch::kNone, Mode>(wts, acts, t0, m, out, stride, next);
  }
  // the last 1-3 rows as one group: row by row, each would unpack the weights again (2 rows cost ~1.3x 4)
  auto tail = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if (m == 0) tiles_rows<T, R, SwiGLU, Prefetch::kAhead, Mode>(wts, acts, t0, m, out, stride, next);
    else tiles_rows<T, R, SwiGLU, Prefetch::kNone, Mode>(wts, acts, t0, m, out, stride, next);
  };
  switch (M - m) {
    case 1: return tail(std::integral_constant<int, 1>{});
    case 2: return tail(std::integral_constant<int, 2>{});
    case 3: return tail(std::integral_constant<int, 3>{});
    default: return;
  }
}

// output tiles [t_begin, t_end) of every row (with SwiGLU, an output tile is a gate tile and its up tile)
template <int Mode>
void gemm_tiles_as(const PackedWeights& wts, const QuantizedRows& acts, int64_t M, const Output& out, int t_begin,
                   int t_end, bool swiglu) {
  int t = t_begin;
  if (swiglu) {
    for (; t < t_end; t++) tiles_all_rows<2, true, Mode>(wts, acts, t, M, out, wts.ntiles / 2);
    return;
  }
  for (; t + kTilesPer <= t_end; t += kTilesPer) tiles_all_rows<kTilesPer, false, Mode>(wts, acts, t, M, out, 1);
  for (; t < t_end; t++) tiles_all_rows<1, false, Mode>(wts, acts, t, M, out, 1);
}

void gemm_tiles(const PackedWeights& wts, const QuantizedRows& acts, int64_t M, const Output& out, int t_begin, int t_end,
                bool swiglu) {
  switch (wts.mode()) {
    case 11: return gemm_tiles_as<11>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 10: return gemm_tiles_as<10>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 8: return gemm_tiles_as<8>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 7: return gemm_tiles_as<7>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 6: return gemm_tiles_as<6>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 5: return gemm_tiles_as<5>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 4: return gemm_tiles_as<4>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 3: return gemm_tiles_as<3>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 2: return gemm_tiles_as<2>(wts, acts, M, out, t_begin, t_end, swiglu);
    case 1: return gemm_tiles_as<1>(wts, acts, M, out, t_begin, t_end, swiglu);
    default: return gemm_tiles_as<0>(wts, acts, M, out, t_begin, t_end, swiglu);
  }
}

// ---- the custom operator ----

// Many rows' activations (a prefill chunk) are rounded in ranges of rows across the threads: one thread
// rounding 512 x 4,864 numbers kept the other waiting for a tenth of the product's time.
constexpr int64_t kQuantizeRows = 32;
struct QuantizeJob {
  QuantizedRows* rows;
  const float* A;
  int64_t M;
  int K, block;
};
void run_quantize(void* data, size_t i) {
  const QuantizeJob& j = *static_cast<QuantizeJob*>(data);
  const int64_t m = (int64_t)i * kQuantizeRows;
  quantize_row_range(*j.rows, j.A, m, std::min(j.M, m + kQuantizeRows), j.K, j.block);
}
OrtStatus* quantize_activations(OrtKernelContext* ctx, QuantizedRows& rows, const float* A, int64_t M, int K, int block) {
  size_rows(rows, M, K, block);
  if (M < 2 * kQuantizeRows) {
    quantize_row_range(rows, A, 0, M, K, block);
    return nullptr;
  }
  QuantizeJob job{&rows, A, M, K, block};
  return parallel_for(ctx, run_quantize, (size_t)((M + kQuantizeRows - 1) / kQuantizeRows), &job);
}

// Weight tiles a work item: `most`, halved (down to kTilesPer) until there are 16 items or more, so that the
// threads end level (896 columns in items of 8 tiles were 7 items: one of two threads did 4, a seventh more
// than its half).
inline int tiles_per_item(int tiles, int most) {
  int per = most;
  while (per > kTilesPer && (tiles + per - 1) / per < 16) per /= 2;
  return per;
}


enum class Epilogue { kOne, kSplit, kSwiGLU };  // MatMulQ4, MatMulQ4Split, MatMulQ4SwiGLU

struct Kernel {
  PackedWeights w;
  Epilogue epilogue = Epilogue::kOne;
  int64_t split = 0;  // MatMulQ4Split: columns of the first output
};

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

// A kernel object K made and its weights packed by pack(K&): running out of memory and a grid the kernel
// cannot hold are errors naming the operator
template <typename K, typename Pack>
OrtStatus* make_kernel(const std::string& op, Pack pack, void** out) {
  auto* k = new (std::nothrow) K();
  if (!k) return fail(op + ": out of memory");
  try {
    pack(*k);
  } catch (const std::bad_alloc&) {
    delete k;
    return fail(op + ": out of memory packing weights");
  } catch (const std::invalid_argument& e) {
    delete k;
    return fail(op + ": " + e.what());
  }
  *out = k;
  return nullptr;
}

// A matmul's input A [..., K]: the value, its dims and its rows (the product of the leading dims)
OrtStatus* matmul_input(OrtKernelContext* ctx, int64_t K, const std::string& op, const OrtValue** in,
                        std::vector<int64_t>& dims, int64_t* M) {
  RETURN_IF(api<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput)(ctx, 0, in));
  RETURN_IF(tensor_shape(*in, dims));
  if (dims.empty() || dims.back() != K) return fail(op + ": A's last dimension is not K");
  *M = 1;
  for (size_t i = 0; i + 1 < dims.size(); i++) *M *= dims[i];
  return nullptr;
}

// MatMulNBits' attributes K, N, block_size, checked for a kernel of `bits` (blocks of 32, tiles of 16 columns),
// and its inputs 1..n-1 (weights, scales, zero points[, minimums]), which must be initializers
OrtStatus* grid_inputs(const OrtKernelInfo* info, const std::string& op, int64_t bits, size_t n, int64_t* K,
                       int64_t* N, int64_t* block, const OrtValue** consts) {
  int64_t got_bits = 0;
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  RETURN_IF(attr(info, "K", K));
  RETURN_IF(attr(info, "N", N));
  RETURN_IF(attr(info, "bits", &got_bits));
  RETURN_IF(attr(info, "block_size", block));
  if (got_bits != bits || *block % 32 != 0 || *N % kTile != 0)
    return fail(op + ": needs bits=" + std::to_string(bits) + ", block_size a multiple of 32, N a multiple of 16");
  auto constant = api<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(kKernelInfoGetConstantInput_tensor);
  for (size_t i = 1; i < n; i++) {
    int is_const = 0;
    RETURN_IF(constant(info, i, &is_const, &consts[i]));
    if (!is_const) return fail(op + ": weights, scales, zero points and minimums must be initializers");
  }
  return nullptr;
}

// an int attribute that may be absent
int64_t attr_or(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t v = fallback;
  OrtStatus* st = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64)(info, name, &v);
  if (st) {
    api<void (*)(OrtStatus*)>(kReleaseStatus)(st);
    return fallback;
  }
  return v;
}

// The operator's epilogue (MatMulQ4, MatMulQ4Split, MatMulQ4SwiGLU) and its split, checked against N
OrtStatus* epilogue_attrs(const CustomOp* op, const OrtKernelInfo* info, int64_t N, Epilogue* epilogue, int64_t* split) {
  *epilogue = op == &g_matmul_split ? Epilogue::kSplit : op == &g_matmul_swiglu ? Epilogue::kSwiGLU : Epilogue::kOne;
  if (*epilogue == Epilogue::kSplit) {
    RETURN_IF(api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64)(info, "split", split));
    if (*split <= 0 || *split >= N || *split % kTile) return fail("ruvllm.MatMulQ4Split: split must be a multiple of 16 in (0, N)");
  }
  if (*epilogue == Epilogue::kSwiGLU && N % (2 * kTile)) return fail("ruvllm.MatMulQ4SwiGLU: N must be a multiple of 32");
  return nullptr;
}

// MatMulQ4 on a GGUF type at its own bits: inputs A and the exporter's layout (kquant: the type, 1-10 but 8, kOwnBits'
// order; K, N attributes)
OrtStatus* create_own_kernel(const CustomOp* op, const OrtKernelInfo* info, int64_t kind, void** out) {
  int64_t K = 0, N = 0, split = 0;
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  RETURN_IF(attr(info, "K", &K));
  RETURN_IF(attr(info, "N", &N));
  if (kind < 1 || kind > kOwnKinds || kind == kQ8Kind)
    return fail("ruvllm.MatMulQ4: unknown kquant " + std::to_string(kind) + (kind == kQ8Kind ? " (Q8_0 is ruvllm.MatMulQ8's)" : ""));
  const int mode = (int)kind + 1;
  const OwnBits& t = own_bits(mode);
  if (K % t.superblock || N % kTile)
    return fail(std::string("ruvllm.MatMulQ4 (") + t.name + "): needs K a multiple of " + std::to_string(t.superblock) +
                " and N of 16");
  const uint8_t* data = nullptr;
  RETURN_IF(constant_bytes(info, 1, own_bytes(mode, N, K), std::string("ruvllm.MatMulQ4 (") + t.name + "): the weights",
                           &data));
  Epilogue epilogue;
  RETURN_IF(epilogue_attrs(op, info, N, &epilogue, &split));
  return make_kernel<Kernel>("ruvllm.MatMulQ4", [&](Kernel& k) {
    k.epilogue = epilogue;
    k.split = split;
    pack_own(k.w, mode, (int)N, (int)K, data);
  }, out);
}

// MatMulQ4 on an int4 grid the exporter wrote in the kernel's layout (kquant kGridKind; K, N, block_size)
OrtStatus* create_grid_kernel(const CustomOp* op, const OrtKernelInfo* info, void** out) {
  int64_t K = 0, N = 0, block = 0, split = 0;
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  RETURN_IF(attr(info, "K", &K));
  RETURN_IF(attr(info, "N", &N));
  RETURN_IF(attr(info, "block_size", &block));
  if (block <= 0 || block % 32 || K % block || N % kTile)
    return fail("ruvllm.MatMulQ4 (int4 grid): needs block_size a multiple of 32, K a multiple of it, N of 16");
  const uint8_t* data = nullptr;
  RETURN_IF(constant_bytes(info, 1, grid_bytes(N, K, block), "ruvllm.MatMulQ4 (int4 grid): the weights", &data));
  Epilogue epilogue;
  RETURN_IF(epilogue_attrs(op, info, N, &epilogue, &split));
  return make_kernel<Kernel>("ruvllm.MatMulQ4", [&](Kernel& k) {
    k.epilogue = epilogue;
    k.split = split;
    pack_grid(k.w, (int)N, (int)K, (int)block, data);
  }, out);
}

OrtStatus* create_kernel(const CustomOp* op, const void*, const OrtKernelInfo* info, void** out) {
  const int64_t kind = attr_or(info, "kquant", 0);
  if (kind == kGridKind) return create_grid_kernel(op, info, out);
  if (kind) return create_own_kernel(op, info, kind, out);
  int64_t K = 0, N = 0, block = 0, has_mins = 0;  // mins: set by the graph rewrite (1: a fifth input, the minimums)
  RETURN_IF(api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64)(
      info, "mins", &has_mins));
  const OrtValue* consts[5] = {};
  RETURN_IF(grid_inputs(info, "ruvllm.MatMulQ4", 4, has_mins ? 5 : 4, &K, &N, &block, consts));
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
  Epilogue epilogue;
  int64_t split = 0;
  RETURN_IF(epilogue_attrs(op, info, N, &epilogue, &split));
  return make_kernel<Kernel>("ruvllm.MatMulQ4", [&](Kernel& k) {
    k.epilogue = epilogue;
    k.split = split;
    pack(k.w, (int)N, (int)K, (int)block, B, S, Z, Mn);
  }, out);
}

OrtStatus* compute_rows(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<Kernel*>(kernel);
  const PackedWeights& w = k.w;
  const OrtValue* in = nullptr;
  std::vector<int64_t> dims;
  int64_t M = 0;
  RETURN_IF(matmul_input(ctx, w.K, "ruvllm.MatMulQ4", &in, dims, &M));
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
  RETURN_IF(quantize_activations(ctx, rows, A, M, w.K, w.block));
  const bool swiglu = k.epilogue == Epilogue::kSwiGLU;
  // items of up to 8 weight tiles (128 columns; 4 output tiles with SwiGLU); a small product stays on this
  // thread, where a handoff costs more
  Work job{&w, &rows, M, out, tiles, tiles_per_item(tiles, swiglu ? 4 : 8), swiglu};
  const size_t items = (size_t)(tiles + job.tiles_per_item - 1) / job.tiles_per_item;
  if (items == 1 || (double)M * w.N * w.K < 2e5) {
    gemm_tiles(w, rows, M, out, 0, tiles, swiglu);
    return nullptr;
  }
  return parallel_for(ctx, run_item, items, &job);
}


}  // namespace
