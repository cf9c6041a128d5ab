// One engine step of a llama or Qwen2 model in WASM SIMD, for the page without onnxruntime-web (issue 33):
// the rows of a StepBatch (prompt chunks and decodes of many sequences) against a paged KV pool, the
// engine's block tables and slots, logits for the rows that ask. Weights are the GGUF's own blocks at their
// own bits, repacked (exporter/step_weights.py; blocks.h computes on them), fp32 norms and biases.
// Activations are rounded per block of 32 to int8 before each projection (kernels.h), as the native
// engine's MatMulQ4 does; norms, RoPE (the GGUF's q/k row order), attention and SwiGLU in fp32. Every
// token's numbers are computed alone (per-token projections, attention over its own row's positions), so
// a token's logits do not depend on the batch it ran in. Built with threads (threads.h),
// each projection's output rows, the attention heads and the head's vocabulary are split between them.
#include "kv.h"
#include "threads.h"

// Model, Layer, Pool, Batch, Lora, Sampling (and learn.h's Learn): abi.h, generated from
// runtime/formats/step_abi.py, which the callers (wasm/step_module.py, web/src/wasm_step.js) pack through.
// A StepBatch (runtime/core/step_batch.py) as int32 arrays: row b's tokens are row_first[b] ..
// row_first[b] + row_count[b] - 1, at consecutive positions; token n's K/V go to pool slot slots[n]
// (block * block_size + offset); logits rows are tokens logits_at[0 .. num_logits - 1].
// A step's adapters (web/src/lora_store.js's adapter columns, in the module's memory): each target's
// output gains ((x A^T) * w) B, as the LoRA graph computes it (exporter/builders/lora_path.py), in fp32 on
// the target's fp32 input. B of q and k holds its rows in the GGUF's order, as step.c's q and k are.

static float *x, *xn, *q, *kk, *vv, *att, *sc, *g, *u, *xs, *xsum, *xsum16, *kvq;
static int8_t* xq;
static const uint8_t** kv_rows;  // per part: a segment's stored rows' and scales' addresses (segment_partial)
static float* kv_partials;       // [KV_SPLIT_ITEMS, max_pos / KV_SEGMENT + 1, G * (hd + 2)]: a split step's segments
#define KV_SPLIT_ITEMS 16          // (token, kv head) items a step splits by segments at most
static int32_t* row_of;       // a step's token -> its batch row
static float* rope_rows;      // [2, capacity, head_dim]: a step's tokens' cos, sin for up to two RoPE bases
static const double* rope_of[2];  // the inverse frequencies each half of rope_rows holds this step, or null
static int32_t capacity = 0;  // tokens a step may hold (step_init)
static int32_t width = 0;     // the widest activation row it holds

// Scratch for steps of up to max_tokens tokens; 0 when the memory cannot grow that far.
EXPORT int step_init(const Model* m, int32_t max_tokens) {
  const int32_t big = m->hidden > m->dim ? m->hidden : m->dim, n = max_tokens;
  x = arena(4 * n * m->dim), xn = arena(4 * n * big), q = arena(4 * n * m->heads * m->head_dim);
  kk = arena(4 * n * m->kv_heads * m->head_dim), vv = arena(4 * n * m->kv_heads * m->head_dim);
  att = arena(4 * n * m->heads * m->head_dim), g = arena(4 * n * m->hidden), u = arena(4 * n * m->hidden);
  const int G = m->heads / m->kv_heads;
  sc = arena(4 * MAX_THREADS * m->max_pos), xs = arena(4 * n * big / 32), xsum = arena(4 * n * big / 32);
  xsum16 = arena(4 * n * big / 16);
  kvq = arena(4 * MAX_THREADS * KV_WORK(G, m->head_dim));  // per part: attend_quantized's work
  kv_rows = arena(4 * MAX_THREADS * KV_ROWS(m->head_dim) * KV_SEGMENT);
  kv_partials = arena(4 * KV_SPLIT_ITEMS * (m->max_pos / KV_SEGMENT + 1) * G * (m->head_dim + 2));
  row_of = arena(4 * n), xq = arena(n * big), rope_rows = arena(4u * 2 * n * m->head_dim);
  capacity = xq && kvq && kv_rows && kv_partials && rope_rows ? max_tokens : 0;
  width = big;
  return capacity;
}

static inline float exp_(float v) {  // e^v to ~1e-7 relative: 2^n times a polynomial on [-ln2/2, ln2/2]
  if (v < -87.f) return 0.f;
  if (v > 88.f) v = 88.f;
  const float n = __builtin_rintf(v * 1.44269504f);
  const float r = v - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f + r * 0.0013888889f)))));
  union { float f; int32_t i; } s;
  s.i = ((int32_t)n + 127) << 23;
  return p * s.f;
}

static float dot(const float* a, const float* b, int n) {
  v128_t acc = wasm_f32x4_splat(0.f);
  for (int i = 0; i < n; i += 4) acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_v128_load(a + i), wasm_v128_load(b + i)));
  return wasm_f32x4_extract_lane(acc, 0) + wasm_f32x4_extract_lane(acc, 1) + wasm_f32x4_extract_lane(acc, 2) +
         wasm_f32x4_extract_lane(acc, 3);
}

// out = in / rms(in) * w; returns 1 / rms(in) (the backward's, learn.h)
static float rmsnorm(const float* in, const float* w, int n, float eps, float* out) {
  const float inv = 1.f / __builtin_sqrtf(dot(in, in, n) / n + eps);
  for (int i = 0; i < n; i += 4)
    wasm_v128_store(out + i, wasm_f32x4_mul(wasm_f32x4_mul(wasm_v128_load(in + i), wasm_f32x4_splat(inv)), wasm_v128_load(w + i)));
  return inv;
}

