#pragma once

#include "ort_api.h"
#include "kv_write.h"

namespace {

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
//
// The pools are fp32, or int8 with two more inputs, the fp16 scales of each row's groups of numbers
// [Hkv, blocks, block_size, groups] for keys and for values (the native backend's --kv-dtype int8: a
// group of 32 is its absolute maximum / 127 steps, rounded to nearest, kv_pool.quantize_rows); a row is
// read as its int8 numbers times their group's scale, so an int8 pool is a quarter of the bytes to read.
// Two more optional inputs with an int8 pool, tails [blocks, layers, Hkv, block_size, D] per kind, fp16 (the
// native pool's: half the bytes of fp32, and the seed's FP16 hot tier) or fp32 (every layer's, block by
// block, so that a block's tail is one range of memory to give back; attribute `layer` says which is this
// one's), make it two-tier: the pool's blocks that sequences are still writing keep copies of their rows
// there in full or half precision (kv_pool.py), and a query reads the keys and values of its own block and
// the tail_blocks - 1 blocks before it "exact", from the tails or this step's rows (rounded to fp16 with fp16
// tails, as the tails hold them), and every earlier block's as stored (int8; this step's rows rounded as
// they will be). With a twelfth input,
// exact_from [B] (int64, optional), row b reads blocks before its own exact only from position
// exact_from[b] on: the scheduler's floor (kv_blocks.exact_floor), below which a row reads its own block
// alone. The choice depends on the two positions and the row's floor only, so a step's chunking, a
// prefix-cache hit or a recompute after preemption leave every position's numbers the same (the scheduler
// shares only blocks computed below floors, and cuts hits at the new request's floor).
//
// Attributes: num_heads, num_kv_heads, sliding_window (this layer's; 0: none), scale, softcap (Gemma 2's
// soft limit on the scores, cap * tanh(score / cap), before the mask; 0: none); with tails, layer and
// tail_blocks (default 1).

// sc[t] = e^(sc[t] - mx) for t in [first, last]; returns their sum (16 lanes from `first`, one fixed tree)
inline float exp_in_place(float* sc, int64_t first, int64_t last, float mx) {
  const V16 vmx = v_set1(mx);
  V16 vsum = v_zero();
  int64_t t = first;
  for (; t + 16 <= last + 1; t += 16) {
    const V16 e = v_exp(v_sub(v_loadu(&sc[t]), vmx));
    v_storeu(&sc[t], e);
    vsum = v_add(vsum, e);
  }
  if (t <= last) {
    const int64_t n = last + 1 - t;
    const V16 e = v_exp(v_sub(v_loadn(&sc[t], n), vmx));
    v_storen(&sc[t], e, n);
    vsum = v_add(vsum, v_keep(e, n));
  }
  return v_reduce_add(vsum);
}

// the largest of sc[first .. last]
inline float max_of(const float* sc, int64_t first, int64_t last) {
  V16 m = v_set1(-INFINITY);
  int64_t t = first;
  for (; t + 16 <= last + 1; t += 16) m = v_max(m, v_loadu(&sc[t]));
  if (t <= last) m = v_max_loadn(m, &sc[t], last + 1 - t);
  return v_reduce_max(m);
}

// Batch invariance: a query's numbers must not depend on the path its step sends it down (a decode row
// alone or beside others, in a shared-prefix group, its keys cut into ranges across threads, a prompt
// chunk of any length). So every path computes the same arithmetic: a score is the dot product of
// `attend` (per lane l of 16, the chain over chunks c of q[16c + l] * k[16c + l], then sum16's tree over
// the lanes), and the softmax and weighted values are taken over fixed key segments (positions
// [k * kSegment, (k + 1) * kSegment), cut to the query's keys), each giving its max, exp sum and
// undivided weighted values, folded left to right in key order. A shared prefix or a range of keys is
// then a run of whole segments whose results any path can take over.
constexpr int64_t kSegment = 128;

inline int64_t segment_last(int64_t t) { return (t / kSegment + 1) * kSegment - 1; }

inline float exp1(float x) { return v_first(v_exp(v_set1(x))); }

// One query's running result over the segments so far: o (D floats, undivided), exp sum *l, max *m
// (*l == 0: none yet); `acc` is the next segment's weighted values, ls its exp sum, ms its max.
template <int DV>
inline void fold(float* o, float* l, float* m, const V16 acc[DV], float ls, float ms) {
  if (*l == 0.f) {
    for (int d = 0; d < DV; d++) v_storeu(o + 16 * d, acc[d]);
    *l = ls;
    *m = ms;
    return;
  }
  const float mx = std::max(*m, ms);
  const float a = *m == mx ? 1.f : exp1(*m - mx), b = ms == mx ? 1.f : exp1(ms - mx);
  const V16 va = v_set1(a), vb = v_set1(b);
  for (int d = 0; d < DV; d++)
    v_storeu(o + 16 * d, v_fmadd(v_loadu(o + 16 * d), va, v_mul(acc[d], vb)));
  *l = std::fma(*l, a, ls * b);
  *m = mx;
}

// the fold's result: o / l
template <int DV>
inline void finish(const float* o, float l, float* out) {
  const V16 inv = v_set1(1.f / l);
  for (int d = 0; d < DV; d++) v_storeu(out + 16 * d, v_mul(v_loadu(o + 16 * d), inv));
}

struct AttnKernel {
  int64_t num_heads = 0, num_kv_heads = 0, window = 0, layer = -1, tail_blocks = 1;
  float scale = 1.f, softcap = 0.f;
};

// cap * tanh(s / cap) = cap - 2 cap / (e^(2 s / cap) + 1) (vexp clamps its input: no overflow)
inline V16 softcap16(V16 s, float cap) {
  const V16 e = v_exp(v_mul(s, v_set1(2.f / cap)));
  return v_sub(v_set1(cap), v_div(v_set1(2.f * cap), v_add(e, v_set1(1.f))));
}

// sc[t] = cap * tanh(sc[t] / cap) for t in [first, last]
inline void softcap_in_place(float* sc, int64_t first, int64_t last, float cap) {
  int64_t t = first;
  for (; t + 16 <= last + 1; t += 16) v_storeu(&sc[t], softcap16(v_loadu(&sc[t]), cap));
  if (t <= last) {
    const int64_t n = last + 1 - t;
    v_storen(&sc[t], softcap16(v_loadn(&sc[t], n), cap), n);
  }
}

struct AttnJob {
  const AttnKernel* k;
  const float *qk, *v;
  const void *pool_k, *pool_v;
  const int64_t *tables, *qidx, *pos;
  float* out;
  int64_t B, S, MB, NB, bs, D;
  std::atomic<bool> failed{false};
  int64_t N = 0;  // tokens this step
  const uint16_t *scale_k = nullptr, *scale_v = nullptr;  // an int8 pool's fp16 group scales; null: fp32 pools
  int64_t groups = 1;  // scales per row: one per 32 numbers, or one for the whole row (kv_pool.kv_group)
  int64_t group_k = 0, group_v = 0;  // an int4 pool's numbers per (scale, minimum) pair, per kind; 0: not int4
  const void *tail_k = nullptr, *tail_v = nullptr;  // a quantized pool's tails (this layer's), or null
  bool tail_half = false;  // the tails are fp16 (else fp32)
  int64_t tail_block = 0;  // numbers from one block's tail to the next's (layers * Hkv * bs * D)
  int bs_shift = -1;  // log2(bs) where bs is a power of two
  const int64_t* exact_from = nullptr;  // with tails: each row's floor, the first position it may read exact before its own block
  const float *step_k = nullptr, *step_v = nullptr;  // int8 pools: this step's key and value rows, rounded [N, Hkv, D]
  const float *exact_k = nullptr, *exact_v = nullptr;  // fp16 tails: this step's rows rounded to fp16 [N, Hkv, D]
};

// A key or value row: fp32 (this step's, or an fp32 pool's), or int8 times its scale (an int8 pool's).
// With an int8 pool this step's rows are read rounded as they will be stored (kv_pool.quantize_rows,
// bit for bit; round_rows, once a step), so that every position attends to the same numbers whether
// its keys come from this step or from the pool: a recomputed (preempted) sequence or a prompt after a
// prefix-cache hit then gives the tokens of the first run.

// An int4 pool's rows stay in the rotated space they are stored in (kv_write.h: y = c H x, c = 1 /
// sqrt(n)): each chunk's nibbles times its group's scale plus its minimum (a multiply, then an add, as
// numpy rounds them). A key's score is then y . (c H q), the query rotated once instead of every key, and
// a value's part of a segment's weighted sum is summed as y and rotated back once per segment (c H is its
// own inverse): rotate_back_row, in fwht's butterfly order (distance 1, 2, 4, 8 within a vector, 16, 32, ...
// across vectors) and the scale c last (kv_write.h: rotate). On a row in memory, so that a sum kept in
// registers elsewhere is not made to live in memory.
__attribute__((noinline)) inline void rotate_back_row(float* row, int DV) {
  V16 v[16];
  for (int d = 0; d < DV; d++) v[d] = v_load(row + 16 * d);
  rotate(v, DV);
  for (int d = 0; d < DV; d++) v_store(row + 16 * d, v[d]);
}

struct KVRow {
  const float* f = nullptr;
  const uint16_t* hf = nullptr;  // fp16 rows (a pool's tails)
  const int8_t* q = nullptr;
  const uint8_t* n4 = nullptr;   // int4 rows: 16 bytes per 32 numbers
  const uint16_t* sc = nullptr;  // int8 rows: their groups' fp16 scales; int4: (scale, minimum) pairs
  int shift = 0;                 // the group of 16-number chunk d is d >> shift (groups of 32, 64, or one)
  KVRow() {}
  explicit KVRow(const float* row) : f(row) {}
  explicit KVRow(const uint16_t* half) : hf(half) {}
  KVRow(const int8_t* row, const uint16_t* scales, int64_t groups) : q(row), sc(scales), shift(shift_of(groups)) {}
  KVRow(const uint8_t* row, const uint16_t* pairs, int64_t group) : n4(row), sc(pairs), shift(group == 64 ? 2 : 1) {}
  static int shift_of(int64_t groups) { return groups > 1 ? 1 : 4; }  // d < 16: d >> 4 is the one group
  bool plain() const { return f != nullptr; }
  Int4Group group4(int d) const { return Int4Group(sc + 2 * (d >> shift)); }  // chunk d's group
  // an int4 row's numbers 16d .. 16d + 15, in the rotated space it is stored in
  V16 load4(int d) const {
    V16 low, high;
    group4(d).numbers(n4 + 16 * (d >> 1), low, high);
    return (d & 1) ? high : low;
  }
  // the whole int4 row (DV chunks): each group's numbers made once, each 16 bytes loaded once for two chunks
  template <int DV>
  __attribute__((always_inline)) void load4_all(V16* v) const {
    Int4Group t;
    for (int d = 0; d < DV; d += 2) {
      if (!(d & ((1 << shift) - 1))) t = group4(d);
      t.numbers(n4 + 8 * d, v[d], v[d + 1]);
    }
  }
  V16 load_half(int d) const { return v_load_half(hf + 16 * d); }
  V16 load(int d) const {  // numbers 16d .. 16d + 15 (an int4 row's rotated ones)
    if (f) return v_loadu(f + 16 * d);
    if (hf) return load_half(d);
    if (n4) return load4(d);
    return v_mul(v_load_i8(q + 16 * d), v_set1(_cvtsh_ss(sc[d >> shift])));
  }
  // the whole row (DV chunks of 16): an int8 row's scales converted once per group, not per chunk
  template <int DV>
  __attribute__((always_inline)) void load_all(V16 v[DV]) const {
    if (f) {
      for (int d = 0; d < DV; d++) v[d] = v_loadu(f + 16 * d);
      return;
    }
    if (hf) {  // its own loop: through load(d), the value loops' stored int4 rows lost their registers
      for (int d = 0; d < DV; d++) v[d] = load_half(d);
      return;
    }
    if (n4) {
      load4_all<DV>(v);
      return;
    }
    V16 s = v_set1(_cvtsh_ss(sc[0]));
    for (int d = 0; d < DV; d++) {  // groups of 32 (two chunks each), or one for the row (shift 4)
      if (d > 0 && d % 2 == 0 && shift == 1) s = v_set1(_cvtsh_ss(sc[d / 2]));
      v[d] = v_mul(v_load_i8(q + 16 * d), s);
    }
  }
  // the whole row into `to` (D floats)
  void store_row(float* to, int DV) const {
    if (n4) {
      V16 v[16];
      switch (DV) {  // the head sizes the operator runs (paged_attention: 16 .. 128 in steps of 16, or 256)
        case 2: load4_all<2>(v); break;
        case 4: load4_all<4>(v); break;
        case 6: load4_all<6>(v); break;
        case 8: load4_all<8>(v); break;
        case 16: load4_all<16>(v); break;
        default: for (int d = 0; d < DV; d++) v[d] = load4(d);
      }
      for (int d = 0; d < DV; d++) v_storeu(to + 16 * d, v[d]);
      return;
    }
    for (int d = 0; d < DV; d++) v_storeu(to + 16 * d, load(d));
  }
  void prefetch(int DV) const {
    if (f) prefetch_row(f, DV);
    else if (hf)
      for (int d = 0; d < DV * 32; d += 64) ::prefetch(reinterpret_cast<const char*>(hf) + d);
    else if (n4)
      for (int d = 0; d < DV * 8; d += 64) ::prefetch(n4 + d);
    else
      for (int d = 0; d < DV * 16; d += 64) ::prefetch(q + d);
  }
};

// n rows of D numbers at `from` (row stride `stride`) rounded by groups as kv_pool.quantize_rows does
// (fp16 scales of max / 127, steps rounded to nearest even, kept within 127) into `to` (rows of D)
inline void round_rows(const float* from, int64_t stride, int64_t n, int64_t D, int64_t groups, float* to) {
  const int64_t chunks = D / 16 / groups;
  const V16 lim = v_set1(127.f);  // an fp16 scale rounded down can put the maximum at 128
  for (int64_t i = 0; i < n; i++) {
    const float* f = from + i * stride;
    for (int64_t g = 0; g < groups; g++) {
      V16 m = v_zero();
      for (int64_t c = 0; c < chunks; c++) m = v_max(m, v_abs(v_loadu(f + (g * chunks + c) * 16)));
      const float s = _cvtsh_ss(_cvtss_sh(v_reduce_max(m) / 127.f, _MM_FROUND_TO_NEAREST_INT));
      for (int64_t c = 0; c < chunks; c++) {
        const int64_t at = (g * chunks + c) * 16;
        V16 out = v_zero();
        if (s != 0.f) {
          const V16 steps = v_round(v_div(v_loadu(f + at), v_set1(s)));
          out = v_mul(v_max(v_min(steps, lim), v_sub(v_zero(), lim)), v_set1(s));
        }
        v_storeu(to + i * D + at, out);
      }
    }
  }
}

// n numbers (a multiple of 16) rounded to fp16 and back, nearest even: what fp16 tails hold (kv_write.h)
inline void round_half(const float* from, int64_t n, float* to) {
  for (int64_t i = 0; i < n; i += 16)
    v_storeu(to + i, v_round_half(v_loadu(from + i)));
}

// the same for an int4 pool: each row quantized as kv_write.h stores it, then read back as KVRow reads
// the pool (in the rotated space), so that this step's rows and the stored ones are the same numbers
inline void round_rows_int4(const float* from, int64_t stride, int64_t n, int64_t D, int64_t group, float* to) {
  uint8_t packed[128];
  uint16_t pairs[16];
  for (int64_t i = 0; i < n; i++) {
    quantize_row_int4(from + i * stride, D, group, packed, pairs);
    KVRow(static_cast<const uint8_t*>(packed), pairs, group).store_row(to + i * D, (int)(D / 16));
  }
}

// A query as an int8 pool's stored keys meet it: rounded to 16-bit steps of its largest magnitude / 32767
// (fp32; to nearest even), one scale for the row. Its error is a few hundred times smaller than the
// keys' own. Every path (decode, prefill, shared prefix) uses the same rounded query, so a position's
// score does not depend on the path its step took. (Scoring those steps against the keys in integers,
// vpdpwssd, was faster on decode rows; the prefill and shared-prefix paths would need the same integer
// sums for a row to keep its numbers across them, so every path now scores in fp32.)
inline void round_query(const float* q, int64_t D, float* rounded, bool rotate = false) {
  float qr[256];
  if (rotate) {  // an int4 pool's keys are stored rotated: y . (c H q) is the score
    std::memcpy(qr, q, (size_t)D * sizeof(float));
    rotate_row(qr, D);
    q = qr;
  }
  float m = 0.f;
  for (int64_t d = 0; d < D; d++) m = std::max(m, std::fabs(q[d]));
  const float s = m / 32767.f;
  for (int64_t d = 0; d < D; d++)
    rounded[d] = s > 0.f ? std::min(32767.f, std::max(-32767.f, std::nearbyint(q[d] / s))) * s : 0.f;
}

constexpr int kScoreRows = 8;  // queries per score_blocks call

// nq queries (rows of D) rounded into qr as floats (the transposed-key paths' scores; sized to be read as
// qs is, kScoreRows rows past nq); returns qr
inline const float* rounded_queries(const float* qs, int64_t nq, int64_t D, std::vector<float>& qr, bool rotate) {
  qr.assign((size_t)((nq + kScoreRows) * D), 0.f);
  for (int64_t i = 0; i < nq; i++) round_query(qs + i * D, D, &qr[i * D], rotate);
  return qr.data();
}

// Row b's kv head h (item b * Hkv + h). Its keys and values before the row's first new position (start)
// are in the pool's blocks, the rest are this step's rows.
struct RowHead {
  int64_t Hq, Hkv, G, D, b, h, base, count, start;
  const AttnJob* j;
  const int64_t* table;
  size_t head;  // the kv head's first pool row
  int64_t floor;  // the first position before a query's own block that it may read exact (exact_from)
  RowHead(const AttnJob& job, size_t item, int64_t head_dim)
      : Hq(job.k->num_heads), Hkv(job.k->num_kv_heads), G(Hq / Hkv), D(head_dim), b((int64_t)item / Hkv),
        h((int64_t)item % Hkv), base(job.qidx[b * job.S]), count(job.qidx[b * job.S + job.S - 1] - base + 1),
        start(job.pos[base]), j(&job), table(job.tables + b * job.MB), head((size_t)(h * job.NB * job.bs)),
        floor(job.exact_from ? job.exact_from[b] : 0) {}
  // position t's block (in the row's table) and place in it: shifts where the block size is a power of two
  // (a 64-bit division per key read was a good part of a long context's decode step)
  int64_t block_of(int64_t t) const { return j->bs_shift >= 0 ? t >> j->bs_shift : t / j->bs; }
  int64_t in_block(int64_t t) const { return j->bs_shift >= 0 ? t & (j->bs - 1) : t % j->bs; }
  int64_t slot(int64_t t) const { return table[block_of(t)] * j->bs + in_block(t); }  // pool row of position t < start
  KVRow pooled(const void* pool, const uint16_t* scales, int64_t group4, int64_t t) const {
    const size_t row = head + (size_t)slot(t);
    if (!scales) return KVRow(static_cast<const float*>(pool) + row * D);
    if (group4) return KVRow(static_cast<const uint8_t*>(pool) + row * (D / 2), scales + row * 2 * (D / group4), group4);
    return KVRow(static_cast<const int8_t*>(pool) + row * D, scales + row * j->groups, j->groups);
  }
  // this step's key and value rows of position t >= start, exact
  const float* step_key(int64_t t) const { return j->qk + ((base + t - start) * (Hq + Hkv) + Hq + h) * D; }
  const float* step_value(int64_t t) const { return j->v + ((base + t - start) * Hkv + h) * D; }
  // key t as stored: from the pool, or this step's row (rounded, with an int8 pool)
  KVRow key(int64_t t) const {
    if (t < start) return pooled(j->pool_k, j->scale_k, j->group_k, t);
    return KVRow(j->step_k ? j->step_k + ((base + t - start) * Hkv + h) * D : step_key(t));
  }
  KVRow value(int64_t t) const {
    if (t < start) return pooled(j->pool_v, j->scale_v, j->group_v, t);
    return KVRow(j->step_v ? j->step_v + ((base + t - start) * Hkv + h) * D : step_value(t));
  }
  // the first position a query at p reads exact (with tails: its own block's first, or the first of the
  // tail_blocks - 1 blocks before it (kv_tails.TAIL_BLOCKS) at or after the row's floor; else none)
  int64_t own_block(int64_t p) const {
    if (!j->tail_k) return INT64_MAX;
    const int64_t own = p - in_block(p);
    return std::min(own, std::max(floor, own - (j->k->tail_blocks - 1) * j->bs));
  }
  // key t for a query whose block starts at `own`: exact in that block, as stored before it
  size_t tail_row(int64_t t) const { return table[block_of(t)] * j->tail_block + (h * j->bs + in_block(t)) * D; }
  KVRow tail(const void* from, int64_t t) const {
    if (j->tail_half) return KVRow(static_cast<const uint16_t*>(from) + tail_row(t));
    return KVRow(static_cast<const float*>(from) + tail_row(t));
  }
  KVRow key(int64_t t, int64_t own) const {
    if (t < own) return key(t);
    if (t < start) return tail(j->tail_k, t);
    return KVRow(j->exact_k ? j->exact_k + ((base + t - start) * Hkv + h) * D : step_key(t));
  }
  KVRow value(int64_t t, int64_t own) const {
    if (t < own) return value(t);
    if (t < start) return tail(j->tail_v, t);
    return KVRow(j->exact_v ? j->exact_v + ((base + t - start) * Hkv + h) * D : step_value(t));
  }
  int64_t lowest(int64_t p) const { return j->k->window > 0 ? std::max<int64_t>(0, p - j->k->window + 1) : 0; }
};

// out row g (D floats) = sum over keys lo + u, u in [u0, u1), of sc[g * stride + u] * value, undivided; NG
// heads share each value row read
template <int DV, int NG>
__attribute__((always_inline)) inline void sum_values(const RowHead& r, int64_t lo, int64_t u0, int64_t u1, int64_t last,
                                                      int64_t own, const float* sc, int64_t stride, float* out) {
  V16 acc[NG][DV];
  for (int g = 0; g < NG; g++)
    for (int d = 0; d < DV; d++) acc[g][d] = v_zero();
  for (int64_t u = u0; u < u1; u++) {
    const KVRow vr = r.value(lo + u, own);
    if (lo + u + 16 <= last) r.value(lo + u + 16).prefetch(DV);  // on past the segment: a block apart
    V16 v[DV];
    vr.load_all<DV>(v);
    for (int g = 0; g < NG; g++) {
      const V16 w = v_set1(sc[g * stride + u]);
      for (int d = 0; d < DV; d++) acc[g][d] = v_fmadd(w, v[d], acc[g][d]);
    }
  }
  for (int g = 0; g < NG; g++)
    for (int d = 0; d < DV; d++) v_storeu(out + g * DV * 16 + 16 * d, acc[g][d]);
}

// out row g (D floats) = sum over keys lo + u (u < nk) of sc[g * stride + u] * value, undivided; NG heads share
// each value row read. An int4 pool's stored rows (before `own`) are summed in their rotated space and the
// sum rotated back once, then the exact rows' sum added.
template <int DV, int NG>
inline void weigh_values(const RowHead& r, int64_t lo, int64_t nk, int64_t last, int64_t own, const float* sc,
                         int64_t stride, float* out) {
  if (!r.j->group_v) {
    sum_values<DV, NG>(r, lo, 0, nk, last, own, sc, stride, out);
    return;
  }
  const int64_t stored = std::min(nk, std::max<int64_t>(0, own - lo));
  alignas(64) float back[NG][DV * 16];
  sum_values<DV, NG>(r, lo, 0, stored, last, own, sc, stride, &back[0][0]);
  for (int g = 0; g < NG; g++) rotate_back_row(back[g], DV);
  sum_values<DV, NG>(r, lo, stored, nk, last, own, sc, stride, out);
  for (int g = 0; g < NG; g++)
    for (int d = 0; d < DV; d++) {
      float* o = out + g * DV * 16 + 16 * d;
      v_storeu(o, v_add(v_load(&back[g][16 * d]), v_loadu(o)));
    }
}

// What attention over some of a query's segments left for it (a shared prefix's: their fold; a range's:
// each segment's own), per query or per segment: the undivided weighted values, the exp sum, the max.
struct Partial {
  float* o;  // D floats per query
  float *sum, *max;
  float* pre = nullptr;  // a shared prefix's: kSegment floats per query, the scores of its keys past the fold
};

// A lone decode row's keys cut across threads (as flash-decoding does): this part reads keys
// [from, to] (whole segments, but for the last) of the row's one token and leaves each segment's
// results in Partial slots slot, slot + 1, ... (G entries each), folded afterwards.
struct KeyRange {
  const Partial* into;
  int64_t from, to, slot;
};

// One row's one kv head, few queries (decode, or a token and its drafts): for each token, segment by
// segment, its G query heads' scores 16 keys at a time (a key's D/16 FMAs per head, then one 16-way sum),
// and the weighted values with each value row read once for up to 4 heads, folded. With `shared` (a row
// of a group sharing its first `from` keys, whose fold over them is in `shared`), only keys from `from` on
// are read here, continuing that fold. With `range`, only that range's keys, each segment's results left
// in its Partial slots.
template <int DV>
void attend(const AttnJob& j, const RowHead& r, const Partial* shared = nullptr, int64_t from = 0,
            const KeyRange* range = nullptr, int64_t scored = 0) {
  constexpr int D = DV * 16;
  constexpr int64_t width = kSegment;
  const int64_t Hq = r.Hq, Hkv = r.Hkv, G = r.G, h = r.h, base = r.base, count = r.count, start = r.start;
  thread_local std::vector<float> scores, qs, qr, mx, ls, keys, acc, o, l, m;
  const V16 scale = v_set1(j.k->scale);
  const bool int8 = j.scale_k != nullptr;
  keys.resize((size_t)16 * D);
  scores.resize((size_t)G * width);
  qs.resize((size_t)G * D);
  acc.resize((size_t)G * D);
  o.resize((size_t)G * D);
  for (int64_t s = 0; s < count; s++) {
    const int64_t n = base + s, p = range ? range->to : start + s, own = r.own_block(start + s);
    const int64_t first = range ? range->from : shared ? from : r.lowest(p);
    for (int64_t g = 0; g < G; g++) {  // the token's query heads, scaled
      const float* qp = j.qk + (n * (Hq + Hkv) + h * G + g) * D;
      for (int d = 0; d < DV; d++) v_storeu(&qs[g * D + 16 * d], v_mul(v_loadu(qp + 16 * d), scale));
    }
    if (int8) {  // and rounded, for the keys an int8 pool stores
      qr.resize((size_t)G * D);
      for (int64_t g = 0; g < G; g++) round_query(&qs[g * D], D, &qr[g * D], j.group_k != 0);
    }
    const float* qstored = int8 ? qr.data() : qs.data();
    l.assign((size_t)G, 0.f);
    m.assign((size_t)G, 0.f);
    if (shared)
      for (int64_t g = 0; g < G; g++) {  // the fold so far: the shared keys'
        const int64_t q = n * Hq + h * G + g;
        std::copy(shared->o + q * D, shared->o + (q + 1) * D, &o[g * D]);
        l[g] = shared->sum[q];
        m[g] = shared->max[q];
      }
    int64_t slot = range ? range->slot : 0;
    for (int64_t lo = first; lo <= p; lo = segment_last(lo) + 1, slot++) {
      const int64_t nk = std::min(p, segment_last(lo)) - lo + 1;
      mx.assign((size_t)G, -INFINITY);
      for (int64_t t0 = 0; t0 < nk; t0 += 16) {  // 16 keys at a time for every head: read from memory once
        const int nt = (int)std::min<int64_t>(16, nk - t0);
        if (lo + t0 + 16 <= scored) {  // a shared prefix's keys, scored with the group's
          for (int64_t g = 0; g < G; g++) {
            const V16 v = v_loadu(shared->pre + (n * Hq + h * G + g) * kSegment + (lo + t0 - from));
            v_storeu(&scores[g * width + t0], v);
            mx[g] = std::max(mx[g], v_reduce_max(v));
          }
          continue;
        }
        KVRow kr[16];
        bool stored[16];  // read as the pool stores it: scored against the rounded query
        for (int i = 0; i < nt; i++) {
          stored[i] = lo + t0 + i < own;
          kr[i] = r.key(lo + t0 + i, own);
          if (kr[i].plain()) continue;
          float* row = &keys[(size_t)i * D];  // a quantized key read back once here for all G heads
          kr[i].store_row(row, DV);
          kr[i] = KVRow(row);
        }
        for (int64_t t = lo + t0 + 16; t < std::min(p + 1, lo + t0 + 32); t++) r.key(t).prefetch(DV);  // a block apart
        for (int64_t g = 0; g < G; g++) {
          V16 q[DV], part[16];
          for (int d = 0; d < DV; d++) q[d] = v_loadu(&qs[g * D + 16 * d]);
          if (!int8) {
            for (int i = 0; i < nt; i++) {
              part[i] = v_mul(q[0], kr[i].load(0));
              for (int d = 1; d < DV; d++) part[i] = v_fmadd(q[d], kr[i].load(d), part[i]);
            }
          } else {
            for (int i = 0; i < nt; i++) {
              const float* qi = (stored[i] ? qstored : qs.data()) + g * D;
              part[i] = v_mul(v_loadu(qi), kr[i].load(0));
              for (int d = 1; d < DV; d++) part[i] = v_fmadd(v_loadu(qi + 16 * d), kr[i].load(d), part[i]);
            }
          }
          for (int i = nt; i < 16; i++) part[i] = v_zero();
          const V16 v = j.k->softcap > 0.f ? softcap16(sum16(part), j.k->softcap) : sum16(part);
          v_storeu(&scores[g * width + t0], v);
          mx[g] = std::max(mx[g], v_reduce_max(v, nt));
        }
      }
      ls.resize((size_t)G);
      for (int64_t g = 0; g < G; g++) ls[g] = exp_in_place(&scores[g * width], 0, nk - 1, mx[g]);
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const float* sc = &scores[g0 * width];
        float* out = &acc[g0 * D];
        switch (std::min<int64_t>(4, G - g0)) {
          case 1: weigh_values<DV, 1>(r, lo, nk, p, own, sc, width, out); break;
          case 2: weigh_values<DV, 2>(r, lo, nk, p, own, sc, width, out); break;
          case 3: weigh_values<DV, 3>(r, lo, nk, p, own, sc, width, out); break;
          default: weigh_values<DV, 4>(r, lo, nk, p, own, sc, width, out);
        }
      }
      for (int64_t g = 0; g < G; g++) {
        if (range) {  // this segment's own results
          const int64_t i = slot * G + g;
          std::copy(&acc[g * D], &acc[(g + 1) * D], range->into->o + i * D);
          range->into->sum[i] = ls[g];
          range->into->max[i] = mx[g];
          continue;
        }
        V16 a[DV];
        for (int d = 0; d < DV; d++) a[d] = v_loadu(&acc[g * D + 16 * d]);
        fold<DV>(&o[g * D], &l[g], &m[g], a, ls[g], mx[g]);
      }
    }
    if (!range)
      for (int64_t g = 0; g < G; g++) finish<DV>(&o[g * D], l[g], j.out + n * Hq * D + (h * G + g) * D);
  }
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
    KVRow rows[16];
    bool real[16];
    for (int64_t i = 0; i < 16; i++) {
      real[i] = key0 + c * 16 + i <= last;
      if (real[i]) rows[i] = r.key(key0 + c * 16 + i);
    }
    for (int64_t i = 0; i < 16 && key0 + c * 16 + 16 + i <= last; i++)  // the next 16 keys: a pool block apart
      r.key(key0 + c * 16 + 16 + i).prefetch(DV);
    for (int d0 = 0; d0 < D; d0 += 16) {
      V16 block[16];
      for (int i = 0; i < 16; i++) block[i] = real[i] ? rows[i].load(d0 / 16) : v_zero();
      transpose16(block);
      for (int d = 0; d < 16; d++) v_storeu(&dst[(d0 + d) * 16], block[d]);
    }
  }
}

