// MatMulQ8: what `com.microsoft.MatMulNBits` (bits=8, accuracy_level 4) computes, for grids whose
// integers minus their zero point fit a signed byte (a GGUF's Q8_0, stored as q+128 with zero point 128;
// Q5/Q6 blocks widened to 8 bits). Why: a GGUF package's tied LM head is its Q8_0 embedding table, the
// largest weight of a small model, and MLAS's 8-bit kernel read it at about half the speed the bytes
// allow for one row (SmolLM2: ~2 ms of a 7-9 ms step).
//
// One pass of int8 x int8 products: with AVX-512 VNNI, vpdpbusd on q + 128 corrected by the activations'
// block sum; on AVX2, vpmaddubsw multiplies unsigned by signed bytes, so each weight byte w enters as |w|
// and the activation as sign(x, w) (x negated where w < 0, as llama.cpp's Q8_0 dot does); a pair's sum is
// at most 2 * 128 * 127, inside int16.
// Arithmetic per row and block, as MatMulQ4: a.w = s * sa * (qa.(q - z)), the integer product exact,
// qa the activations rounded to int8 per block (quantize_rows).
//
// Layout: per 16-column tile and block, block/4 lines of 64 bytes (byte 4j+i = w(column j, k+i), 4 k per
// int32 lane, columns 0-7 then 8-15) and then one line of the 16 columns' fp32 scales, so a tile streams
// through memory in order and the hardware prefetcher fetches its scales with its weights.
#pragma once

#include "matmul_q4.h"

namespace {

struct PackedQ8 {
  int N = 0, K = 0, block = 0, nblk = 0, ntiles = 0, Kp = 0;
  size_t tile_block_bytes = 0;  // block/4 weight lines and a scale line (a Q8_0 at its own bits: no scale line)
  std::unique_ptr<uint8_t[], void (*)(void*)> w{nullptr, WeightArena::free};
  const uint8_t* wdata = nullptr;  // w's copy, or the exporter's layout in place
  const uint16_t* half = nullptr;  // a Q8_0 at its own bits: its fp16 d, 16 a tile and block, after the weights
  const uint8_t* at(int t, int b) const { return wdata + ((size_t)t * nblk + b) * tile_block_bytes; }
};

// A GGUF's Q8_0 at its own bits (block_layouts.own_layout): per tile and block the weights' int8 lines as
// pack_q8 writes them, then every tile and block's 16 fp16 d; N*K + N*K/16 bytes (the file's 8.5 bits). Read
// in place when aligned, as the own-bit layouts of MatMulQ4 are.
void pack_q8_own(PackedQ8& wts, int N, int K, const uint8_t* blob) {
  if (K % 32 || N % kTile) throw std::invalid_argument("Q8_0 needs K a multiple of 32, N of 16");
  wts.N = N; wts.K = K; wts.block = 32; wts.nblk = K / 32; wts.ntiles = N / kTile; wts.Kp = K;
  wts.tile_block_bytes = (size_t)(32 / 4) * 64;
  map_or_copy(wts, blob, (size_t)N * K + (size_t)N * K / 16);
  wts.half = reinterpret_cast<const uint16_t*>(wts.wdata + (size_t)N * K);
}

// B: MatMulNBits' 8-bit [N, K/block, block]; S: fp32 [N, K/block]; Z: uint8 [N, K/block] or null (128)
void pack_q8(PackedQ8& wts, int N, int K, int block, const uint8_t* B, const float* S, const uint8_t* Z) {
  wts.N = N; wts.K = K; wts.block = block; wts.nblk = (K + block - 1) / block; wts.ntiles = N / kTile;
  wts.Kp = wts.nblk * block;
  wts.tile_block_bytes = (size_t)(block / 4 + 1) * 64;
  const size_t bytes = (size_t)wts.ntiles * wts.nblk * wts.tile_block_bytes;
  wts.w.reset(static_cast<uint8_t*>(WeightArena::instance().allocate(bytes)));
  wts.wdata = wts.w.get();
  for (int t = 0; t < wts.ntiles; t++)
    for (int b = 0; b < wts.nblk; b++) {
      uint8_t* dst = wts.w.get() + ((size_t)t * wts.nblk + b) * wts.tile_block_bytes;
      float* scales = reinterpret_cast<float*>(dst + (size_t)(block / 4) * 64);
      for (int j = 0; j < kTile; j++) {
        const int n = t * kTile + j;
        const size_t nb = (size_t)n * wts.nblk + b;
        const int z = Z ? Z[nb] : 128;
        const uint8_t* src = B + nb * block;
        for (int k = 0; k < block; k++) {
          const int q = src[k] - z;
          if (q < -128 || q > 127) throw std::invalid_argument("8-bit weights minus their zero point must fit a signed byte");
          dst[(k / 4) * 64 + 4 * j + (k % 4)] = (uint8_t)(int8_t)q;
        }
        scales[j] = S[nb];
      }
    }
}

#if RUVLLM_AVX512
// T tiles (t, t + 1, ...) x R rows. vpdpbusd multiplies unsigned by signed bytes with no int16 step, so each
// weight byte enters as q + 128 (one xor per line, shared by the rows) and the block's product is corrected
// by 128 * sum(qa), the quantized activations' block sum: (q + 128).qa - 128 * sum(qa) = q.qa, exact in
// int32, the same integers as the AVX2 path below. One tile at a time streams the weights in order, which
// a row or two (bound by memory) want; from 4 rows on, two tiles share each broadcast activation word.
template <int T, int R>
inline void q8_tile_rows(const PackedQ8& wts, const QuantizedRows& acts, int t, int64_t m0, const Output& out) {
  const int K = wts.Kp, groups = wts.block / 4;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[T][R];
  for (int i = 0; i < T; i++)
    for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
  for (int b = 0; b < wts.nblk; b++) {
    const int8_t* ap = acts.q.data() + m0 * K + (size_t)b * wts.block;
    __m512i dot[T][R];  // each row's sums start at -128 sum(qa): the correction below, taken in the integers
    for (int r = 0; r < R; r++) {
      const __m512i start = _mm512_set1_epi32(-128 * (int32_t)acts.sum[(size_t)(m0 + r) * wts.nblk + b]);
      for (int i = 0; i < T; i++) dot[i][r] = start;
    }
    for (int g = 0; g < groups; g++) {
      __m512i w[T];
      for (int i = 0; i < T; i++) w[i] = _mm512_xor_si512(_mm512_load_si512(wts.at(t + i, b) + g * 64), flip);
      for (int r = 0; r < R; r++) {
        int32_t word;
        std::memcpy(&word, ap + (size_t)r * K + g * 4, 4);
        const __m512i x = _mm512_set1_epi32(word);
        for (int i = 0; i < T; i++) dot[i][r] = _mm512_dpbusd_epi32(dot[i][r], w[i], x);
      }
    }
    for (int i = 0; i < T; i++) {
      const __m512 s = wts.half ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wts.half + ((size_t)(t + i) * wts.nblk + b) * kTile)))
                                : _mm512_load_ps(reinterpret_cast<const float*>(wts.at(t + i, b) + (size_t)groups * 64));
      for (int r = 0; r < R; r++) {
        const size_t mb = (size_t)(m0 + r) * wts.nblk + b;
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][r]), _mm512_mul_ps(s, _mm512_set1_ps(acts.scale[mb])), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < T; i++)
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out.at(m0 + r, t + i), acc[i][r]);
}