// x [T, D] += each row of y normed by w (a sandwich norm: a block's output normed before its residual add)
static void add_normed(float* x, float* y, const float* w, int T, int D, float eps) {
  for (int t = 0; t < T; t++) {
    rmsnorm(y + (size_t)t * D, w, D, eps, y + (size_t)t * D);
    for (int i = 0; i < D; i++) x[(size_t)t * D + i] += y[(size_t)t * D + i];
  }
}

// the tanh approximation of GELU (Gemma's GeGLU), tanh from exp_: 1 - 2 / (e^2u + 1)
static inline float gelu_tanh(float v) {
  const float u = 0.7978845608f * (v + 0.044715f * v * v * v);
  return 0.5f * v * (2.f - 2.f / (exp_(2.f * u) + 1.f));
}

// every row of `in` [T, K] rounded alone (xq, xs, xsum: T rows), for the projections that read them
static void quantize_rows(const float* in, int T, int K) {
  for (int t = 0; t < T; t++)
    quantize_x(in + (size_t)t * K, K, xq + (size_t)t * K, xs + (size_t)t * (K / 32), xsum + (size_t)t * (K / 32),
               xsum16 + (size_t)t * (K / 16));
}

// Up to three projections of the same rounded rows (xq, xs, xsum: T rows of K), out [T, N] each, as one
// job: each part takes its share of every projection's output rows. `gated`: then out[0] = silu(out[0]) *
// out[1] (SwiGLU) on the part's own columns; `residual`: then residual += out[0] on them.
typedef struct {
  int T, K, count, gated;
  const QMat* w[3];
  const float* bias[3];  // added to each token's outputs, or null
  int N[3];
  float* out[3];
  float* residual;
  int columns;             // adapter columns, 0 without adapters
  const float *u[3], *b[3];  // per projection: the tokens' (x A^T) * w [T, columns] and B [columns, N], or null
} Projections;

// rows [lo, hi) of projection i gain the adapters' delta u B
static void adapter_rows(const Projections* j, int i, int lo, int hi) {
  const int C = j->columns, N = j->N[i];
  for (int t = 0; t < j->T; t++) {
    float* y = j->out[i] + (size_t)t * N;
    const float* ut = j->u[i] + (size_t)t * C;
    for (int c = 0; c < C; c++) {
      if (ut[c] == 0.f) continue;  // a base token, or another adapter's column
      const v128_t s = wasm_f32x4_splat(ut[c]);
      const float* bc = j->b[i] + (size_t)c * N;
      for (int o = lo; o < hi; o += 4)
        wasm_v128_store(y + o, wasm_f32x4_add(wasm_v128_load(y + o), wasm_f32x4_mul(s, wasm_v128_load(bc + o))));
    }
  }
}

static void projections_part(const void* ctx, int part, int parts) {
  const Projections* j = ctx;
  for (int i = 0; i < j->count; i++) {
    int lo, hi;
    part_range(j->N[i], 4, part, parts, &lo, &hi);
    qmat_gemm(j->w[i], lo, hi, j->K, j->T, xq, xs, xsum, xsum16, j->out[i], j->N[i]);
    if (j->bias[i])
      for (int t = 0; t < j->T; t++)
        for (int c = lo; c < hi; c++) j->out[i][(size_t)t * j->N[i] + c] += j->bias[i][c];
    if (j->u[i]) adapter_rows(j, i, lo, hi);
  }
  int lo, hi;
  part_range(j->N[0], 4, part, parts, &lo, &hi);
  for (int t = 0; t < j->T; t++) {
    float* a = j->out[0] + (size_t)t * j->N[0];
    if (j->gated == 1 + ACT_SILU)
      for (int c = lo; c < hi; c++) a[c] = a[c] / (1.f + exp_(-a[c])) * j->out[1][(size_t)t * j->N[1] + c];
    else if (j->gated == 1 + ACT_GELU_TANH)
      for (int c = lo; c < hi; c++) a[c] = gelu_tanh(a[c]) * j->out[1][(size_t)t * j->N[1] + c];
    if (j->residual)
      for (int c = lo; c < hi; c++) j->residual[(size_t)t * j->N[0] + c] += a[c];
  }
}

// The projections of layer l's targets first .. first + count - 1 (q k v o gate up down: 0 .. 6) on x
// [T, K] (fp32; xq, xs and xsum hold it rounded), with the step's adapters where it has some.
static void project(const Model* m, const Lora* ad, int l, int first, const float* x, int T, int K, int count,
                    const int* N, float* const* out, int gated, float* residual) {
  Projections j = {T, K, count, gated, {0}, {0}, {0}, {0}, residual, 0, {0}, {0}};
  const Layer* L = &m->layer[l];
  for (int i = 0; i < count; i++)
    j.w[i] = &L->mat[first + i], j.N[i] = N[i], j.out[i] = out[i], j.bias[i] = first + i < 3 ? L->bias[first + i] : 0;
  if (ad && ad->columns > 0) {
    const int C = ad->columns;
    j.columns = C;
    for (int i = 0; i < count; i++) {
      const float* a = ad->a[l * LORA_TARGETS + first + i];
      if (!a) continue;
      float* mix = ad->u + (size_t)i * T * C;
      for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) {
          const float wt = ad->weights[(size_t)t * C + c];
          mix[(size_t)t * C + c] = wt == 0.f ? 0.f : dot(x + (size_t)t * K, a + (size_t)c * K, K) * wt;
        }
      j.u[i] = mix, j.b[i] = ad->b[l * LORA_TARGETS + first + i];
    }
  }
  parallel(projections_part, &j);
}