// scores of R queries (q: rows of D) against NB blocks of 16 transposed keys, into rows of `stride` (nr of
// them stored): the arithmetic of `attend`'s scores, lane by lane. Lane l's chain over the chunks c
// (q[16c + l] * k[16c + l]) is one leaf; the leaves are added in sum16's tree,
// (((0+2)+(1+3)) + ((4+6)+(5+7))) + (((8+10)+(9+11)) + ((12+14)+(13+15))).
template <int D, int NB, int R>
inline void score_tree(const float* q, const float* blk, float* out, int64_t stride, int64_t nr) {
  constexpr int DV = D / 16;
  auto leaf = [&](int l, V16 x[R][NB]) {
    for (int b = 0; b < NB; b++) {
      const V16 k = v_loadu(blk + (b * D + l) * 16);
      for (int r = 0; r < R; r++) x[r][b] = v_mul(v_set1(q[r * D + l]), k);
    }
    for (int c = 1; c < DV; c++)
      for (int b = 0; b < NB; b++) {
        const V16 k = v_loadu(blk + (b * D + 16 * c + l) * 16);
        for (int r = 0; r < R; r++) x[r][b] = v_fmadd(v_set1(q[r * D + 16 * c + l]), k, x[r][b]);
      }
  };
  V16 half[2][R][NB];
  for (int Q = 0; Q < 4; Q++) {  // the quarters of the lanes
    V16 x0[R][NB], x1[R][NB], y[R][NB];
    leaf(4 * Q, x0);
    leaf(4 * Q + 2, y);
    for (int r = 0; r < R; r++)
      for (int b = 0; b < NB; b++) x0[r][b] = v_add(x0[r][b], y[r][b]);
    leaf(4 * Q + 1, x1);
    leaf(4 * Q + 3, y);
    for (int r = 0; r < R; r++)
      for (int b = 0; b < NB; b++) {
        const V16 quarter = v_add(x0[r][b], v_add(x1[r][b], y[r][b]));
        half[Q / 2][r][b] = Q % 2 ? v_add(half[Q / 2][r][b], quarter) : quarter;
      }
  }
  for (int r = 0; r < nr; r++)
    for (int b = 0; b < NB; b++) v_storeu(out + r * stride + 16 * b, v_add(half[0][r][b], half[1][r][b]));
}

