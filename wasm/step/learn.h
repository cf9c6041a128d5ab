// The instant loop of per-user adaptation on the page's step (issue 51): the gradient of a text's
// next-token loss with respect to a LoRA's factors, computed by hand as runtime/backends/lora_gradients.py
// does in numpy natively (the same math, checked against it in tests/web/test_wasm_learn.py), and the
// elementwise parts of micro_lora.py's trainer (Adam with the EWC++ pull, the Fisher's refresh).
//
// Memory follows one layer, not the model: the forward keeps each layer's input only, and the backward
// runs each layer's forward again from it (activation checkpointing), so a 256-token text costs
// (layers + 1) x 256 x dim floats plus one layer's activations. The head's logits are made a chunk of
// the vocabulary at a time, twice (the softmax's normalizer first, then its gradient).
//
// The forward is the step's own (activations rounded per block of 32 for the blocks' integer products:
// the model the page serves) or, with `exact`, fp32 products of the blocks' dequantized rows (the native
// trainer's numbers, for the tests). The backward's products with the frozen weights are fp32 on the
// dequantized rows. q and k's rows are in the step's order (the GGUF's), and so are their B factors'.
#pragma once

// Learn, the text and factors step_learn reads: abi.h

// the natural log in double (no libm here): x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m by the atanh
// series (|s| <= 0.172: 11 terms reach 1e-17)
static double log_d(double x) {
  if (!(x > 0.0)) return -1.0 / 0.0;
  union { double d; uint64_t u; } v = {x};
  int e = (int)((v.u >> 52) & 0x7ff) - 1023;
  v.u = (v.u & 0x000fffffffffffffull) | 0x3ff0000000000000ull;  // m in [1, 2)
  if (v.d > 1.4142135623730951) v.d *= 0.5, e++;
  const double s = (v.d - 1.0) / (v.d + 1.0), s2 = s * s;
  double term = s, sum = 0.0;
  for (int k = 1; k <= 23; k += 2, term *= s2) sum += term / k;
  return 2.0 * sum + e * 0.6931471805599453;
}

#define LEARN_TILE 16     // weight rows dequantized at a time in the backward's products
#define LEARN_VOCAB 4096  // the head's rows a logits chunk holds

static float *l_saved, *l_a, *l_q, *l_k, *l_v, *l_p, *l_o, *l_x1, *l_m, *l_gate, *l_up, *l_act, *l_r1, *l_r2;
static float *l_dx, *l_dx1, *l_dm, *l_dact, *l_dgate, *l_dup, *l_do, *l_dq, *l_dk, *l_dv, *l_dkh, *l_dvh;
static float *l_tt, *l_dt, *l_tiles, *l_rows, *l_chunk, *l_stats, *l_rope;  // l_rope: [T, hd] positions 0 .. T - 1
static int32_t l_capacity = 0, l_width = 0;

// Scratch for texts of up to max_tokens tokens (step_init's scratch must hold them too); returns
// max_tokens, or 0 when the memory cannot grow that far.
EXPORT int learn_init(const Model* m, int32_t max_tokens) {
  const int T = max_tokens, D = m->dim, F = m->hidden, H = m->heads, hd = m->head_dim, kvw = m->kv_heads * hd;
  int K = D > F ? D : F;
  K = K > H * hd ? K : H * hd;
  if (T > capacity) return 0;
  l_saved = arena(4u * (m->layers + 1) * T * D);
  l_a = arena(4 * T * D), l_q = arena(4 * T * H * hd), l_k = arena(4 * T * kvw), l_v = arena(4 * T * kvw);
  l_p = arena(4u * H * T * T), l_o = arena(4 * T * H * hd), l_x1 = arena(4 * T * D), l_m = arena(4 * T * D);
  l_gate = arena(4 * T * F), l_up = arena(4 * T * F), l_act = arena(4 * T * F), l_r1 = arena(4 * T), l_r2 = arena(4 * T);
  l_dx = arena(4 * T * D), l_dx1 = arena(4 * T * D), l_dm = arena(4 * T * D), l_dact = arena(4 * T * F);
  l_dgate = arena(4 * T * F), l_dup = arena(4 * T * F), l_do = arena(4 * T * H * hd), l_dq = arena(4 * T * H * hd);
  l_dk = arena(4 * T * kvw), l_dv = arena(4 * T * kvw), l_dkh = arena(4u * H * T * hd), l_dvh = arena(4u * H * T * hd);
  l_tt = arena(4 * T * 16), l_dt = arena(4 * T * 16), l_tiles = arena(4u * MAX_THREADS * LEARN_TILE * K);
  l_rows = arena(4u * MAX_THREADS * T), l_chunk = arena(4u * T * LEARN_VOCAB), l_stats = arena(4 * 4 * T);
  l_rope = arena(4u * T * hd);
  l_capacity = l_stats && l_rope ? T : 0;
  l_width = K;
  return l_capacity;
}