// each head's pairs rotated: adjacent numbers (a llama GGUF's rows), or i and i + hd / 2 (NeoX: Qwen2's);
// turn -1 rotates them back (the backward's transpose, learn.h)
static void rope_turn(float* v, int heads, int hd, const float* cs, int neox, float turn) {
  const int step = neox ? 1 : 2, apart = neox ? hd / 2 : 1;
  for (int h = 0; h < heads; h++)
    for (int i = 0; i < hd / 2; i++) {
      float* p = v + h * hd + step * i;
      const float c = cs[2 * i], s = turn * cs[2 * i + 1], a = p[0], b = p[apart];
      p[0] = a * c - b * s;
      p[apart] = a * s + b * c;
    }
}

static void rope(float* v, int heads, int hd, const float* cs, int neox) { rope_turn(v, heads, hd, cs, neox, 1.f); }

// cos and sin of a (radians, |a| below ~1e9) in double, with no libm (freestanding): reduced by pi/2 in three
// parts (each k * part exact for k under 2^20), then Taylor series on [-pi/4, pi/4] (remainders below 1e-21)
static void sincos_d(double a, double* s, double* c) {
  const double k = __builtin_rint(a * 0.63661977236758134308);
  const double r = ((a - k * 1.57079632673412561417e+00) - k * 6.07710050630396597660e-11) - k * 2.02226624879595063154e-21;
  const double r2 = r * r;
  // Horner: sin r = r (1 - r2/(2*3) (1 - r2/(4*5) (1 - ...))), cos r = 1 - r2/(1*2) (1 - r2/(3*4) (1 - ...)),
  // the divisors' reciprocals folded by the compiler (no division at run time)
#define RECIP(a, b) (1.0 / ((double)(a) * (b)))
  static const double rs[9] = {RECIP(2, 3), RECIP(4, 5), RECIP(6, 7), RECIP(8, 9), RECIP(10, 11), RECIP(12, 13),
                               RECIP(14, 15), RECIP(16, 17), RECIP(18, 19)};
  static const double rc[9] = {RECIP(1, 2), RECIP(3, 4), RECIP(5, 6), RECIP(7, 8), RECIP(9, 10), RECIP(11, 12),
                               RECIP(13, 14), RECIP(15, 16), RECIP(17, 18)};
#undef RECIP
  double sn = 1.0, cn = 1.0;
  for (int i = 8; i >= 0; i--) sn = 1.0 - r2 * rs[i] * sn, cn = 1.0 - r2 * rc[i] * cn;
  sn *= r;
  const double sq[4] = {sn, cn, -sn, -cn}, cq[4] = {cn, -sn, -cn, sn};
  const int quadrant = (int)((long long)k & 3);
  *s = sq[quadrant], *c = cq[quadrant];
}

// a position's cos and sin per frequency pair, rounded to fp32 from double (as the exporter's tables were)
static void rope_row(const double* inv, const float* factors, int hd, int pos, float* out) {
  for (int i = 0; i < hd / 2; i++) {
    double s, c;
    sincos_d((double)pos * (factors ? inv[i] / (double)factors[i] : inv[i]), &s, &c);
    out[2 * i] = (float)c, out[2 * i + 1] = (float)s;
  }
}

// the step's tokens' cos, sin rows [N, head_dim] for these inverse frequencies, made at the first ask a step
static const float* rope_rows_for(const Model* m, const Batch* B, const double* inv) {
  const int hd = m->head_dim;
  for (int i = 0; i < 2; i++) {
    float* rows = rope_rows + (size_t)i * capacity * hd;
    if (rope_of[i] == inv) return rows;
    if (!rope_of[i]) {
      for (int n = 0; n < B->num_tokens; n++) rope_row(inv, m->rope_factors, hd, B->pos[n], rows + (size_t)n * hd);
      rope_of[i] = inv;
      return rows;
    }
  }
  return 0;  // a third base: step_run refuses it first
}

// head h of token n (row b, position p) over its row's positions 0 .. p in layer l's pool: out [hd];
// sc: room for p + 1 scores
static void attend(const Model* m, const Pool* P, const Batch* B, int l, int b, int p, int h, const float* qn,
                   float* out, float* sc) {
  const int hd = m->head_dim, Hkv = m->kv_heads, G = m->heads / Hkv, bs = P->block_size;
  const size_t rows = (size_t)P->num_blocks * bs;
  const int32_t* table = B->tables + (size_t)b * B->max_blocks;
  const float scale = m->attn_scale;
  const int window = m->layer[l].window, lo = window && p - window + 1 > 0 ? p - window + 1 : 0;
  const float* kh = P->k + ((size_t)l * Hkv + h / G) * rows * hd;
  const float* vh = P->v + ((size_t)l * Hkv + h / G) * rows * hd;
  float mx = -3.4e38f, sum = 0.f;
  for (int t = lo; t <= p; t++) {
    sc[t] = dot(qn, kh + ((size_t)table[t / bs] * bs + t % bs) * hd, hd) * scale;
    mx = sc[t] > mx ? sc[t] : mx;
  }
  for (int t = lo; t <= p; t++) sum += (sc[t] = exp_(sc[t] - mx));
  for (int i = 0; i < hd; i += 4) wasm_v128_store(out + i, wasm_f32x4_splat(0.f));
  for (int t = lo; t <= p; t++) {
    const v128_t w = wasm_f32x4_splat(sc[t] / sum);
    const float* vt = vh + ((size_t)table[t / bs] * bs + t % bs) * hd;
    for (int i = 0; i < hd; i += 4)
      wasm_v128_store(out + i, wasm_f32x4_add(wasm_v128_load(out + i), wasm_f32x4_mul(w, wasm_v128_load(vt + i))));
  }
}