#else
// one tile (16 columns, as two halves of 8) x R rows
template <int T, int R>
inline void q8_tile_rows(const PackedQ8& wts, const QuantizedRows& acts, int t, int64_t m0, const Output& out) {
  static_assert(T == 1, "AVX2: one tile at a time");
  const int K = wts.Kp, groups = wts.block / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int b = 0; b < wts.nblk; b++) {
    const uint8_t* wp = wts.at(t, b);
    const int8_t* ap = acts.q.data() + m0 * K + (size_t)b * wts.block;
    __m256i dot[R][2];
    for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < groups; g++) {
      const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + g * 64));
      const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + g * 64 + 32));
      const __m256i a0 = _mm256_abs_epi8(v0), a1 = _mm256_abs_epi8(v1);
      for (int r = 0; r < R; r++) {
        int32_t word;
        std::memcpy(&word, ap + (size_t)r * K + g * 4, 4);
        const __m256i x = _mm256_set1_epi32(word);
        dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, v0)), ones));
        dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, v1)), ones));
      }
    }
    __m256 s0, s1;
    if (wts.half) {
      const uint16_t* h = wts.half + ((size_t)t * wts.nblk + b) * kTile;
      s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
      s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
    } else {
      const float* s = reinterpret_cast<const float*>(wp + (size_t)groups * 64);
      s0 = _mm256_load_ps(s);
      s1 = _mm256_load_ps(s + 8);
    }
    for (int r = 0; r < R; r++) {
      const __m256 sa = _mm256_set1_ps(acts.scale[(size_t)(m0 + r) * wts.nblk + b]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(s0, sa), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), _mm256_mul_ps(s1, sa), acc[r][1]);
    }
  }
  for (int r = 0; r < R; r++) {
    float* c = out.at(m0 + r, t);
    _mm256_storeu_ps(c, acc[r][0]);
    _mm256_storeu_ps(c + 8, acc[r][1]);
  }
}
#endif