// ---- products with the frozen weights ----

typedef struct {
  const QMat* W;
  int first, N, K, T, exact;
  const float* in;  // [T, K] (exact), else xq, xs and xsum hold it rounded
  float* out;       // [T, ldo]: columns 0 .. N - 1 = rows first .. first + N - 1 of W
  int ldo;
  int row0;         // the rounded rows start at xq's row row0
} Forward;

static void forward_part(const void* ctx, int part, int parts) {
  const Forward* j = ctx;
  int lo, hi;
  part_range(j->N, 4, part, parts, &lo, &hi);
  if (!j->exact) {
    const size_t r = (size_t)j->row0, K = (size_t)j->K;
    qmat_gemm(j->W, j->first + lo, j->first + hi, j->K, j->T, xq + r * K, xs + r * (K / 32), xsum + r * (K / 32),
              xsum16 + r * (K / 16), j->out - j->first, j->ldo);
    return;
  }
  float* tile = l_tiles + (size_t)part * LEARN_TILE * l_width;
  for (int n = lo; n < hi; n += 4) {
    for (int r = 0; r < 4; r++) qmat_row(j->W, j->first + n + r, j->K, tile + (size_t)r * j->K);
    for (int t = 0; t < j->T; t++)
      for (int r = 0; r < 4; r++)
        j->out[(size_t)t * j->ldo + n + r] = dot(j->in + (size_t)t * j->K, tile + (size_t)r * j->K, j->K);
  }
}

// out [T, ldo] = in [T, K] times rows first .. first + N - 1 of W (rounded as the step rounds, unless
// exact; when `rounded`, xq holds them already, from its row row0)
static void forward_rows(const QMat* W, int first, int N, int K, int T, const float* in, float* out, int ldo, int exact,
                         int rounded, int row0) {
  if (!exact && !rounded) quantize_rows(in, T, K);
  const Forward j = {W, first, N, K, T, exact, in, out, ldo, row0};
  parallel(forward_part, &j);
}

typedef struct {
  const QMat* W;
  int first, N, K, T;
  const float* dy;  // [T, ldy]: the gradient of rows first .. first + N - 1's outputs
  int ldy;
  float* dx;        // [T, K]: += dy W
} Backward;

#ifdef __wasm_relaxed_simd__
#define MADD(a, b, c) wasm_f32x4_relaxed_madd(a, b, c)  // a * b + c, fused where the machine has FMA
#else
#define MADD(a, b, c) wasm_f32x4_add(wasm_f32x4_mul(a, b), c)
#endif
#define LEARN_SPAN 256  // columns of the weight tile read per pass over the tokens: 16 rows x 1 KB stay in L1