// The first position a query at p of row b reads exact on a quantized pool: its own block's first, or the
// first of the tail_blocks - 1 blocks before it at or after the row's floor (ruvllm.PagedAttention's own_block)
static inline int own_block(const Pool* P, const Batch* B, int b, int p) {
  const int bs = P->block_size, own = p - p % bs, before = own - (P->tail_blocks - 1) * bs;
  const int floor = B->exact_from[b] > before ? B->exact_from[b] : before;
  return own < floor ? own : floor;
}

// where layer l's kind (0 keys, 1 values) of kv head h keeps pool slot `slot`: its numbers and its scales
static inline const uint8_t* pooled(const Model* m, const Pool* P, int kind, int l, int h, size_t slot,
                                    const uint16_t** scales) {
  const size_t rows = (size_t)P->num_blocks * P->block_size, at = ((size_t)l * m->kv_heads + h) * rows + slot;
  const int d = m->head_dim;
  *scales = (kind ? P->vs : P->ks) + at * kv_width(P->dtype, d, kind);
  return (const uint8_t*)(kind ? P->v : P->k) + at * kv_row_bytes(P->dtype, d);
}

// position t's exact row of kind (0 keys, 1 values) for row b's kv head h in layer l: from its block's tail
// slot before the row's first position of this step, from this step's rows (kk, vv) from it on
static inline const float* exact_row(const Model* m, const Pool* P, const Batch* B, int kind, int l, int b, int h, int t) {
  const int bs = P->block_size, hd = m->head_dim, start = B->pos[B->row_first[b]];
  if (t >= start) return (kind ? vv : kk) + ((size_t)(B->row_first[b] + t - start) * m->kv_heads + h) * hd;
  const int block = B->tables[(size_t)b * B->max_blocks + t / bs];
  const float* tail = P->tails[P->tail_of[block]];
  return tail + ((((size_t)kind * m->layers + l) * m->kv_heads + h) * bs + t % bs) * hd;
}

// Attention on a quantized pool (attend's, for G query heads of kv head hk at once, qn: their rows head_dim
// apart): positions before own_block(p) as stored (keys against the queries rounded to 16 bits, as natively),
// from it on exact. It runs over fixed segments of KV_SEGMENT positions, each giving its heads' max, sum of
// exps and undivided weighted values, folded left to right: a short step's segments can be computed in
// parallel and folded after, with the same numbers as a long step's folded one after the other (KV_SEGMENT).

typedef struct {  // a query's G heads, rounded for the stored keys
  const float* qn;  // [G, hd]: as computed, for exact rows
  int16_t* qs;      // [G, hd]: rounded (int4: rotated first)
  float *steps, *qsum;
} Queries;

static void prepare_queries(int G, int hd, int int4, const float* qn, float* work, Queries* Q) {
  Q->qn = qn, Q->qs = (int16_t*)work, Q->steps = work + G * hd / 2, Q->qsum = Q->steps + G;
  round_queries(qn, G, hd, int4, Q->qs, Q->steps, Q->qsum, Q->qsum + G * hd / 32);
}

// segment `seg` of the query at p (row b) for its G heads: mx[h], sum[h], o [G, hd] (undivided). scratch:
// KV_SEG_WORK(G, hd) floats; rows: KV_SEGMENT * KV_ROWS(hd) words
static void segment_partial(const Model* m, const Pool* P, const Batch* B, int l, int b, int p, int hk, int G,
                            const Queries* Q, int seg, float* mx, float* sum, float* o, float* scratch,
                            const uint8_t** rows) {
  const int hd = m->head_dim, bs = P->block_size, int4 = P->dtype == KV_INT4;
  const int32_t* table = B->tables + (size_t)b * B->max_blocks;
  const int lo = seg * KV_SEGMENT, hi = lo + KV_SEGMENT < p + 1 ? lo + KV_SEGMENT : p + 1, n = hi - lo;
  const int own = own_block(P, B, b, p), stored = own < hi ? (own > lo ? own : lo) : hi;  // [lo, stored) as stored
  const float scale = 1.f / __builtin_sqrtf((float)hd);
  float *sc = scratch, *rot = sc + G * KV_SEGMENT, *row_sc = rot + G * hd;
  for (int t = lo; t < hi; t++) {  // sc[h * n + t - lo]: head h's score of position t
    if (t >= stored) {
      const float* k = exact_row(m, P, B, 0, l, b, hk, t);
      for (int h = 0; h < G; h++) sc[h * n + t - lo] = dot(Q->qn + (size_t)h * hd, k, hd) * scale;
      continue;
    }
    const uint16_t* s;
    const uint8_t* row = pooled(m, P, 0, l, hk, (size_t)table[t / bs] * bs + t % bs, &s);
    if (int4) dot4(Q->qs, Q->steps, Q->qsum, G, row, s, hd, row_sc);
    else dot8(Q->qs, Q->steps, G, (const int8_t*)row, s, hd, row_sc);
    for (int h = 0; h < G; h++) sc[h * n + t - lo] = row_sc[h] * scale;
  }
  for (int h = 0; h < G; h++) {
    float* sh = sc + (size_t)h * n;
    float top = -3.4e38f, total = 0.f;
    for (int t = 0; t < n; t++) top = sh[t] > top ? sh[t] : top;
    for (int t = 0; t < n; t++) total += (sh[t] = exp_(sh[t] - top));
    mx[h] = top, sum[h] = total;
  }
  for (int i = 0; i < G * hd; i += 4) wasm_v128_store(o + i, wasm_f32x4_splat(0.f)), wasm_v128_store(rot + i, wasm_f32x4_splat(0.f));
  const int count = stored - lo, g = int4 ? kv_group4(hd, 1) : kv_group8(hd), groups = hd / g;
  if (count > 0) {
    const uint16_t** scales = (const uint16_t**)(rows + count);
    float *sf = (float*)(scales + count), *mf = sf + (size_t)count * groups;
    for (int t = lo; t < stored; t++) rows[t - lo] = pooled(m, P, 1, l, hk, (size_t)table[t / bs] * bs + t % bs, &scales[t - lo]);
    row_scales(scales, count, int4, groups, sf, mf);
    sum_values(rows, sf, mf, count, sc, n, G, int4, hd, g, int4 ? rot : o);  // int4's summed rotated,
    if (int4)                                                                  // rotated back once
      for (int h = 0; h < G; h++) {
        float *r = rot + (size_t)h * hd, *oh = o + (size_t)h * hd;
        fwht(r, hd);
        for (int i = 0; i < hd; i += 4) wasm_v128_store(oh + i, wasm_f32x4_add(wasm_v128_load(oh + i), wasm_v128_load(r + i)));
      }
  }
  for (int t = stored; t < hi; t++) {
    const float* vt = exact_row(m, P, B, 1, l, b, hk, t);
    for (int h = 0; h < G; h++) {
      const v128_t wt = wasm_f32x4_splat(sc[h * n + t - lo]);
      float* oh = o + (size_t)h * hd;
      for (int i = 0; i < hd; i += 4)
        wasm_v128_store(oh + i, wasm_f32x4_add(wasm_v128_load(oh + i), wasm_f32x4_mul(wt, wasm_v128_load(vt + i))));
    }
  }
}