// the same for nr <= kScoreRows queries (all kScoreRows rows are read) against `blocks` (1 or 2) blocks
template <int D>
inline void score(const float* q, const float* blk, float* out, int64_t stride, int64_t nr, int64_t blocks) {
  if (blocks == 2)
    score_tree<D, 2, kScoreRows>(q, blk, out, stride, nr);
  else
    score_tree<D, 1, kScoreRows>(q, blk, out, stride, nr);
}

// queries per value row read: as many as keep their accumulators (DV registers each) in registers
template <int DV>
constexpr int kValueRows = std::clamp(24 / DV, 1, 8);

// acc[i] = sum over positions u in [u_lo, u_hi] of sc[i][u] * value(u), for kValueRows queries per value row
// read; query i reads the values from own[i] on exact (two-tier pools; INT64_MAX: none), as `attend` does
template <int DV>
inline void weigh(const RowHead& r, int64_t u_lo, int64_t u_hi, int64_t last, const float* const* sc,
                  V16 acc[][DV], const int64_t* own) {
  constexpr int NQ = kValueRows<DV>;
  for (int i = 0; i < NQ; i++)
    for (int d = 0; d < DV; d++) acc[i][d] = v_zero();
  const int64_t exact_from = *std::min_element(own, own + NQ);
  if (r.j->group_v) {  // an int4 pool: each query's stored rows summed rotated, rotated back once (weigh_values)
    // first the stored rows (each query's before its own[i]), then the exact ones: each sum in registers,
    // each in ascending positions, as weigh_values sums them
    const int64_t stored_to = std::min(u_hi, *std::max_element(own, own + NQ) - 1);
    for (int64_t u = u_lo; u <= stored_to; u++) {
      if (u + 16 <= last) r.value(u + 16).prefetch(DV);
      V16 v[DV];
      r.value(u).load_all<DV>(v);
      for (int i = 0; i < NQ; i++) {
        if (u >= own[i]) continue;
        const V16 w = v_set1(sc[i][u]);
        for (int d = 0; d < DV; d++) acc[i][d] = v_fmadd(w, v[d], acc[i][d]);
      }
    }
    alignas(64) float rot[NQ][DV * 16];
    for (int i = 0; i < NQ; i++)
      for (int d = 0; d < DV; d++) {
        v_store(&rot[i][16 * d], acc[i][d]);
        acc[i][d] = v_zero();
      }
    for (int64_t u = std::max(u_lo, exact_from); u <= u_hi; u++) {
      V16 v[DV];
      r.value(u, u).load_all<DV>(v);
      for (int i = 0; i < NQ; i++) {
        if (u < own[i]) continue;
        const V16 w = v_set1(sc[i][u]);
        for (int d = 0; d < DV; d++) acc[i][d] = v_fmadd(w, v[d], acc[i][d]);
      }
    }
    for (int i = 0; i < NQ; i++) {
      rotate_back_row(rot[i], DV);
      for (int d = 0; d < DV; d++) acc[i][d] = v_add(v_load(&rot[i][16 * d]), acc[i][d]);
    }
    return;
  }
  int64_t u = u_lo;
  for (; u <= std::min(u_hi, exact_from - 1); u++) {
    const KVRow vr = r.value(u);
    if (u + 16 <= last) r.value(u + 16).prefetch(DV);  // on past the segment
    V16 v[DV];
    vr.load_all<DV>(v);
    for (int i = 0; i < NQ; i++) {
      const V16 w = v_set1(sc[i][u]);
      for (int d = 0; d < DV; d++) acc[i][d] = v_fmadd(w, v[d], acc[i][d]);
    }
  }
  for (; u <= u_hi; u++) {  // each query's own block: the exact rows from its own[i], as stored before
    V16 stored[DV], exact[DV];
    r.value(u).load_all<DV>(stored);
    r.value(u, u).load_all<DV>(exact);
    for (int i = 0; i < NQ; i++) {
      const V16 w = v_set1(sc[i][u]);
      const V16* v = u >= own[i] ? exact : stored;
      for (int d = 0; d < DV; d++) acc[i][d] = v_fmadd(w, v[d], acc[i][d]);
    }
  }
}