static void backward_part(const void* ctx, int part, int parts) {  // each part its own tokens: whole rows
  const Backward* j = ctx;
  int t0, t1;
  part_range(j->T, 1, part, parts, &t0, &t1);
  if (t0 == t1) return;
  const int K = j->K, ld = j->ldy;
  float* tile = l_tiles + (size_t)part * LEARN_TILE * l_width;
  for (int n = 0; n < j->N; n += LEARN_TILE) {
    const int R = j->N - n < LEARN_TILE ? j->N - n : LEARN_TILE;
    for (int r = 0; r < R; r++) qmat_row(j->W, j->first + n + r, K, tile + (size_t)r * K);
    for (int k0 = 0; k0 < K; k0 += LEARN_SPAN) {
      const int k1 = K - k0 < LEARN_SPAN ? K : k0 + LEARN_SPAN;
      int t = t0;
      for (; t + 4 <= t1; t += 4) {  // four tokens share each loaded weight vector
        const float* g = j->dy + (size_t)t * ld + n;
        float* d = j->dx + (size_t)t * K;
        for (int k = k0; k < k1; k += 8) {  // 4 tokens x 8 columns of accumulators: 8 FMAs a weight row
          v128_t a[4][2];
          for (int i = 0; i < 4; i++) a[i][0] = wasm_v128_load(d + i * K + k), a[i][1] = wasm_v128_load(d + i * K + k + 4);
          for (int r = 0; r < R; r++) {
            const v128_t w0 = wasm_v128_load(tile + (size_t)r * K + k), w1 = wasm_v128_load(tile + (size_t)r * K + k + 4);
            for (int i = 0; i < 4; i++) {
              const v128_t s = wasm_v128_load32_splat(g + i * ld + r);
              a[i][0] = MADD(s, w0, a[i][0]);
              a[i][1] = MADD(s, w1, a[i][1]);
            }
          }
          for (int i = 0; i < 4; i++) wasm_v128_store(d + i * K + k, a[i][0]), wasm_v128_store(d + i * K + k + 4, a[i][1]);
        }
      }
      for (; t < t1; t++) {
        const float* g = j->dy + (size_t)t * ld + n;
        float* d = j->dx + (size_t)t * K;
        for (int k = k0; k < k1; k += 4) {
          v128_t acc = wasm_v128_load(d + k);
          for (int r = 0; r < R; r++) acc = MADD(wasm_f32x4_splat(g[r]), wasm_v128_load(tile + (size_t)r * K + k), acc);
          wasm_v128_store(d + k, acc);
        }
      }
    }
  }
}

static void backward_rows(const QMat* W, int first, int N, int K, int T, const float* dy, int ldy, float* dx) {
  const Backward j = {W, first, N, K, T, dy, ldy, dx};
  parallel(backward_part, &j);
}

// ---- the LoRA's part ----

static inline int target_of(int l, int i) { return l * LORA_TARGETS + i; }

// out [T, N] += scale x (x A^T) B^T, for target (l, i) where it is adapted
static void lora_forward(const Learn* J, int l, int i, const float* in, int K, int T, float* out, int N) {
  const float *A = J->a[target_of(l, i)], *Bt = J->b[target_of(l, i)];
  if (!A) return;
  for (int t = 0; t < T; t++)
    for (int c = 0; c < J->rank; c++) {
      const float s = J->scale * dot(in + (size_t)t * K, A + (size_t)c * K, K);
      float* y = out + (size_t)t * N;
      const float* bc = Bt + (size_t)c * N;
      for (int o = 0; o < N; o++) y[o] += s * bc[o];
    }
}

// from the target's output gradient dy [T, N] and its input x [T, K]: its factors' gradients, and its
// share of the input's gradient (dx [T, K] +=)
static void lora_backward(const Learn* J, int l, int i, const float* x, int K, int T, const float* dy, int N, float* dx) {
  const int at = target_of(l, i), R = J->rank;
  const float *A = J->a[at], *Bt = J->b[at];
  if (!A) return;
  float *gA = J->ga[at], *gB = J->gb[at];
  for (int t = 0; t < T; t++)
    for (int c = 0; c < R; c++) {
      l_tt[t * R + c] = dot(x + (size_t)t * K, A + (size_t)c * K, K);
      l_dt[t * R + c] = J->scale * dot(dy + (size_t)t * N, Bt + (size_t)c * N, N);
    }
  for (int c = 0; c < R; c++) {
    float* ga = gA + (size_t)c * K;
    float* gb = gB + (size_t)c * N;
    for (int k = 0; k < K; k++) ga[k] = 0.f;
    for (int o = 0; o < N; o++) gb[o] = 0.f;
    for (int t = 0; t < T; t++) {
      const float dt = l_dt[t * R + c], tt = J->scale * l_tt[t * R + c];
      const float *xt = x + (size_t)t * K, *dyt = dy + (size_t)t * N;
      for (int k = 0; k < K; k++) ga[k] += dt * xt[k];
      for (int o = 0; o < N; o++) gb[o] += tt * dyt[o];
    }
  }
  for (int t = 0; t < T; t++)
    for (int c = 0; c < R; c++) {
      const float dt = l_dt[t * R + c];
      const float* ac = A + (size_t)c * K;
      float* d = dx + (size_t)t * K;
      for (int k = 0; k < K; k++) d[k] += dt * ac[k];
    }
}