// the running (M, S, O) of G heads folded with a segment's (m, s, o); first: the segment's alone
static void fold_segment(int G, int hd, float* M, float* S, float* O, const float* m, const float* s, const float* o,
                         int first) {
  for (int h = 0; h < G; h++) {
    float* Oh = O + (size_t)h * hd;
    const float* oh = o + (size_t)h * hd;
    if (first) {
      M[h] = m[h], S[h] = s[h];
      for (int i = 0; i < hd; i++) Oh[i] = oh[i];
      continue;
    }
    const float top = M[h] > m[h] ? M[h] : m[h], a = exp_(M[h] - top), c = exp_(m[h] - top);
    S[h] = S[h] * a + s[h] * c, M[h] = top;
    const v128_t va = wasm_f32x4_splat(a), vc = wasm_f32x4_splat(c);
    for (int i = 0; i < hd; i += 4)
      wasm_v128_store(Oh + i, wasm_f32x4_add(wasm_f32x4_mul(wasm_v128_load(Oh + i), va), wasm_f32x4_mul(wasm_v128_load(oh + i), vc)));
  }
}

// out [G, hd] = O / S
static void finish_heads(int G, int hd, const float* S, const float* O, float* out) {
  for (int h = 0; h < G; h++)
    for (int i = 0; i < hd; i++) out[(size_t)h * hd + i] = O[(size_t)h * hd + i] / S[h];
}

typedef struct {
  const Model* m;
  const Pool* P;
  const Batch* B;
  int l;
} Attention;

// every parts-th (token, head), for balance
static void attention_part(const void* ctx, int part, int parts) {
  const Attention* j = ctx;
  const int H = j->m->heads, hd = j->m->head_dim;
  float* scores = sc + (size_t)part * j->m->max_pos;
  for (int i = part; i < j->B->num_tokens * H; i += parts) {
    const int n = i / H, h = i % H;
    attend(j->m, j->P, j->B, j->l, row_of[n], j->B->pos[n], h, q + (size_t)n * H * hd + (size_t)h * hd,
           att + (size_t)n * H * hd + (size_t)h * hd, scores);
  }
}

// A quantized pool's attention, an item per (token, kv head): its query heads' segments one after the other,
// folded as they come. A step of few items (a decode) is split by segments instead: quantized_segments_part
// keeps each segment's partial and quantized_fold_part folds them in the same order.
static void quantized_part(const void* ctx, int part, int parts) {
  const Attention* j = ctx;
  const Model* m = j->m;
  const int H = m->heads, hd = m->head_dim, Hkv = m->kv_heads, G = H / Hkv, int4 = j->P->dtype == KV_INT4;
  float *work = kvq + (size_t)part * KV_WORK(G, hd), *seg = work + KV_QUERY_WORK(G, hd);
  float *M = seg + KV_SEG_WORK(G, hd), *S = M + G, *O = S + G, *mx = O + G * hd, *sum = mx + G, *o = sum + G;
  const uint8_t** rows = kv_rows + (size_t)part * KV_SEGMENT * KV_ROWS(hd);
  for (int i = part; i < j->B->num_tokens * Hkv; i += parts) {
    const int n = i / Hkv, hk = i % Hkv, p = j->B->pos[n];
    Queries Q;
    prepare_queries(G, hd, int4, q + ((size_t)n * H + (size_t)hk * G) * hd, work, &Q);
    for (int s = 0; s <= p / KV_SEGMENT; s++) {
      segment_partial(m, j->P, j->B, j->l, row_of[n], p, hk, G, &Q, s, mx, sum, o, seg, rows);
      fold_segment(G, hd, M, S, O, mx, sum, o, s == 0);
    }
    finish_heads(G, hd, S, O, att + ((size_t)n * H + (size_t)hk * G) * hd);
  }
}

static inline float* partial_at(const Model* m, int item, int s) {
  const int G = m->heads / m->kv_heads;
  return kv_partials + ((size_t)item * (m->max_pos / KV_SEGMENT + 1) + s) * G * (m->head_dim + 2);
}