// v's lanes added in sum16's tree (a key's score, as `attend` sums its lanes)
inline float tree16(V16 v) {
  alignas(64) float x[16];
  v_store(x, v);
  auto quarter = [&](int q) { return (x[4 * q] + x[4 * q + 2]) + (x[4 * q + 1] + x[4 * q + 3]); };
  return (quarter(0) + quarter(1)) + (quarter(2) + quarter(3));
}

// Two-tier pools: the keys transposed for a prefill chunk are the stored ones, so each query's scores
// over its own block's keys [own, p] are computed again from the exact rows, as `attend` computes them.
template <int DV>
inline void own_block_scores(const RowHead& r, const float* q, int64_t own, int64_t p, float* sc) {
  for (int64_t t = own; t <= p; t++) {
    const KVRow k = r.key(t, own);
    V16 acc = v_mul(v_loadu(q), k.load(0));
    for (int d = 1; d < DV; d++) acc = v_fmadd(v_loadu(q + 16 * d), k.load(d), acc);
    sc[t] = tree16(acc);
  }
}

// Per query of a group (nq of them), over keys [lo, last]: with its scores sc(i)[t] for t in [first(i), p(i)]
// (zero elsewhere in [lo, last]), segment by segment: its exp sums, weighted values (kValueRows queries per
// value row read) and the fold, into o (D floats a query), l, m. sc(i) and first(i), p(i), own(i) callables.
template <int DV, class Scores, class First, class Last, class Own>
void softmax_values(const RowHead& r, int64_t nq, int64_t lo, int64_t last, Scores sc, First first, Last plast,
                    Own own, float* o, float* l, float* m) {
  constexpr int D = DV * 16, NQ = kValueRows<DV>;
  thread_local std::vector<float> smax, ssum;
  thread_local std::vector<int64_t> x, y;
  smax.resize((size_t)nq);
  ssum.resize((size_t)nq);
  x.resize((size_t)nq);
  y.resize((size_t)nq);
  std::fill(l, l + nq, 0.f);
  for (int64_t a = lo; a <= last; a = segment_last(a) + 1) {
    const int64_t b = std::min(last, segment_last(a));
    for (int64_t i = 0; i < nq; i++) {  // query i's part of the segment: [x, y]
      x[i] = std::max(a, first(i));
      y[i] = std::min(b, plast(i));
      if (x[i] > y[i]) continue;
      float* s = sc(i);
      smax[i] = max_of(s, x[i], y[i]);
      ssum[i] = exp_in_place(s, x[i], y[i], smax[i]);
    }
    for (int64_t i0 = 0; i0 < nq; i0 += NQ) {
      const int64_t nr = std::min<int64_t>(NQ, nq - i0);
      int64_t u_lo = INT64_MAX, u_hi = -1;
      const float* rows[NQ];
      int64_t owns[NQ];
      for (int rr = 0; rr < NQ; rr++) {
        const int64_t i = i0 + std::min<int64_t>(rr, nr - 1);
        rows[rr] = sc(i);
        owns[rr] = own(i);
        if (rr < nr && x[i] <= y[i]) {
          u_lo = std::min(u_lo, x[i]);
          u_hi = std::max(u_hi, y[i]);
        }
      }
      if (u_hi < 0) continue;
      V16 acc[NQ][DV];
      weigh<DV>(r, u_lo, u_hi, last, rows, acc, owns);
      for (int rr = 0; rr < nr; rr++) {
        const int64_t i = i0 + rr;
        if (x[i] <= y[i]) fold<DV>(o + i * D, &l[i], &m[i], acc[rr], ssum[i], smax[i]);
      }
    }
  }
}