// target (l, i)'s projection of in [T, K] with its LoRA: out [T, N]
static void learn_project(const Model* m, const Learn* J, int l, int i, const float* in, int K, int T, float* out, int N,
                          int rounded) {
  forward_rows(&m->layer[l].mat[i], 0, N, K, T, in, out, N, J->exact, rounded, 0);
  lora_forward(J, l, i, in, K, T, out, N);
}

// ---- norms, rotary, attention ----

static void rms_rows(const float* in, const float* w, int T, int D, float eps, float* out, float* r) {
  for (int t = 0; t < T; t++) r[t] = 1.f / rmsnorm(in + (size_t)t * D, w, D, eps, out + (size_t)t * D);
}

// dx [T, D] += the RMSNorm's input gradient from its output's dy (x its input, r its root mean square)
static void rms_back(const float* dy, const float* x, const float* r, const float* w, int T, int D, float* dx) {
  for (int t = 0; t < T; t++) {
    const float *g = dy + (size_t)t * D, *xt = x + (size_t)t * D;
    float ux = 0.f;
    for (int i = 0; i < D; i++) ux += g[i] * w[i] * xt[i];
    const float inv = 1.f / r[t], c = ux / (D * r[t] * r[t] * r[t]);
    float* d = dx + (size_t)t * D;
    for (int i = 0; i < D; i++) d[i] += g[i] * w[i] * inv - xt[i] * c;
  }
}

typedef struct {
  const Model* m;
  int T;
} Heads;

static void attention_learn_part(const void* ctx, int part, int parts) {  // causal, over the text itself
  const Heads* j = ctx;
  const int T = j->T, H = j->m->heads, hd = j->m->head_dim, G = H / j->m->kv_heads, kvw = j->m->kv_heads * hd;
  const float scale = 1.f / __builtin_sqrtf((float)hd);
  for (int h = part; h < H; h += parts) {
    const int g = h / G;
    for (int i = 0; i < T; i++) {
      float* p = l_p + ((size_t)h * T + i) * T;
      const float* qi = l_q + (size_t)i * H * hd + h * hd;
      float mx = -3.4e38f, sum = 0.f;
      for (int t = 0; t <= i; t++) {
        p[t] = dot(qi, l_k + (size_t)t * kvw + g * hd, hd) * scale;
        mx = p[t] > mx ? p[t] : mx;
      }
      for (int t = 0; t <= i; t++) sum += (p[t] = exp_(p[t] - mx));
      float* out = l_o + (size_t)i * H * hd + h * hd;
      for (int d = 0; d < hd; d++) out[d] = 0.f;
      for (int t = 0; t <= i; t++) {
        p[t] /= sum;
        const float* vt = l_v + (size_t)t * kvw + g * hd;
        for (int d = 0; d < hd; d++) out[d] += p[t] * vt[d];
      }
    }
  }
}

