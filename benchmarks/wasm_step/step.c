// A whole decode step of a llama-family GGUF (Q4_1 projections, a Q8_0 embedding tied to the head) in
// WASM SIMD, one thread: what a page backend without onnxruntime-web would run per token (issue 33).
// A prototype for measuring, not a backend: one sequence, a contiguous KV cache, no batching.
// The projections are ../wasm_gemv's (activations rounded per block of 32 to int8, as llama.cpp's);
// norms, RoPE (GGUF llama order: adjacent pairs), attention and SwiGLU in fp32.
#include "../wasm_gemv/gemv.c"

typedef struct {
  const uint8_t* w;  // nibbles [N, K / 2]
  const float *d, *m;  // scales and minimums [N / 4, K / 32, 4] (gemv_q4x4's layout)
} Q4;

typedef struct {
  const float* attn_norm;
  Q4 q, k, v, o;
  const float* ffn_norm;
  Q4 gate, up, down;
} Layer;

typedef struct {
  int dim, hidden, layers, heads, kv_heads, head_dim, vocab, ctx;
  float eps;
  const int8_t* embd;  // Q8_0 [vocab, dim] and its scales [vocab, dim / 32]: the embedding and the head
  const float* embd_d;
  const float* out_norm;
  const float* rope;  // [ctx, head_dim / 2, 2]: cos, sin
  float *kcache, *vcache;  // [layers, kv_heads, ctx, head_dim]
  Layer* layer;
} Model;

static float *x, *xn, *q, *kk, *vv, *att, *sc, *g, *u, *logits, *xs, *xsum;
static int8_t* xq;

EXPORT int model_init(const Model* m) {
  const int big = m->hidden > m->dim ? m->hidden : m->dim;
  x = arena(4 * m->dim), xn = arena(4 * big), q = arena(4 * m->heads * m->head_dim);
  kk = arena(4 * m->kv_heads * m->head_dim), vv = arena(4 * m->kv_heads * m->head_dim);
  att = arena(4 * m->heads * m->head_dim), sc = arena(4 * m->ctx), g = arena(4 * m->hidden), u = arena(4 * m->hidden);
  logits = arena(4 * m->vocab), xs = arena(4 * big / 32), xsum = arena(4 * big / 32), xq = arena(big);
  return logits != 0;
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

static void rmsnorm(const float* in, const float* w, int n, float eps, float* out) {
  const float inv = 1.f / __builtin_sqrtf(dot(in, in, n) / n + eps);
  for (int i = 0; i < n; i += 4)
    wasm_v128_store(out + i, wasm_f32x4_mul(wasm_f32x4_mul(wasm_v128_load(in + i), wasm_f32x4_splat(inv)), wasm_v128_load(w + i)));
}

static void project(const float* in, int K, const Q4* w, int N, float* out) {
  quantize_x(in, K, xq, xs, xsum);
  gemv_q4x4(xq, xs, xsum, K, w->w, w->d, w->m, N, out);
}

static void rope(float* v, int heads, int hd, const float* cs) {  // adjacent pairs (GGUF's llama order)
  for (int h = 0; h < heads; h++)
    for (int i = 0; i < hd / 2; i++) {
      float* p = v + h * hd + 2 * i;
      const float c = cs[2 * i], s = cs[2 * i + 1], a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = a * s + b * c;
    }
}

// the token at `pos` (positions before it already in the cache); returns the logits [vocab]
EXPORT float* step(const Model* m, int token, int pos) {
  const int D = m->dim, hd = m->head_dim, H = m->heads, Hkv = m->kv_heads, G = H / Hkv, blocks = D / 32;
  for (int i = 0; i < D; i++) x[i] = m->embd[(size_t)token * D + i] * m->embd_d[(size_t)token * blocks + i / 32];
  const float* cs = m->rope + (size_t)pos * hd;
  const float scale = 1.f / __builtin_sqrtf((float)hd);
  for (int l = 0; l < m->layers; l++) {
    const Layer* L = &m->layer[l];
    rmsnorm(x, L->attn_norm, D, m->eps, xn);
    quantize_x(xn, D, xq, xs, xsum);  // one rounding for q, k and v
    gemv_q4x4(xq, xs, xsum, D, L->q.w, L->q.d, L->q.m, H * hd, q);
    gemv_q4x4(xq, xs, xsum, D, L->k.w, L->k.d, L->k.m, Hkv * hd, kk);
    gemv_q4x4(xq, xs, xsum, D, L->v.w, L->v.d, L->v.m, Hkv * hd, vv);
    rope(q, H, hd, cs);
    rope(kk, Hkv, hd, cs);
    float* kc = m->kcache + (size_t)l * Hkv * m->ctx * hd;
    float* vc = m->vcache + (size_t)l * Hkv * m->ctx * hd;
    for (int h = 0; h < Hkv; h++)
      for (int i = 0; i < hd; i++) {
        kc[((size_t)h * m->ctx + pos) * hd + i] = kk[h * hd + i];
        vc[((size_t)h * m->ctx + pos) * hd + i] = vv[h * hd + i];
      }
    for (int h = 0; h < H; h++) {
      const float* kh = kc + (size_t)(h / G) * m->ctx * hd;
      const float* vh = vc + (size_t)(h / G) * m->ctx * hd;
      float mx = -3.4e38f, sum = 0.f;
      for (int t = 0; t <= pos; t++) {
        sc[t] = dot(q + h * hd, kh + (size_t)t * hd, hd) * scale;
        mx = sc[t] > mx ? sc[t] : mx;
      }
      for (int t = 0; t <= pos; t++) sum += (sc[t] = exp_(sc[t] - mx));
      float* o = att + h * hd;
      for (int i = 0; i < hd; i += 4) wasm_v128_store(o + i, wasm_f32x4_splat(0.f));
      for (int t = 0; t <= pos; t++) {
        const v128_t w = wasm_f32x4_splat(sc[t] / sum);
        for (int i = 0; i < hd; i += 4)
          wasm_v128_store(o + i, wasm_f32x4_add(wasm_v128_load(o + i), wasm_f32x4_mul(w, wasm_v128_load(vh + (size_t)t * hd + i))));
      }
    }
    project(att, H * hd, &L->o, D, xn);
    for (int i = 0; i < D; i++) x[i] += xn[i];
    rmsnorm(x, L->ffn_norm, D, m->eps, xn);
    quantize_x(xn, D, xq, xs, xsum);  // one rounding for gate and up
    gemv_q4x4(xq, xs, xsum, D, L->gate.w, L->gate.d, L->gate.m, m->hidden, g);
    gemv_q4x4(xq, xs, xsum, D, L->up.w, L->up.d, L->up.m, m->hidden, u);
    for (int i = 0; i < m->hidden; i++) g[i] = g[i] / (1.f + exp_(-g[i])) * u[i];
    project(g, m->hidden, &L->down, D, xn);
    for (int i = 0; i < D; i++) x[i] += xn[i];
  }
  rmsnorm(x, m->out_norm, D, m->eps, xn);
  quantize_x(xn, D, xq, xs, xsum);
  gemv_q8(xq, xs, D, m->embd, m->embd_d, m->vocab, logits);
  return logits;
}