static void quantized_segments_part(const void* ctx, int part, int parts) {
  const Attention* j = ctx;
  const Model* m = j->m;
  const int H = m->heads, hd = m->head_dim, Hkv = m->kv_heads, G = H / Hkv, int4 = j->P->dtype == KV_INT4;
  const int per_item = m->max_pos / KV_SEGMENT + 1, items = j->B->num_tokens * Hkv;
  float *work = kvq + (size_t)part * KV_WORK(G, hd), *seg = work + KV_QUERY_WORK(G, hd);
  const uint8_t** rows = kv_rows + (size_t)part * KV_SEGMENT * KV_ROWS(hd);
  int prepared = -1;
  Queries Q;
  for (int i = part; i < items * per_item; i += parts) {
    const int item = i / per_item, s = i % per_item, n = item / Hkv, hk = item % Hkv, p = j->B->pos[n];
    if (s > p / KV_SEGMENT) continue;
    if (prepared != item) prepare_queries(G, hd, int4, q + ((size_t)n * H + (size_t)hk * G) * hd, work, &Q), prepared = item;
    float* out = partial_at(m, item, s);
    segment_partial(m, j->P, j->B, j->l, row_of[n], p, hk, G, &Q, s, out, out + G, out + 2 * G, seg, rows);
  }
}

static void quantized_fold_part(const void* ctx, int part, int parts) {
  const Attention* j = ctx;
  const Model* m = j->m;
  const int H = m->heads, hd = m->head_dim, Hkv = m->kv_heads, G = H / Hkv;
  float *M = kvq + (size_t)part * KV_WORK(G, hd) + KV_QUERY_WORK(G, hd) + KV_SEG_WORK(G, hd), *S = M + G, *O = S + G;
  for (int item = part; item < j->B->num_tokens * Hkv; item += parts) {
    const int n = item / Hkv, hk = item % Hkv, p = j->B->pos[n];
    for (int s = 0; s <= p / KV_SEGMENT; s++) {
      const float* seg = partial_at(m, item, s);
      fold_segment(G, hd, M, S, O, seg, seg + G, seg + 2 * G, s == 0);
    }
    finish_heads(G, hd, S, O, att + ((size_t)n * H + (size_t)hk * G) * hd);
  }
}

typedef struct {
  const Model* m;
  const Batch* B;
} Head;

static void head_part(const void* ctx, int part, int parts) {  // the part's vocabulary rows for every logits row
  const Head* j = ctx;
  const int D = j->m->dim, V = j->m->vocab;
  int lo, hi;
  part_range(V, 4, part, parts, &lo, &hi);
  qmat_gemm(&j->m->head, lo, hi, D, j->B->num_logits, xq, xs, xsum, xsum16, j->B->logits, V);
}

// token n's rows of layer l (kk, vv) into a quantized pool, and into its block's tail slot where B->keep says.
// The rows are then left rounded to fp16 (in kk, vv and the tail), as the native pool's fp16 tails hold the
// rows read "exact": the slots stay float (a page runs a sequence or two: their bytes do not matter there, and
// reading them needs no conversion), the numbers are the native engine's.
static void store_quantized(const Model* m, const Pool* P, const Batch* B, int l, int n) {
  const int hd = m->head_dim, Hkv = m->kv_heads, bs = P->block_size, slot = B->slots[n];
  float* y = kvq;  // the main thread's part of the scratch: attention has not started
  for (int kind = 0; kind < 2; kind++)
    for (int h = 0; h < Hkv; h++) {
      float* row = (kind ? vv : kk) + ((size_t)n * Hkv + h) * hd;
      const uint16_t* s;
      uint8_t* out = (uint8_t*)pooled(m, P, kind, l, h, (size_t)slot, &s);
      if (P->dtype == KV_INT8) quantize8(row, hd, (int8_t*)out, (uint16_t*)s);
      else quantize4(row, hd, kv_group4(hd, kind), out, (uint16_t*)s, y);
      for (int i = 0; i < hd; i++) row[i] = half1(to_half(row[i]));
      if (B->keep[n]) {
        float* tail = P->tails[P->tail_of[slot / bs]] + ((((size_t)kind * m->layers + l) * Hkv + h) * bs + slot % bs) * hd;
        for (int i = 0; i < hd; i++) tail[i] = row[i];
      }
    }
}

// every kept token's block has a tail slot, and so does every block a query reads exact before its row's
// first position this step (own_block is lowest at that position)
static int tails_hold(const Pool* P, const Batch* B) {
  const int bs = P->block_size;
  for (int n = 0; n < B->num_tokens; n++)
    if (B->keep[n] && (P->tail_of[B->slots[n] / bs] < 0)) return 0;
  for (int b = 0; b < B->num_rows; b++) {
    const int start = B->pos[B->row_first[b]];
    for (int t = own_block(P, B, b, start); t < start; t += bs) {
      const int block = B->tables[(size_t)b * B->max_blocks + t / bs];
      if (block < 0 || block >= P->num_blocks || P->tail_of[block] < 0) return 0;
    }
  }
  return 1;
}