static void attention_back_part(const void* ctx, int part, int parts) {  // per head: dq, and its dk and dv apart
  const Heads* j = ctx;
  const int T = j->T, H = j->m->heads, hd = j->m->head_dim, G = H / j->m->kv_heads, kvw = j->m->kv_heads * hd;
  const float scale = 1.f / __builtin_sqrtf((float)hd);
  float* dp = l_rows + (size_t)part * T;
  for (int h = part; h < H; h += parts) {
    const int g = h / G;
    float *dkh = l_dkh + (size_t)h * T * hd, *dvh = l_dvh + (size_t)h * T * hd;
    for (int n = 0; n < T * hd; n++) dkh[n] = dvh[n] = 0.f;
    for (int i = 0; i < T; i++) {
      const float* p = l_p + ((size_t)h * T + i) * T;
      const float *doi = l_do + (size_t)i * H * hd + h * hd, *qi = l_q + (size_t)i * H * hd + h * hd;
      float pd = 0.f;
      for (int t = 0; t <= i; t++) {
        dp[t] = dot(doi, l_v + (size_t)t * kvw + g * hd, hd);
        pd += p[t] * dp[t];
      }
      float* dqi = l_dq + (size_t)i * H * hd + h * hd;
      for (int d = 0; d < hd; d++) dqi[d] = 0.f;
      for (int t = 0; t <= i; t++) {
        const float ds = p[t] * (dp[t] - pd) * scale;
        const float* kt = l_k + (size_t)t * kvw + g * hd;
        float *dk = dkh + (size_t)t * hd, *dv = dvh + (size_t)t * hd;
        for (int d = 0; d < hd; d++) {
          dqi[d] += ds * kt[d];
          dk[d] += ds * qi[d];
          dv[d] += p[t] * doi[d];
        }
      }
    }
  }
}

// ---- a layer ----

// layer l's forward from its input x0 [T, D] (into the layer scratch), its output into x2 [T, D]
static void layer_forward(const Model* m, const Learn* J, int l, const float* x0, float* x2) {
  const Layer* L = &m->layer[l];
  const int T = J->num_tokens, D = m->dim, F = m->hidden, H = m->heads, hd = m->head_dim, kvw = m->kv_heads * hd;
  rms_rows(x0, L->attn_norm, T, D, m->eps, l_a, l_r1);
  if (!J->exact) quantize_rows(l_a, T, D);
  learn_project(m, J, l, 0, l_a, D, T, l_q, H * hd, 1);
  learn_project(m, J, l, 1, l_a, D, T, l_k, kvw, 1);
  learn_project(m, J, l, 2, l_a, D, T, l_v, kvw, 1);
  for (int t = 0; t < T; t++) {
    for (int i = 0; i < 3; i++) {
      const float* bias = L->bias[i];
      float* y = (i == 0 ? l_q + (size_t)t * H * hd : i == 1 ? l_k + (size_t)t * kvw : l_v + (size_t)t * kvw);
      const int n = i == 0 ? H * hd : kvw;
      if (bias)
        for (int c = 0; c < n; c++) y[c] += bias[c];
    }
    const float* cs = l_rope + (size_t)t * hd;
    rope(l_q + (size_t)t * H * hd, H, hd, cs, m->rope_neox);
    rope(l_k + (size_t)t * kvw, m->kv_heads, hd, cs, m->rope_neox);
  }
  const Heads heads = {m, T};
  parallel(attention_learn_part, &heads);
  learn_project(m, J, l, 3, l_o, H * hd, T, l_x1, D, 0);
  for (size_t n = 0; n < (size_t)T * D; n++) l_x1[n] += x0[n];
  rms_rows(l_x1, L->ffn_norm, T, D, m->eps, l_m, l_r2);
  if (!J->exact) quantize_rows(l_m, T, D);
  learn_project(m, J, l, 4, l_m, D, T, l_gate, F, 1);
  learn_project(m, J, l, 5, l_m, D, T, l_up, F, 1);
  for (size_t n = 0; n < (size_t)T * F; n++) {
    const float g = l_gate[n];
    l_act[n] = g / (1.f + exp_(-g)) * l_up[n];
  }
  learn_project(m, J, l, 6, l_act, F, T, x2, D, 0);
  for (size_t n = 0; n < (size_t)T * D; n++) x2[n] += l_x1[n];
}