// queries q0 .. q0 + nq - 1 of the row's kv head (query i: token i / G, head h * G + i % G)
template <int DV>
void attend_group(const AttnJob& j, const RowHead& r, const float* kt, int64_t key0, int64_t q0, int64_t nq) {
  constexpr int D = DV * 16;
  const int64_t Hq = r.Hq, Hkv = r.Hkv, G = r.G, h = r.h, base = r.base, start = r.start;
  thread_local std::vector<float> qs, qr, scores, o, l, m;
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
  const float* qstored = j.scale_k ? rounded_queries(qs.data(), nq, D, qr, j.group_k != 0) : qs.data();
  for (int64_t t0 = lo; t0 <= p_last; t0 += 32) {  // 2 key blocks x 8 queries a call
    const float* blk = kt + (t0 - key0) / 16 * D * 16;
    const int64_t blocks = t0 + 16 - lo < width ? 2 : 1;
    for (int64_t i0 = 0; i0 < nq; i0 += kScoreRows) {
      const int64_t nr = std::min<int64_t>(kScoreRows, nq - i0);
      const int64_t p_lo = start + (q0 + i0) / G, p_hi = start + (q0 + i0 + nr - 1) / G;
      if (t0 > p_hi || t0 + 32 <= r.lowest(p_lo)) continue;  // wholly outside these queries' keys
      score<D>(qstored + i0 * D, blk, &scores[i0 * width + (t0 - lo)], width, nr, blocks);
    }
  }
  auto pos = [&](int64_t i) { return start + (q0 + i) / G; };
  auto sc = [&](int64_t i) { return &scores[i * width] - lo; };  // sc(i)[t] for t in [lo, lo + width)
  for (int64_t i = 0; i < nq; i++) {  // exact own blocks, the soft cap; zero outside each query's keys
    const int64_t p = pos(i), first = r.lowest(p);
    float* s = sc(i);
    if (j.tail_k) own_block_scores<DV>(r, &qs[i * D], std::max(first, r.own_block(p)), p, s);
    if (j.k->softcap > 0.f) softcap_in_place(s, first, p, j.k->softcap);
    std::fill(s + lo, s + first, 0.f);
    std::fill(s + p + 1, s + lo + width, 0.f);
  }
  o.resize((size_t)nq * D);
  l.resize((size_t)nq);
  m.resize((size_t)nq);
  softmax_values<DV>(r, nq, lo, p_last, sc, [&](int64_t i) { return r.lowest(pos(i)); }, pos,
                     [&](int64_t i) { return r.own_block(pos(i)); }, o.data(), l.data(), m.data());
  for (int64_t i = 0; i < nq; i++) {
    const int64_t qi = q0 + i, n = base + qi / G, head = h * G + qi % G;
    finish<DV>(&o[i * D], l[i], j.out + n * Hq * D + head * D);
  }
}