// Runs the batch: writes every token's K/V into its slot and the logits rows. Returns 0, or 1 when the
// batch holds more tokens (or logits rows) than step_init made room for, 2 when a position, slot or logits
// row is out of range, 3 when a quantized pool's tails lack rows the batch keeps or reads exact.
EXPORT int step_run(const Model* m, const Pool* P, const Batch* B) {
  const int D = m->dim, hd = m->head_dim, H = m->heads, Hkv = m->kv_heads, F = m->hidden, N = B->num_tokens;
  const int kvw = Hkv * hd, blocks = D / 32;
  const size_t rows = (size_t)P->num_blocks * P->block_size;
  if (N > capacity || B->num_logits > capacity) return STEP_TOO_MANY_TOKENS;
  for (int n = 0; n < N; n++)
    if (B->pos[n] < 0 || B->pos[n] >= m->max_pos || B->slots[n] < 0 || (size_t)B->slots[n] >= rows) return STEP_OUT_OF_RANGE;
  for (int r = 0; r < B->num_logits; r++)
    if (B->logits_at[r] < 0 || B->logits_at[r] >= N) return STEP_OUT_OF_RANGE;
  for (int b = 0; b < B->num_rows; b++)
    for (int n = B->row_first[b]; n < B->row_first[b] + B->row_count[b]; n++) row_of[n] = b;
  if (P->dtype != KV_FP32 && !tails_hold(P, B)) return STEP_TAILS_MISSING;
  const double* other_rope = 0;  // rope_rows holds two bases: no family has more
  for (int l = 0; l < m->layers; l++) {
    const double* inv = m->layer[l].rope;
    if (!inv || inv == m->rope) continue;
    if (other_rope && inv != other_rope) return STEP_OUT_OF_RANGE;
    other_rope = inv;
  }
  rope_of[0] = rope_of[1] = 0;
  if (P->dtype != KV_FP32)
    for (int l = 0; l < m->layers; l++)
      if (m->layer[l].window) return STEP_WINDOWED_QUANTIZED;
  for (int n = 0; n < N; n++) {
    if (B->ids[n] < 0 || B->ids[n] >= m->vocab) return STEP_OUT_OF_RANGE;
    qmat_row(&m->embd, B->ids[n], D, x + (size_t)n * D);
    if (m->embed_scale != 1.f)
      for (int i = 0; i < D; i++) x[(size_t)n * D + i] *= m->embed_scale;
  }
  for (int l = 0; l < m->layers; l++) {
    const Layer* L = &m->layer[l];
    for (int n = 0; n < N; n++) rmsnorm(x + (size_t)n * D, L->attn_norm, D, m->eps, xn + (size_t)n * D);
    quantize_rows(xn, N, D);  // one rounding for q, k and v
    project(m, B->lora, l, 0, xn, N, D, 3, (int[]){H * hd, kvw, kvw}, (float* []){q, kk, vv}, 0, 0);
    for (int n = 0; n < N; n++) {
      if (L->q_norm) {  // each head RMS-normed before RoPE
        for (int h = 0; h < H; h++) rmsnorm(q + ((size_t)n * H + h) * hd, L->q_norm, hd, m->eps, q + ((size_t)n * H + h) * hd);
        for (int h = 0; h < Hkv; h++) rmsnorm(kk + (size_t)n * kvw + h * hd, L->k_norm, hd, m->eps, kk + (size_t)n * kvw + h * hd);
      }
      const float* cs = rope_rows_for(m, B, L->rope ? L->rope : m->rope) + (size_t)n * hd;
      rope(q + (size_t)n * H * hd, H, hd, cs, m->rope_neox);
      rope(kk + (size_t)n * kvw, Hkv, hd, cs, m->rope_neox);
      if (P->dtype == KV_FP32) {
        for (int h = 0; h < Hkv; h++) {  // into the pool first: the row's later tokens read it
          const size_t at = (((size_t)l * Hkv + h) * rows + B->slots[n]) * hd;
          for (int i = 0; i < hd; i++) {
            P->k[at + i] = kk[(size_t)n * kvw + h * hd + i];
            P->v[at + i] = vv[(size_t)n * kvw + h * hd + i];
          }
        }
      } else {
        store_quantized(m, P, B, l, n);
      }
    }
    const Attention layer = {m, P, B, l};
    if (P->dtype == KV_FP32) {
      parallel(attention_part, &layer);
    } else if (N * Hkv >= 2 * step_threads() || N * Hkv > KV_SPLIT_ITEMS) {
      parallel(quantized_part, &layer);
    } else {  // too few items to keep every thread busy: their segments in parallel, then folded
      parallel(quantized_segments_part, &layer);
      parallel(quantized_fold_part, &layer);
    }
    quantize_rows(att, N, H * hd);
    project(m, B->lora, l, 3, att, N, H * hd, 1, (int[]){D}, (float* []){xn}, 0, L->post_attn_norm ? 0 : x);
    if (L->post_attn_norm) add_normed(x, xn, L->post_attn_norm, N, D, m->eps);
    for (int n = 0; n < N; n++) rmsnorm(x + (size_t)n * D, L->ffn_norm, D, m->eps, xn + (size_t)n * D);
    quantize_rows(xn, N, D);  // one rounding for gate and up
    project(m, B->lora, l, 4, xn, N, D, 2, (int[]){F, F}, (float* []){g, u}, 1 + m->act, 0);
    quantize_rows(g, N, F);
    project(m, B->lora, l, 6, g, N, F, 1, (int[]){D}, (float* []){xn}, 0, L->post_ffn_norm ? 0 : x);
    if (L->post_ffn_norm) add_normed(x, xn, L->post_ffn_norm, N, D, m->eps);
  }
  for (int r = 0; r < B->num_logits; r++) {  // every logits row rounded first, then the head's rows split
    rmsnorm(x + (size_t)B->logits_at[r] * D, m->out_norm, D, m->eps, xn + (size_t)r * D);
    quantize_x(xn + (size_t)r * D, D, xq + (size_t)r * D, xs + (size_t)r * blocks, xsum + (size_t)r * blocks,
               xsum16 + (size_t)r * (D / 16));
  }
  const Head head = {m, B};
  parallel(head_part, &head);
  return 0;
}