// dx [T, D]: the gradient of layer l's output on the way in, of its input on the way out; the layer's
// factors' gradients written
static void layer_backward(const Model* m, const Learn* J, int l, float* dx) {
  const Layer* L = &m->layer[l];
  const int T = J->num_tokens, D = m->dim, F = m->hidden, H = m->heads, hd = m->head_dim;
  const int Hkv = m->kv_heads, kvw = Hkv * hd, G = H / Hkv;
  const float* x0 = l_saved + (size_t)l * T * D;
  layer_forward(m, J, l, x0, l_dm);  // the activations again (its output is not needed: l_dm as a bin)
  // the MLP: x2 = x1 + down(silu(gate) * up)
  for (size_t n = 0; n < (size_t)T * F; n++) l_dact[n] = 0.f;
  backward_rows(&L->mat[6], 0, D, F, T, dx, D, l_dact);
  lora_backward(J, l, 6, l_act, F, T, dx, D, l_dact);
  for (size_t n = 0; n < (size_t)T * F; n++) {
    const float g = l_gate[n], s = 1.f / (1.f + exp_(-g));
    l_dgate[n] = l_dact[n] * l_up[n] * s * (1.f + g * (1.f - s));
    l_dup[n] = l_dact[n] * g * s;
  }
  for (size_t n = 0; n < (size_t)T * D; n++) l_dm[n] = 0.f;
  backward_rows(&L->mat[4], 0, F, D, T, l_dgate, F, l_dm);
  backward_rows(&L->mat[5], 0, F, D, T, l_dup, F, l_dm);
  lora_backward(J, l, 4, l_m, D, T, l_dgate, F, l_dm);
  lora_backward(J, l, 5, l_m, D, T, l_dup, F, l_dm);
  for (size_t n = 0; n < (size_t)T * D; n++) l_dx1[n] = dx[n];
  rms_back(l_dm, l_x1, l_r2, L->ffn_norm, T, D, l_dx1);
  // attention: x1 = x0 + o(attend(rope(q), rope(k), v))
  for (size_t n = 0; n < (size_t)T * H * hd; n++) l_do[n] = 0.f;
  backward_rows(&L->mat[3], 0, D, H * hd, T, l_dx1, D, l_do);
  lora_backward(J, l, 3, l_o, H * hd, T, l_dx1, D, l_do);
  const Heads heads = {m, T};
  parallel(attention_back_part, &heads);
  for (int t = 0; t < T; t++)
    for (int g = 0; g < Hkv; g++) {
      float *dk = l_dk + (size_t)t * kvw + g * hd, *dv = l_dv + (size_t)t * kvw + g * hd;
      for (int d = 0; d < hd; d++) dk[d] = dv[d] = 0.f;
      for (int h = g * G; h < (g + 1) * G; h++)
        for (int d = 0; d < hd; d++) {
          dk[d] += l_dkh[((size_t)h * T + t) * hd + d];
          dv[d] += l_dvh[((size_t)h * T + t) * hd + d];
        }
    }
  for (int t = 0; t < T; t++) {
    const float* cs = l_rope + (size_t)t * hd;
    rope_turn(l_dq + (size_t)t * H * hd, H, hd, cs, m->rope_neox, -1.f);  // rope's transpose
    rope_turn(l_dk + (size_t)t * kvw, Hkv, hd, cs, m->rope_neox, -1.f);
  }
  for (size_t n = 0; n < (size_t)T * D; n++) l_dm[n] = 0.f;
  backward_rows(&L->mat[0], 0, H * hd, D, T, l_dq, H * hd, l_dm);
  backward_rows(&L->mat[1], 0, kvw, D, T, l_dk, kvw, l_dm);
  backward_rows(&L->mat[2], 0, kvw, D, T, l_dv, kvw, l_dm);
  lora_backward(J, l, 0, l_a, D, T, l_dq, H * hd, l_dm);
  lora_backward(J, l, 1, l_a, D, T, l_dk, kvw, l_dm);
  lora_backward(J, l, 2, l_a, D, T, l_dv, kvw, l_dm);
  for (size_t n = 0; n < (size_t)T * D; n++) dx[n] = l_dx1[n];
  rms_back(l_dm, x0, l_r1, L->attn_norm, T, D, dx);
}

// ---- the loss at the head ----