// Decode rows whose first `keys` positions are the same pool blocks (a prompt prefix they share through
// the prefix cache): their queries attend to those keys together, each key block read and transposed
// once for all of them, as a prefill chunk's are (cascade attention); each row then reads only its own
// later keys and merges the two parts.
struct SharedGroup {
  std::vector<int64_t> rows;
  int64_t keys = 0;  // the shared keys folded together: whole segments
  int64_t scored = 0;  // the shared keys scored together: whole blocks of 16, keys .. keys + kSegment - 1
  float* kt = nullptr;  // kv head h's transposed keys at kt + h * scored * D
};

// Queries q0 .. q0 + nq - 1 of a group's kv head h (query i: row rows[i / G]'s one token, head
// h * G + i % G) over the group's shared keys (whole segments, all stored): the fold over them.
template <int DV>
void attend_shared(const AttnJob& j, const SharedGroup& grp, int64_t h, int64_t q0, int64_t nq, const Partial& out) {
  constexpr int D = DV * 16;
  const int64_t Hq = j.k->num_heads, Hkv = j.k->num_kv_heads, G = Hq / Hkv, keys = grp.keys, scored = grp.scored;
  const float* kt = grp.kt + h * scored * D;
  const RowHead r(j, (size_t)(grp.rows[0] * Hkv + h), D);  // the pool rows of the shared positions
  thread_local std::vector<float> qs, qr, scores, o, l, m;
  qs.resize((size_t)(QG + kScoreRows) * D);  // rows past nq are read, not stored
  scores.resize((size_t)nq * scored);
  auto query = [&](int64_t i) { return j.qidx[grp.rows[(q0 + i) / G] * j.S] * Hq + h * G + (q0 + i) % G; };
  for (int64_t i = 0; i < nq; i++) {
    const int64_t q = query(i), n = q / Hq, head = q % Hq;
    const float* qp = j.qk + (n * (Hq + Hkv) + head) * D;
    for (int d = 0; d < D; d++) qs[i * D + d] = qp[d] * j.k->scale;
  }
  const float* qstored = j.scale_k ? rounded_queries(qs.data(), nq, D, qr, j.group_k != 0) : qs.data();
  for (int64_t t0 = 0; t0 < scored; t0 += 32)
    for (int64_t i0 = 0; i0 < nq; i0 += kScoreRows)
      score<D>(qstored + i0 * D, kt + t0 * D, &scores[i0 * scored + t0], scored, std::min<int64_t>(kScoreRows, nq - i0),
               t0 + 16 < scored ? 2 : 1);
  if (j.k->softcap > 0.f)
    for (int64_t i = 0; i < nq; i++) softcap_in_place(&scores[i * scored], 0, scored - 1, j.k->softcap);
  for (int64_t i = 0; i < nq; i++)  // the scores past the whole segments, for each row to take up
    std::copy(&scores[i * scored + keys], &scores[(i + 1) * scored], out.pre + query(i) * kSegment);
  o.resize((size_t)nq * D);
  l.assign((size_t)nq, 0.f);
  m.resize((size_t)nq);
  if (keys > 0)
    softmax_values<DV>(r, nq, 0, keys - 1, [&](int64_t i) { return &scores[i * scored]; },
                       [](int64_t) { return int64_t{0}; }, [&](int64_t) { return keys - 1; },
                       [](int64_t) { return INT64_MAX; }, o.data(), l.data(), m.data());
  for (int64_t i = 0; i < nq; i++) {
    const int64_t q = query(i);
    std::copy(&o[i * D], &o[(i + 1) * D], out.o + q * D);
    out.sum[q] = l[i];
    out.max[q] = m[i];
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
  std::vector<float> step_rows;  // int8 pools: this step's keys, then values, rounded (AttnJob::step_k)
  std::vector<float> exact_rows;  // fp16 tails: this step's keys, then values, rounded to fp16 (AttnJob::exact_k)
};

constexpr int64_t kChunkBlocks = 8;  // key blocks (of 16) per transposition work item

template <int DV>
void transpose_item(const AttnJob& j, const Plan& plan, size_t item) {
  const KeyChunk& c = plan.chunks[item];
  const RowHead r(j, (size_t)c.row_head, DV * 16);
  transpose_keys<DV>(r, c.key0, c.last, c.kt, c.c0, c.c1);
}

// the ranges' segments (count of them from slot `first`) folded in key order, then divided
template <int DV>
void merge_ranges(const AttnJob& j, const Plan& plan, const RowHead& r, int64_t first, int64_t count) {
  constexpr int D = DV * 16;
  const Partial& p = plan.split;
  for (int64_t g = 0; g < r.G; g++) {
    alignas(64) float o[D];
    float l = 0.f, m = 0.f;
    for (int64_t c = 0; c < count; c++) {
      const int64_t i = (first + c) * r.G + g;
      V16 acc[DV];
      for (int d = 0; d < DV; d++) acc[d] = v_loadu(p.o + i * D + 16 * d);
      fold<DV>(o, &l, &m, acc, p.sum[i], p.max[i]);
    }
    finish<DV>(o, l, j.out + r.base * r.Hq * D + (r.h * r.G + g) * D);
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
    case PartKind::kSharedRow: return attend<DV>(j, r, &plan.shared, part.shared->keys, nullptr, part.shared->scored);
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
  std::vector<int64_t> start((size_t)j.B);  // each row's first position not shared: new, or read exact
  for (int64_t b = 0; b < j.B; b++) {
    const RowHead r(j, (size_t)(b * j.k->num_kv_heads), j.D);
    start[b] = std::min(r.start, r.own_block(r.start));
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
      grp.scored = blocks * j.bs / 16 * 16;
      grp.keys = grp.scored / kSegment * kSegment;  // whole segments
      if (grp.scored >= 32) {
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
    floats += (size_t)(Hkv * grp.scored * D);
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
    at += Hkv * grp.scored * D;
    for (int64_t h = 0; h < Hkv; h++)
      for (int64_t c = 0; c < grp.scored / 16; c += kChunkBlocks)
        plan.chunks.push_back({grp.rows[0] * Hkv + h, 0, grp.scored - 1, grp.kt + h * grp.scored * D, c,
                               std::min(grp.scored / 16, c + kChunkBlocks)});
  }
  if (!plan.groups.empty()) {
    const int64_t N = j.N, Hq = j.k->num_heads;
    plan.partial.resize((size_t)(N * Hq * (D + 2 + kSegment)));
    float* part = plan.partial.data();
    plan.shared = {part, part + N * Hq * D, part + N * Hq * (D + 1), part + N * Hq * (D + 2)};
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
  // ranges of whole segments, 256 keys or more, enough of them for ~8 items, folded afterwards.
  int64_t decode_rows = 0;
  for (int64_t b = 0; b < j.B; b++) decode_rows += plan.role[b] == 0;
  const bool cut = decode_rows == j.B && decode_rows * Hkv < 8 && j.k->window == 0;
  int64_t slots = 0;
  for (int64_t h = 0; h < Hkv; h++)  // kv head by kv head: rows sharing prefix blocks read them while cached
    for (int64_t b = 0; b < j.B; b++) {
      if (plan.role[b] != 0) continue;
      const RowHead r(j, (size_t)(b * Hkv + h), D);
      const int64_t keys = r.start + 1, segments = (keys + kSegment - 1) / kSegment;
      const int64_t ranges = std::min<int64_t>(keys / 256, (8 + decode_rows * Hkv - 1) / (decode_rows * Hkv));
      if (!cut || r.count != 1 || ranges < 2) {
        plan.parts.push_back({PartKind::kDecode, b * Hkv + h});
        continue;
      }
      for (int64_t c = 0; c < ranges; c++) {
        const int64_t s0 = segments * c / ranges, s1 = segments * (c + 1) / ranges;
        plan.parts.push_back({PartKind::kKeyRange, b * Hkv + h, s0 * kSegment, std::min(keys, s1 * kSegment) - 1,
                              slots + s0});
      }
      plan.after.push_back({PartKind::kMerge, b * Hkv + h, slots, segments});
      slots += segments;
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
  auto fattr = api<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttribute_float);
  if (!st) st = fattr(info, "scale", &k->scale);
  if (!st) st = fattr(info, "softcap", &k->softcap);
  if (!st) {
    if (OrtStatus* none = attr(info, "layer", &k->layer)) {  // optional: only the tails need it
      api<void (*)(OrtStatus*)>(kReleaseStatus)(none);
      k->layer = -1;
    }
    if (OrtStatus* none = attr(info, "tail_blocks", &k->tail_blocks)) {  // optional: 1, the own block alone
      api<void (*)(OrtStatus*)>(kReleaseStatus)(none);
      k->tail_blocks = 1;
    }
  }
  if (!st && k->tail_blocks < 1) st = fail("ruvllm.PagedAttention: tail_blocks must be at least 1");
  if (!st && k->softcap < 0.f) st = fail("ruvllm.PagedAttention: softcap must not be negative");
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
  const OrtValue* in[12] = {};
  std::vector<int64_t> dims[12];
  RETURN_IF(read_inputs(ctx, 12, in, dims, 7, "ruvllm.PagedAttention"));  // scales, tails, floors: optional
  if (dims[0].size() != 2 || dims[2].size() != 4 || dims[4].size() != 2 || dims[5].size() != 2 || dims[6].size() != 1)
    return fail("ruvllm.PagedAttention: unexpected input ranks");
  const int64_t D = dims[0][1], N = dims[6][0];
  if (D % 16 || D > 256 || (D > 128 && D != 256) || dims[2][0] != k.num_kv_heads || (dims[2][3] != D && 2 * dims[2][3] != D))
    return fail("ruvllm.PagedAttention: head_dim must be 16..128 in steps of 16, or 256, and match the pool");
  AttnJob job{&k, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
              dims[5][0], dims[5][1], dims[4][1], dims[2][1], dims[2][2], D};
  job.N = N;
  if (job.bs > 0 && (job.bs & (job.bs - 1)) == 0) job.bs_shift = __builtin_ctzll((unsigned long long)job.bs);
  RETURN_IF(tensor_data(in[0], const_cast<float**>(&job.qk)));
  RETURN_IF(tensor_data(in[1], const_cast<float**>(&job.v)));
  int kinds[2] = {};
  RETURN_IF(tensor_type(in[2], &kinds[0]));
  RETURN_IF(tensor_type(in[3], &kinds[1]));
  if (kinds[0] != kinds[1] || (kinds[0] != kFloat && kinds[0] != kInt8 && kinds[0] != kUint8))
    return fail("ruvllm.PagedAttention: the key and value pools must both be float, both int8 or both uint8 (int4)");
  const bool int4 = kinds[0] == kUint8;
  if (dims[2][3] != (int4 ? D / 2 : D) || (int4 && D % 32))
    return fail("ruvllm.PagedAttention: a pool row holds head_dim numbers (int4: head_dim / 2 bytes, head_dim a multiple of 32)");
  if (kinds[0] != kFloat) {  // each row's group scales (int4: scale and minimum pairs), [Hkv, blocks, block_size, n], fp16
    for (int i : {7, 8}) {
      int type = 0;
      if (in[i]) RETURN_IF(tensor_type(in[i], &type));
      const int64_t n = dims[i].size() == 4 ? dims[i][3] : 0;
      const bool fits = int4 ? n > 0 && n % 2 == 0 && (2 * D == 32 * n || 2 * D == 64 * n)
                             : n == dims[7][3] && (n == 1 || D == 32 * n);
      if (!in[i] || type != kFloat16 || !fits || dims[i][0] != dims[2][0] || dims[i][1] != dims[2][1] || dims[i][2] != dims[2][2])
        return fail("ruvllm.PagedAttention: int8 pools need fp16 scales [kv_heads, blocks, block_size, groups], one per 32 "
                    "numbers of a row or one per row; int4 pools a (scale, minimum) pair per 32 or 64 numbers");
    }
    job.groups = dims[7][3];
    if (int4) {
      job.group_k = 2 * D / dims[7][3];
      job.group_v = 2 * D / dims[8][3];
    }
    RETURN_IF(tensor_data(in[7], const_cast<uint16_t**>(&job.scale_k)));
    RETURN_IF(tensor_data(in[8], const_cast<uint16_t**>(&job.scale_v)));
    if (in[9] || in[10]) {  // the tails [blocks, layers, Hkv, block_size, D], fp16 or fp32
      int types[2] = {};
      for (int i : {9, 10}) {
        int& type = types[i - 9];
        if (in[i]) RETURN_IF(tensor_type(in[i], &type));
        const std::vector<int64_t>& t = dims[i];
        if (!in[i] || (type != kFloat16 && type != kFloat) || t.size() != 5 || t[0] != dims[2][1] || t[2] != dims[2][0] ||
            t[3] != dims[2][2] || t[4] != D || k.layer < 0 || k.layer >= t[1])
          return fail("ruvllm.PagedAttention: a quantized pool's tails must both be fp16 or fp32 [blocks, layers, "
                      "kv_heads, block_size, head_dim], with this node's `layer` among them");
      }
      if (types[0] != types[1]) return fail("ruvllm.PagedAttention: the key and value tails must have one type");
      job.tail_half = types[0] == kFloat16;
      job.tail_block = dims[9][1] * dims[9][2] * dims[9][3] * D;
      const size_t layer_offset = (size_t)(k.layer * dims[9][2] * dims[9][3] * D) * (job.tail_half ? 2 : 4);
      RETURN_IF(tensor_data(in[9], const_cast<void**>(&job.tail_k)));
      RETURN_IF(tensor_data(in[10], const_cast<void**>(&job.tail_v)));
      job.tail_k = static_cast<const char*>(job.tail_k) + layer_offset;
      job.tail_v = static_cast<const char*>(job.tail_v) + layer_offset;
      if (in[11]) {  // each row's floor
        int type = 0;
        RETURN_IF(tensor_type(in[11], &type));
        if (type != kInt64 || dims[11].size() != 1 || dims[11][0] != job.B)
          return fail("ruvllm.PagedAttention: exact_from must be int64 [batch], one floor per row");
        RETURN_IF(tensor_data(in[11], const_cast<int64_t**>(&job.exact_from)));
      }
    }
  }
  if ((in[9] || in[10]) && !job.scale_k) return fail("ruvllm.PagedAttention: full-precision tails go with an int8 or int4 pool");
  if (in[11] && !job.tail_k) return fail("ruvllm.PagedAttention: exact_from goes with a quantized pool's tails");
  RETURN_IF(tensor_data(in[2], const_cast<void**>(&job.pool_k)));
  RETURN_IF(tensor_data(in[3], const_cast<void**>(&job.pool_v)));
  RETURN_IF(tensor_data(in[4], const_cast<int64_t**>(&job.tables)));
  RETURN_IF(tensor_data(in[5], const_cast<int64_t**>(&job.qidx)));
  RETURN_IF(tensor_data(in[6], const_cast<int64_t**>(&job.pos)));
  const int64_t out_dims[2] = {N, k.num_heads * D};
  RETURN_IF(output_data(ctx, 0, out_dims, 2, &job.out));
  if (N == 0 || job.B * k.num_kv_heads == 0) return nullptr;
  thread_local Plan plan;  // the calling thread's; its workers only read it
  if (job.scale_k) {  // this step's rows as the pool will store them, rounded once rather than at every read
    const int64_t Hq = k.num_heads, Hkv = k.num_kv_heads;
    plan.step_rows.resize((size_t)(2 * N * Hkv * D));
    float* keys = plan.step_rows.data();
    for (int64_t n = 0; n < N; n++) {
      const float* from = job.qk + (n * (Hq + Hkv) + Hq) * D;
      if (job.group_k) round_rows_int4(from, D, Hkv, D, job.group_k, keys + n * Hkv * D);
      else round_rows(from, D, Hkv, D, job.groups, keys + n * Hkv * D);
    }
    if (job.group_v) round_rows_int4(job.v, D, N * Hkv, D, job.group_v, keys + N * Hkv * D);
    else round_rows(job.v, D, N * Hkv, D, job.groups, keys + N * Hkv * D);
    job.step_k = keys;
    job.step_v = keys + N * Hkv * D;
    if (job.tail_half) {  // and as fp16 tails hold them, for the rows read "exact"
      plan.exact_rows.resize((size_t)(2 * N * Hkv * D));
      float* exact = plan.exact_rows.data();
      for (int64_t n = 0; n < N; n++) round_half(job.qk + (n * (Hq + Hkv) + Hq) * D, Hkv * D, exact + n * Hkv * D);
      round_half(job.v, N * Hkv * D, exact + N * Hkv * D);
      job.exact_k = exact;
      job.exact_v = exact + N * Hkv * D;
    }
  }
  make_plan(job, plan);
  PhaseJob phase{&job, &plan};
  if (!plan.chunks.empty()) RETURN_IF(parallel_for(ctx, phase_item<TransposeItem>, plan.chunks.size(), &phase));
  if (!job.failed) RETURN_IF(parallel_for(ctx, phase_item<PartItem>, plan.parts.size(), &phase));
  if (!job.failed && !plan.after.empty()) RETURN_IF(parallel_for(ctx, phase_item<AfterItem>, plan.after.size(), &phase));
  return job.failed ? fail("ruvllm.PagedAttention: out of memory") : nullptr;
}

}  // namespace