// The graph's logits processing (exporter/builders/logits.py), per logits row of the last step_run: the
// penalties and logit bias at each row's sparse tokens (repetition where seen, presence where generated,
// frequency times the count), a grammar's mask (bit i of the row's little-endian bitmask = token i
// allowed), the temperature, then the K best (ties: the lower id first). A row's log-probabilities are its
// candidates' processed logits minus its log-sum-exp, max + log(sum): step_sample leaves max and sum per
// row for the caller's log (out_stats [rows, 2]).

static float* picked = 0;
static int32_t picked_cap = 0;

// 0, or 1 when top_k is not within 1 .. vocab or the sparse rows need more memory than there is
EXPORT int step_sample(const Model* m, const Sampling* s) {
  const int V = m->vocab, K = s->top_k, P = s->num_sparse;
  if (K < 1 || K > V) return 1;
  if (P > picked_cap) {
    picked = arena(4 * P);
    if (!picked) return 1;
    picked_cap = P;
  }
  for (int r = 0; r < s->num_logits; r++) {
    float* x = (float*)s->logits + (size_t)r * V;
    const int32_t* ids = s->sparse_ids + (size_t)r * P;
    const float *seen = s->sparse_seen + (size_t)r * P, *counts = s->sparse_counts + (size_t)r * P;
    const float* bias = s->sparse_bias + (size_t)r * P;
    for (int j = 0; j < P; j++) {  // every value from the raw logits first: ids may repeat (padding)
      float v = x[ids[j]];
      if (seen[j] > 0.f) v = v > 0.f ? v / s->repetition[r] : v * s->repetition[r];
      v -= s->presence[r] * (counts[j] > 0.f ? 1.f : 0.f);
      v -= s->frequency[r] * counts[j];
      picked[j] = v + bias[j];
    }
    for (int j = 0; j < P; j++) x[ids[j]] = picked[j];
    if (s->mask) {
      const uint8_t* bits = s->mask + (size_t)r * ((V + 7) / 8);
      for (int i = 0; i < V; i++)
        if (!((bits[i >> 3] >> (i & 7)) & 1)) x[i] = -__builtin_inff();
    }
    const float t = s->temperature[r];
    float mx = -__builtin_inff();
    for (int i = 0; i < V; i++) {
      x[i] = x[i] / t;
      mx = x[i] > mx ? x[i] : mx;
    }
    double sum = 0.0;  // 49,152 terms: a float sum drifted by 1e-4
    for (int i = 0; i < V; i++) sum += exp_(x[i] - mx);
    s->out_stats[2 * r] = mx;
    s->out_stats[2 * r + 1] = (float)sum;
    int32_t* top = s->out_ids + (size_t)r * K;
    float* val = s->out_values + (size_t)r * K;
    int n = 0;  // candidates kept so far, best first
    for (int i = 0; i < V; i++) {
      if (n == K && !(x[i] > val[K - 1])) continue;
      int at = n < K ? n++ : K - 1;
      while (at > 0 && x[i] > val[at - 1]) {
        val[at] = val[at - 1];
        top[at] = top[at - 1];
        at--;
      }
      val[at] = x[i];
      top[at] = i;
    }
  }
  return 0;
}

// For tests and benchmarks: rows [0, N) of W times the T rows of x [T, K], rounded as step_run rounds
// them, into y [T, N]; 1 when T or K is more than step_init made room for.
EXPORT int step_project(const QMat* W, int N, int K, int T, const float* in, float* y) {
  if (T > capacity || K > width) return 1;
  quantize_rows(in, T, K);
  qmat_gemm(W, 0, N, K, T, xq, xs, xsum, xsum16, y, N);
  return 0;
}

// For tests: T rows of d numbers (x [T, d]) as a pool of dtype (KV_INT8, KV_INT4) stores them for keys (kind 0)
// or values (1): numbers into q, fp16 scales into s; 1 when d is too wide for the scratch
EXPORT int step_kv_quantize(int dtype, int kind, const float* x, int T, int d, uint8_t* q, uint16_t* s) {
  if (d > width) return 1;
  const int w = kv_width(dtype, d, kind), b = kv_row_bytes(dtype, d);
  for (int t = 0; t < T; t++) {
    if (dtype == KV_INT8) quantize8(x + (size_t)t * d, d, (int8_t*)q + (size_t)t * b, s + (size_t)t * w);
    else quantize4(x + (size_t)t * d, d, kv_group4(d, kind), q + (size_t)t * b, s + (size_t)t * w, xn);
  }
  return 0;
}

// For tests: q . a stored key row (int4: q rotated first, as attend_quantized scores), and acc += w * a stored
// value row (int4: left rotated, as attend_quantized sums them)
EXPORT float step_kv_dot(int dtype, const float* qn, const uint8_t* row, const uint16_t* s, int d) {
  int16_t* qs = (int16_t*)kvq;
  float *steps = kvq + d / 2, *qsum = steps + 1, *work = qsum + d / 32, score;
  round_queries(qn, 1, d, dtype == KV_INT4, qs, steps, qsum, work);
  if (dtype == KV_INT8) dot8(qs, steps, 1, (const int8_t*)row, s, d, &score);
  else dot4(qs, steps, qsum, 1, row, s, d, &score);
  return score;
}

EXPORT void step_kv_add(int dtype, float w, const uint8_t* row, const uint16_t* s, int d, float* acc) {
  const int int4 = dtype == KV_INT4, g = int4 ? kv_group4(d, 1) : kv_group8(d);
  float *sf = kvq, *mf = kvq + d / g;
  row_scales(&s, 1, int4, d / g, sf, mf);
  sum_values(&row, sf, mf, 1, &w, 1, 1, int4, d, g, acc);
}

// row n of W [N, K] in fp32, as the embedding's lookup reads it
EXPORT void step_dequantize(const QMat* W, int n, int K, float* out) { qmat_row(W, n, K, out); }
#include "learn.h"
#include "repack.h"