// The scored rows' loss and the gradient of the final norm's output (l_dm, [T, D]; rows before `first`
// zero), from z [T, D] (the final norm's output): the logits a chunk of the vocabulary at a time, once for
// each row's max and normalizer, again for the gradient.
static float head_loss(const Model* m, const Learn* J, const float* z) {
  const int T = J->num_tokens, D = m->dim, V = m->vocab;
  const int first = J->scored_from > 1 ? J->scored_from - 1 : 0, n = T - 1 - first;
  const float* zr = z + (size_t)first * D;
  float *mx = l_stats, *lse = l_stats + T, *target = l_stats + 2 * T, *weight = l_stats + 3 * T;
  if (!J->exact) quantize_rows(zr, n, D);
  for (int r = 0; r < n; r++) mx[r] = -3.4e38f;
  double sums[256];  // per row, a chunk at a time (rows past 256: the loop below runs again)
  for (int r0 = 0; r0 < n; r0 += 256) {
    const int R = n - r0 < 256 ? n - r0 : 256;
    for (int r = 0; r < R; r++) sums[r] = 0.0;
    for (int v0 = 0; v0 < V; v0 += LEARN_VOCAB) {
      const int C = V - v0 < LEARN_VOCAB ? V - v0 : LEARN_VOCAB;
      forward_rows(&m->head, v0, C, D, R, zr + (size_t)r0 * D, l_chunk, C, J->exact, 1, r0);
      for (int r = 0; r < R; r++) {
        const float* row = l_chunk + (size_t)r * C;
        float cm = -3.4e38f;
        for (int c = 0; c < C; c++) cm = row[c] > cm ? row[c] : cm;
        const int at = r0 + r;
        if (cm > mx[at]) {
          sums[r] *= (double)exp_(mx[at] - cm);
          mx[at] = cm;
        }
        for (int c = 0; c < C; c++) sums[r] += exp_(row[c] - mx[at]);
        const int id = J->ids[first + at + 1];
        if (id >= v0 && id < v0 + C) target[at] = row[id - v0];
      }
    }
    for (int r = 0; r < R; r++) lse[r0 + r] = mx[r0 + r] + (float)log_d(sums[r]);
  }
  double loss = 0.0;
  for (int r = 0; r < n; r++) {
    const float logp = target[r] - lse[r];
    if (J->unlikely) {
      float p = exp_(logp);
      p = p < 1.f - 1e-6f ? p : 1.f - 1e-6f;
      loss -= log_d(1.0 - (double)p);
      weight[r] = -(p / (1.f - p)) / n;
    } else {
      loss -= logp;
      weight[r] = 1.f / n;
    }
  }
  for (size_t i = 0; i < (size_t)T * D; i++) l_dm[i] = 0.f;
  for (int r0 = 0; r0 < n; r0 += 256) {
    const int R = n - r0 < 256 ? n - r0 : 256;
    for (int v0 = 0; v0 < V; v0 += LEARN_VOCAB) {
      const int C = V - v0 < LEARN_VOCAB ? V - v0 : LEARN_VOCAB;
      forward_rows(&m->head, v0, C, D, R, zr + (size_t)r0 * D, l_chunk, C, J->exact, 1, r0);
      for (int r = 0; r < R; r++) {
        float* row = l_chunk + (size_t)r * C;
        const int at = r0 + r, id = J->ids[first + at + 1];
        for (int c = 0; c < C; c++) row[c] = exp_(row[c] - lse[at]) * weight[at];
        if (id >= v0 && id < v0 + C) row[id - v0] -= weight[at];
      }
      backward_rows(&m->head, v0, C, D, R, l_chunk, C, l_dm + (size_t)(first + r0) * D);
    }
  }
  return (float)(loss / n);
}

// ---- the exported entries ----