void q8_tiles(const PackedQ8& wts, const QuantizedRows& acts, int64_t M, const Output& out, int t_begin, int t_end) {
  int t = t_begin;
  auto tiles = [&](auto width) {
    constexpr int T = decltype(width)::value;
    int64_t m = 0;
    for (; m + kRowsPer <= M; m += kRowsPer) q8_tile_rows<T, kRowsPer>(wts, acts, t, m, out);
    switch (M - m) {
      case 1: q8_tile_rows<T, 1>(wts, acts, t, m, out); break;
      case 2: q8_tile_rows<T, 2>(wts, acts, t, m, out); break;
      case 3: q8_tile_rows<T, 3>(wts, acts, t, m, out); break;
      default: break;
    }
  };
  if (RUVLLM_AVX512 && M >= kRowsPer)
    for (; t + kTilesPer <= t_end; t += kTilesPer) tiles(std::integral_constant<int, kTilesPer>{});
  for (; t < t_end; t++) tiles(std::integral_constant<int, 1>{});
}

// ---- the custom operator ----

struct Q8Kernel {
  PackedQ8 w;
};

struct Q8Work {
  const PackedQ8* w;
  const QuantizedRows* a;
  int64_t M;
  Output out;
  int tiles_per_item;
};

void run_q8_item(void* data, size_t i) {
  const Q8Work& job = *static_cast<Q8Work*>(data);
  const int begin = (int)i * job.tiles_per_item;
  q8_tiles(*job.w, *job.a, job.M, job.out, begin, std::min(job.w->ntiles, begin + job.tiles_per_item));
}

// MatMulQ8 on a GGUF's Q8_0 at its own bits: inputs A and the exporter's layout (kquant 8; K, N attributes)
OrtStatus* create_q8_own(const OrtKernelInfo* info, void** out) {
  int64_t K = 0, N = 0;
  auto attr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64);
  RETURN_IF(attr(info, "K", &K));
  RETURN_IF(attr(info, "N", &N));
  if (K % 32 || N % kTile) return fail("ruvllm.MatMulQ8 (Q8_0): needs K a multiple of 32 and N of 16");
  const uint8_t* data = nullptr;
  RETURN_IF(constant_bytes(info, 1, (size_t)(N * K + N * K / 16), "ruvllm.MatMulQ8 (Q8_0): the weights", &data));
  return make_kernel<Q8Kernel>("ruvllm.MatMulQ8", [&](Q8Kernel& k) { pack_q8_own(k.w, (int)N, (int)K, data); }, out);
}

OrtStatus* create_q8(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  if (attr_or(info, "kquant", 0) == 8) return create_q8_own(info, out);
  int64_t K = 0, N = 0, block = 0;
  const OrtValue* consts[4] = {};
  RETURN_IF(grid_inputs(info, "ruvllm.MatMulQ8", 8, 4, &K, &N, &block, consts));
  const uint8_t *B = nullptr, *Z = nullptr;
  const float* S = nullptr;
  RETURN_IF(tensor_data(consts[1], &B));
  RETURN_IF(tensor_data(consts[2], &S));
  RETURN_IF(tensor_data(consts[3], &Z));
  const int64_t nblk = (K + block - 1) / block;
  std::vector<int64_t> dims;
  RETURN_IF(tensor_shape(consts[1], dims));
  if (dims.size() != 3 || dims[0] != N || dims[1] != nblk || dims[2] != block)
    return fail("ruvllm.MatMulQ8: B is not [N, K/block_size, block_size]");
  for (size_t i = 2; i < 4; i++) {
    RETURN_IF(tensor_shape(consts[i], dims));
    int64_t count = 1;
    for (int64_t d : dims) count *= d;
    if (count != N * nblk) return fail("ruvllm.MatMulQ8: scales and zero points are not N * K/block_size");
  }
  return make_kernel<Q8Kernel>("ruvllm.MatMulQ8", [&](Q8Kernel& k) { pack_q8(k.w, (int)N, (int)K, (int)block, B, S, Z); },
                               out);
}

OrtStatus* compute_q8(void* kernel, OrtKernelContext* ctx) {
  const PackedQ8& w = static_cast<Q8Kernel*>(kernel)->w;
  const OrtValue* in = nullptr;
  std::vector<int64_t> dims;
  int64_t M = 0;
  RETURN_IF(matmul_input(ctx, w.K, "ruvllm.MatMulQ8", &in, dims, &M));
  dims.back() = w.N;
  Output out{nullptr, nullptr, w.N, 0, w.ntiles};
  RETURN_IF(output_data(ctx, 0, dims.data(), dims.size(), &out.c0));
  const float* A = nullptr;
  RETURN_IF(tensor_data(in, &A));
  if (M == 0) return nullptr;
  thread_local QuantizedRows rows;
  RETURN_IF(quantize_activations(ctx, rows, A, M, w.K, w.block));
  Q8Work job{&w, &rows, M, out, tiles_per_item(w.ntiles, 8)};
  const size_t items = (size_t)(w.ntiles + job.tiles_per_item - 1) / job.tiles_per_item;
  if (items == 1 || (double)M * w.N * w.K < 2e5) {
    q8_tiles(w, rows, M, out, 0, w.ntiles);
    return nullptr;
  }
  return parallel_for(ctx, run_q8_item, items, &job);
}

}  // namespace