// The loss of J's text under its LoRA and every adapted factor's gradient (J->ga, J->gb). Returns 0,
// or one of abi.h's LEARN_* refusals (room: what learn_init made).
EXPORT int step_learn(const Model* m, const Learn* J) {
  const int T = J->num_tokens, D = m->dim;
  if (T < 2 || T > l_capacity || T > m->max_pos || J->scored_from >= T) return LEARN_BAD_LENGTH;
  if (J->rank < 1 || J->rank > 16) return LEARN_OUT_OF_RANGE;
  for (int t = 0; t < T; t++)
    if (J->ids[t] < 0 || J->ids[t] >= m->vocab) return LEARN_OUT_OF_RANGE;
  if (m->act != ACT_SILU || m->embed_scale != 1.f) return LEARN_FAMILY;  // the forward here is a llama's or a Qwen2's
  for (int l = 0; l < m->layers; l++)
    if (m->layer[l].q_norm || m->layer[l].post_attn_norm || m->layer[l].window) return LEARN_FAMILY;
  for (int t = 0; t < T; t++) rope_row(m->rope, m->rope_factors, m->head_dim, t, l_rope + (size_t)t * m->head_dim);
  for (int t = 0; t < T; t++) qmat_row(&m->embd, J->ids[t], D, l_saved + (size_t)t * D);
  for (int l = 0; l < m->layers; l++)
    layer_forward(m, J, l, l_saved + (size_t)l * T * D, l_saved + (size_t)(l + 1) * T * D);
  const float* last = l_saved + (size_t)m->layers * T * D;
  rms_rows(last, m->out_norm, T, D, m->eps, l_x1, l_r2);  // the final norm's output and root mean squares
  *J->loss = head_loss(m, J, l_x1);
  for (size_t n = 0; n < (size_t)T * D; n++) l_dx[n] = 0.f;
  rms_back(l_dm, last, l_r2, m->out_norm, T, D, l_dx);
  int lowest = m->layers;  // the first adapted layer: nothing below it has a factor to learn
  for (int i = LORA_TARGETS * m->layers - 1; i >= 0; i--)
    if (J->a[i]) lowest = i / 7;
  for (int l = m->layers - 1; l >= lowest; l--) layer_backward(m, J, l, l_dx);
  return 0;
}

// Adam on n factors w with their gradients g, and the EWC++ pull ewc x fisher x (w - start) added to g
// (micro_lora.MicroLora.step): moments m1, m2; c1 and c2 Adam's bias corrections 1 - beta^t.
EXPORT void learn_adam(int n, float* w, const float* g, float* m1, float* m2, const float* fisher, const float* start,
                       float ewc, float lr, float c1, float c2) {
#pragma clang fp contract(off)  // numpy's roundings, one operation at a time
  for (int i = 0; i < n; i++) {
    const float gi = ewc != 0.f ? g[i] + ewc * fisher[i] * (w[i] - start[i]) : g[i];
    m1[i] = m1[i] * 0.9f + 0.1f * gi;  // (1 - 0.9) and (1 - 0.999) in float32
    m2[i] = m2[i] * 0.999f + 0.001f * gi * gi;
    w[i] -= lr * (m1[i] / c1) / (__builtin_sqrtf(m2[i] / c2) + 1e-8f);
  }
}

// The root mean square of layer l's matrix `mat` (MATRICES' order; rows x K, as the step reads it), summed
// in double: a user's factors step by a share of it (micro_lora.MicroLora.rates). Uses learn_init's room.
EXPORT float learn_weight_rms(const Model* m, int l, int mat, int rows, int K) {
  double sum = 0.0;
  for (int n = 0; n < rows; n++) {
    qmat_row(&m->layer[l].mat[mat], n, K, l_saved);
    for (int k = 0; k < K; k++) sum += (double)l_saved[k] * l_saved[k];
  }
  return (float)__builtin_sqrt(sum / ((double)rows * K));
}

// the Fisher's refresh: fresh += g^2 / parts for each reference part's gradient
EXPORT void learn_fisher_add(int n, float* fresh, const float* g, float parts) {
  for (int i = 0; i < n; i++) fresh[i] += g[i] * g[i] / parts;
}

// fisher = decay x fisher + (1 - decay) x fresh / mean(fresh) (EWC++'s online estimate, in units of its mean)
EXPORT void learn_fisher_merge(int n, float* fisher, float* fresh, float decay) {
  double sum = 0.0;
  for (int i = 0; i < n; i++) sum += fresh[i];
  const float mean = (float)(sum / n);
  for (int i = 0; i < n; i++) {
    if (mean > 0.f) fresh[i] /= mean;
    fisher[i] = fisher[i] * decay + (1.f - decay) * fresh[i];
  }
}
