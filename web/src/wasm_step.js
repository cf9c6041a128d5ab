// Runs engine steps on the page's own WASM decode step (wasm/step/step.c, built as step.wasm) instead of
// an onnxruntime-web session: the bridge runtime/backends/web.py calls, with StepRunner's interface.
//
// The package's step weights (step.bin and its index step.json: the GGUF's own blocks at their own bits,
// exporter/step_weights.py) are copied into the module's memory once; the KV pool lives there too. A step
// writes the batch's small arrays in, runs step_run (K/V into the pool, logits of the rows asking) and
// step_sample (the graph's logits processing: penalties, mask, temperature, top-K), and replies with the
// candidates only. Structs are packed by field name (structs.js over formats.js, generated from
// runtime/formats/step_abi.py as step.c's own abi.h is).

import { STEP } from './formats.js';
import { rowLogprobs } from './prompt_scores.js';
import { LoraStore } from './lora_store.js';
import { offsetOf, sizeOf, writeStruct, writeStructs } from './structs.js';

export const NO_XLORA = 'X-LoRA does not run on the WASM step yet: load the engine with backend "onnxruntime"';
const TARGETS = STEP.targets; // Lora's tables: target t of layer l at TARGETS.length * l + t
export const TOKENS_PER_STEP = 512; // step_init's scratch: the page's steps are at most maxBatchTokens (256 by default)
const HELPER_STACK = 1 << 18; // bytes of stack each helper instance gets (step.c's frames are small)
const PAGE = 65536;
export const STEP_FORMAT = STEP.format; // the step.bin layout this module reads

// resolves when a helper (a Worker, or Node's worker_threads Worker) reports, rejects on its error
function reply(helper) {
  return new Promise((resolve, reject) => {
    const got = (data) => (data?.error ? reject(new Error(`a WASM step helper: ${data.error}`)) : resolve(data));
    if (helper.once) {
      helper.once('message', got);
      helper.once('error', reject);
    } else {
      helper.addEventListener('message', (e) => got(e.data), { once: true });
      helper.addEventListener('error', (e) => reject(new Error(`a WASM step helper: ${e.message ?? 'failed to start'}`)), { once: true });
    }
  });
}

// The step's KV pool as prompt_kv.js sees one (the fp32 KvPool's interface): keys and values, each
// [layers, kv_heads, num_blocks * block_size, head_dim] floats in the module's memory.
class StepPool {
  constructor(runner, layout, numBlocks, [keys, values], dtype = 'fp32') {
    Object.assign(this, layout, { runner, numBlocks, dtype, starts: [keys, values] });
  }

  get blockFloats() {
    return this.numLayers * 2 * this.kvHeads * this.blockSize * this.headDim;
  }

  get bytes() {
    return 4 * this.blockFloats * this.numBlocks;
  }

  /** [pointer, floats] of each block's rows, block by block: layer, keys then values, head. */
  * spans(ids) {
    const span = this.blockSize * this.headDim, head = this.numBlocks * span;
    for (const id of ids) {
      if (!(id >= 0 && id < this.numBlocks)) throw new Error(`KV block ${id} is outside the pool (${this.numBlocks} blocks)`);
      for (let l = 0; l < this.numLayers; l++) {
        for (const start of this.starts) {
          for (let h = 0; h < this.kvHeads; h++) yield [start + 4 * ((l * this.kvHeads + h) * head + id * span), span];
        }
      }
    }
  }

  readBlocks(ids) {
    const out = new Float32Array(ids.length * this.blockFloats);
    let at = 0;
    for (const [p, n] of this.spans(ids)) {
      out.set(this.runner.f32(p, n), at);
      at += n;
    }
    return out;
  }

  writeBlocks(ids, data) {
    let at = 0;
    for (const [p, n] of this.spans(ids)) {
      this.runner.f32(p, n).set(data.subarray(at, at + n));
      at += n;
    }
  }
}

// The step's adapters: lora_store.js's columns in the module's memory, as step.c's Lora reads them. B of
// q and k is kept in the GGUF's row order (a llama's: each head's halves interleaved, as the step's q and k
// rows are).
class StepAdapters {
  constructor(runner, spec) {
    this.runner = runner;
    this.store = new LoraStore(spec, { make: (n) => ({ at: runner.alloc(4 * n), n }), view: (h) => runner.f32(h.at, h.n) });
    const layers = runner.cfg.layers, width = TARGETS.length;
    const tables = [runner.alloc(4 * width * layers), runner.alloc(4 * width * layers)];
    TARGETS.forEach((name, i) => {
      const t = this.store.targets[name];
      for (let l = 0; t && l < layers; l++) {
        runner.i32(tables[0] + 4 * (width * l + i), 1)[0] = t.a[l].at;
        runner.i32(tables[1] + 4 * (width * l + i), 1)[0] = t.b[l].at;
      }
    });
    this.tables = tables;
    this.scratch = runner.alloc(4 * 3 * TOKENS_PER_STEP * spec.maxColumns);
    this.struct = runner.alloc(sizeOf('Lora'));
  }

  set(meta, bytes) {
    this.store.set(meta, bytes);
    if (this.runner.cfg.rope_neox) return; // a Qwen2 GGUF keeps the graph's rows: nothing to reorder
    const hd = this.runner.cfg.head_dim, half = hd / 2, start = (meta.slot - 1) * meta.columns;
    for (const name of ['q_proj', 'k_proj']) {
      const t = this.store.targets[name];
      for (let l = 0; t && l < t.b.length; l++) {
        const b = this.store.arrays.view(t.b[l]);
        for (let c = start; c < start + meta.columns; c++) {
          for (let head = c * t.fout; head < (c + 1) * t.fout; head += hd) {
            const graph = b.slice(head, head + hd); // number i of the head, and i + head_dim / 2, side by side
            for (let i = 0; i < half; i++) {
              b[head + 2 * i] = graph[i];
              b[head + 2 * i + 1] = graph[half + i];
            }
          }
        }
      }
    }
  }

  setClassifier() {
    throw new Error(NO_XLORA);
  }

  /** step.c's Lora for a step: `columns` bound, the tokens' weights at `weights` ([tokens, columns]). */
  bind(columns, weights) {
    if (columns > this.store.maxColumns) throw new Error(`${columns} adapter columns: the WASM step holds ${this.store.maxColumns}`);
    writeStruct(this.runner.k.memory.buffer, this.struct, 'Lora',
      { columns, weights, a: this.tables[0], b: this.tables[1], u: this.scratch });
    return this.struct;
  }
}

/** step.bin's bytes: its last array's end. */
export const weightBytes = (index) => Math.max(...index.arrays.map((a) => a.offset + a.bytes));

export class WasmStepRunner {
  /** The module (step.wasm's bytes, or a function or promise giving them), the weights' index
   * (step.json) and the weights: step.bin's bytes, or `async (view) => ...` that writes them through
   * view(at, n) (a Uint8Array of n bytes at file offset `at`, in the module's memory: streamed in, no
   * whole copy in JS); the package's manifest. Options: `fallback`, a function giving step-simd128.wasm's
   * bytes, for a browser without relaxed SIMD; `threads` > 1 with `threaded` (a function giving step-threads.wasm's bytes) and
   * `spawnHelper` (a function making a Worker that runs step_helper.js): the step's work split across
   * that many threads over one shared memory (wasm/step/threads.h), where shared memory exists. */
  static async create(wasm, index, weights, manifest, { fallback, threads = 1, threaded, spawnHelper } = {}) {
    if (threads > 1 && threaded && spawnHelper && typeof SharedArrayBuffer !== 'undefined' && globalThis.crossOriginIsolated !== false) {
      const bytes = await threaded();
      const module = await WebAssembly.compile(bytes).catch(() => null); // no relaxed SIMD: one thread below
      if (module) {
        // the weights and room to grow: more than the module's own data and stack ask for
        const pages = Math.ceil((weightBytes(index) + (16 << 20)) / PAGE);
        const memory = new WebAssembly.Memory({ initial: pages, maximum: 65535, shared: true });
        const instance = await WebAssembly.instantiate(module, { env: { memory } });
        const runner = new WasmStepRunner({ ...instance.exports, memory }, index, manifest, bytes);
        await runner.load(index, weights);
        await runner.startHelpers(module, memory, threads - 1, spawnHelper);
        return runner;
      }
    }
    let module, bytes = typeof wasm === 'function' ? await wasm() : await wasm;
    try {
      module = await WebAssembly.compile(bytes);
    } catch (err) { // no relaxed SIMD here: the SIMD128 build (plain products, no fused multiply-adds)
      if (!fallback) throw err;
      bytes = await fallback();
      module = await WebAssembly.compile(bytes);
    }
    const instance = await WebAssembly.instantiate(module, {});
    const runner = new WasmStepRunner(instance.exports, index, manifest, bytes);
    await runner.load(index, weights);
    return runner;
  }

  /** `moduleBytes`: the build these exports came from (its hash names the K/V it computes: prompt_kv.js). */
  constructor(exports, index, manifest, moduleBytes) {
    this.k = exports;
    this.moduleBytes = moduleBytes;
    this.cfg = index.config;
    this.vocabSize = manifest.config.vocab_size;
    this.scratch = {}; // name -> [pointer, bytes]: grown, never freed
    this.io = null;
    this.pool = null; // StepPool, once allocated
    this.helpers = [];
    this.steps = 0;
    this.sessionMs = 0; // inside step_run and step_sample
    this.stepMs = 0;
  }

  /** The weights into the module's memory as step.bin lies (the file is the memory image: its arrays at
   * their offsets, 64-byte aligned; fp16 scales are widened as step.c reads them), then the model's structs.
   * A function `weights(view, repack)` writes them itself: `repack(name, rows, cols, src, row0, n)` places
   * rows of matrix `name` from a GGUF's raw blocks (gguf_source.js). */
  async load(index, weights) {
    const size = weightBytes(index), base = this.alloc(size);
    this.weights = { base, size };
    const at = Object.fromEntries(index.arrays.map((a) => [a.name, base + a.offset]));
    if (typeof weights === 'function') {
      await weights((at, n) => {
        if (at < 0 || at + n > size) throw new Error(`bytes ${at}..${at + n} are outside step.bin (${size} bytes)`);
        return this.u8(base + at, n);
      }, this.repacker(index, at));
    } else {
      this.u8(base, size).set(weights.subarray(0, size));
    }
    this.model = this.placeModel(index, at);
    if (this.k.step_init(this.model, TOKENS_PER_STEP) !== TOKENS_PER_STEP) throw new Error('the WASM step: out of memory for its scratch');
  }

  /** A matrix's QMat: its kind, then its parts' addresses (`at`: array name -> address), as wasm/step_module.py builds it. */
  qmat(index, at, name) {
    return { kind: this.cfg.kinds[index.matrices[name]], ...Object.fromEntries(STEP.parts.map((part) => [part, at[`${name}.${part}`] ?? 0])) };
  }

  /** step_repack (wasm/step/repack.h) into matrix `name`'s arrays: rows [row0, row0 + n) of [rows, cols] from
   * `src`, those rows' raw blocks, copied through a scratch buffer that grows to the largest piece. */
  repacker(index, at) {
    const q = this.alloc(sizeOf('QMat'));
    let scratch = 0, room = 0;
    return (name, rows, cols, src, row0, n) => {
      if (src.length > room) {
        room = Math.max(src.length, 4 << 20);
        scratch = this.alloc(room);
      }
      this.u8(scratch, src.length).set(src);
      writeStruct(this.k.memory.buffer, q, 'QMat', this.qmat(index, at, name));
      if (this.k.step_repack(q, rows, cols, scratch, row0, n)) {
        throw new Error(`the WASM step cannot repack ${name} (${index.matrices[name]} [${rows}, ${cols}], rows ${row0}..${row0 + n})`);
      }
    };
  }

  /** step.c's Model and its Layers over the arrays placed at `at` (name -> address), as
   * wasm/step_module.py builds them. */
  placeModel(index, at) {
    const cfg = this.cfg;
    const qmat = (name) => this.qmat(index, at, name);
    const layers = Array.from({ length: cfg.layers }, (_, l) => ({
      attn_norm: at[`${l}.attn_norm`], ffn_norm: at[`${l}.ffn_norm`], bias: ['q', 'k', 'v'].map((p) => at[`${l}.${p}.bias`] ?? 0),
      mat: STEP.matrices.map((p) => qmat(`${l}.${p}`)),
      ...Object.fromEntries(['q_norm', 'k_norm', 'post_attn_norm', 'post_ffn_norm'].map((n) => [n, at[`${l}.${n}`] ?? 0])),
      window: cfg.windows?.[l] ?? 0, rope: at[cfg.layer_rope?.[l] ?? 'rope'],
    }));
    const layer = this.alloc(sizeOf('Layer') * cfg.layers);
    writeStructs(this.k.memory.buffer, layer, 'Layer', layers);
    const model = this.alloc(sizeOf('Model'));
    writeStruct(this.k.memory.buffer, model, 'Model', {
      dim: cfg.dim, hidden: cfg.hidden, layers: cfg.layers, heads: cfg.heads, kv_heads: cfg.kv_heads, head_dim: cfg.head_dim,
      vocab: cfg.vocab, max_pos: cfg.max_pos, eps: cfg.eps, rope_neox: cfg.rope_neox ? 1 : 0, act: cfg.act ?? 0,
      embed_scale: cfg.embed_scale ?? 1, attn_scale: cfg.attn_scale ?? 1 / Math.sqrt(cfg.head_dim), embd: qmat('embd'),
      head: qmat(index.matrices.head ? 'head' : 'embd'), out_norm: at.out_norm, rope: at.rope,
      rope_factors: at.rope_factors ?? 0, layer,
    });
    return model;
  }

  /** Up to `count` helper threads (no more than the module splits a job between), each an instance of
   * `module` over `memory` with a stack of its own, inside step_helper for good: the next step's jobs are
   * split with them. A helper that cannot start (no nested workers, a blocked script) leaves the step on
   * fewer threads, with the same numbers. */
  async startHelpers(module, memory, count, spawnHelper) {
    count = Math.min(count, this.k.step_max_threads() - 1);
    for (let i = 0; i < count; i++) {
      let helper = null;
      try {
        helper = spawnHelper();
        const started = reply(helper);
        helper.postMessage({ module, memory, stackTop: this.alloc(HELPER_STACK) + HELPER_STACK });
        await started;
        this.helpers.push(helper);
      } catch (err) {
        helper?.terminate();
        console.warn(`ruvllm: the WASM step runs on ${1 + this.helpers.length} thread(s): ${err?.message ?? err}`);
        break;
      }
    }
    // a helper counts itself in as it enters its loop, just after its reply
    for (let tries = 0; this.k.step_threads() < this.helpers.length + 1; tries++) {
      if (tries > 500) throw new Error(`the WASM step's helpers did not start (${this.k.step_threads() - 1} of ${this.helpers.length})`);
      await new Promise((resolve) => setTimeout(resolve, 2));
    }
  }

  /** The helper threads leave step_helper and end. */
  close() {
    this.k.step_stop();
    for (const helper of this.helpers) helper.terminate();
    this.helpers = [];
  }

  get threads() { return this.k.step_threads(); }

  // views made afresh each time: the memory's buffer is replaced when it grows
  u8(p, n) { return new Uint8Array(this.k.memory.buffer, p, n); }
  i32(p, n) { return new Int32Array(this.k.memory.buffer, p, n); }
  f32(p, n) { return new Float32Array(this.k.memory.buffer, p, n); }

  alloc(bytes) {
    if (!(bytes >= 0 && bytes <= 0xFFFFFFFF)) throw new Error(`the WASM step's memory cannot grow by ${bytes} bytes (wasm32 holds 4 GB)`);
    const p = this.k.arena(bytes) >>> 0; // an address past 2 GB comes back from wasm32 as a negative i32
    if (!p) throw new Error(`the WASM step's memory cannot grow by ${bytes} bytes`);
    return p;
  }

  /** A buffer of at least `bytes` kept under `name` (replaced by one twice the size when too small). */
  buffer(name, bytes) {
    const [p, size] = this.scratch[name] ?? [0, 0];
    if (bytes <= size) return p;
    const grown = Math.max(64, 2 * bytes);
    this.scratch[name] = [this.alloc(grown), grown];
    return this.scratch[name][0];
  }

  ints(name, values) {
    const p = this.buffer(name, 4 * values.length);
    this.i32(p, values.length).set(values);
    return p;
  }

  floats(name, values) {
    const p = this.buffer(name, 4 * values.length);
    this.f32(p, values.length).set(values);
    return p;
  }

  timings() {
    return { steps: this.steps, session_ms: this.sessionMs, bridge_ms: this.stepMs, kv_pool_bytes: this.poolBytes ?? 0,
      kv_tail_bytes: (this.tailSlots?.length ?? 0) * this.tailBytes, threads: this.threads };
  }

  /** The pool (io.kv_layout, from Python's runtime/core/kv_blocks.py: the dtype, each kind's bytes of numbers
   * and fp16 scales a row, the blocks a query reads exact) and, for a quantized one, its tails' map. */
  allocate(numBlocks, blockSize, io) {
    const c = this.cfg, layout = io.kv_layout, rows = c.layers * c.kv_heads * numBlocks * blockSize;
    const dtype = STEP.kvDtypes.indexOf(layout.dtype);
    if (dtype < 0) throw new Error(`kvDtype ${JSON.stringify(layout.dtype)}: the WASM step keeps "${STEP.kvDtypes.join('", "')}"`);
    const [keys, values] = layout.numbers.map((n) => this.alloc(rows * n));
    const [keyScales, valueScales] = dtype ? layout.scales.map((w) => this.alloc(2 * rows * w)) : [0, 0];
    this.tailOf = dtype ? this.alloc(4 * numBlocks) : 0; // block -> tail slot, -1: none
    if (dtype) this.i32(this.tailOf, numBlocks).fill(-1);
    this.tailSlots = []; // each tail slot's address
    this.tailTable = 0; // their addresses, as step.c's Pool.tails reads them
    this.tailBytes = 2 * c.layers * c.kv_heads * blockSize * c.head_dim * 4;
    this.poolStruct = this.alloc(sizeOf('Pool'));
    writeStruct(this.k.memory.buffer, this.poolStruct, 'Pool', { num_blocks: numBlocks, block_size: blockSize, k: keys,
      v: values, dtype, ks: keyScales, vs: valueScales, tail_blocks: layout.tail_blocks ?? 1, tail_of: this.tailOf, tails: 0 });
    this.pool = new StepPool(this, { numLayers: c.layers, kvHeads: c.kv_heads, headDim: c.head_dim, blockSize }, numBlocks,
      [keys, values], layout.dtype);
    this.poolBytes = rows * (layout.numbers[0] + layout.numbers[1] + 2 * (layout.scales[0] + layout.scales[1]));
    this.io = io;
  }

  /** A step's block -> tail slot changes (runtime/core/kv_tails.py TailSlots), slots new to it made. */
  moveTails(changes) {
    const before = this.tailSlots.length;
    for (const [block, slot] of changes) {
      while (slot >= this.tailSlots.length) this.tailSlots.push(this.alloc(this.tailBytes));
      this.i32(this.tailOf + 4 * block, 1)[0] = slot;
    }
    if (this.tailSlots.length === before) return;
    this.tailTable = this.buffer('tails', 4 * this.tailSlots.length);
    this.i32(this.tailTable, this.tailSlots.length).set(this.tailSlots);
    this.i32(this.poolStruct + offsetOf('Pool', 'tails'), 1)[0] = this.tailTable;
  }

  /** Adapters on the step (spec: web.py's, as onnxruntime-web's LoRA graph gets it); not X-LoRA. */
  enableLora(spec) {
    if (spec.xlora) throw new Error(NO_XLORA);
    this.lora ??= new StepAdapters(this, spec);
  }

  async run(step) {
    const started = performance.now();
    if (step.classify) throw this.loraError ?? new Error(NO_XLORA);
    if (step.lora && !this.lora) throw this.loraError ?? new Error('the WASM step got adapter weights before its adapters');
    const r = this.io.step_feeds, f = step.feeds;
    const ids = f[r.ids][0], [rowsIn, maxBlocks] = f[r.block_tables][1];
    const qidx = f[r.query_index][0], rows = step.rows, vocab = this.cfg.vocab;
    if (ids.length > TOKENS_PER_STEP) {
      throw new Error(`a step of ${ids.length} tokens: the WASM step holds ${TOKENS_PER_STEP}; set maxBatchTokens lower`);
    }
    const logits = this.buffer('logits', 4 * Math.max(1, rows) * vocab);
    let adapters = 0;
    if (step.lora) { // one set of weights a token: layerwise (X-LoRA) sets come with classify steps
      if ((step.lora.sets ?? 1) !== 1) throw new Error(NO_XLORA);
      adapters = this.lora.bind(step.lora.columns, this.floats('lora_weights', step.lora.weights));
    }
    let exactFrom = 0, keep = 0;
    if (step.tails) { // a quantized pool: its tails' slots, the rows' floors, the tokens kept exact too
      this.moveTails(step.tails.changes);
      exactFrom = this.ints('exact_from', step.tails.exact_from);
      const kept = new Int32Array(ids.length);
      for (const t of step.tails.keep) kept[t] = 1;
      keep = this.ints('keep', kept);
    }
    const batch = this.buffer('batch', sizeOf('Batch'));
    writeStruct(this.k.memory.buffer, batch, 'Batch', { num_tokens: ids.length, num_rows: rowsIn, max_blocks: maxBlocks,
      num_logits: rows, ids: this.ints('ids', ids), pos: this.ints('pos', f[r.positions][0]), slots: this.ints('slots', step.kv_slots),
      row_first: this.ints('first', qidx.map((q) => q[0])), row_count: this.ints('count', qidx.map((q) => q[q.length - 1] - q[0] + 1)),
      tables: this.ints('tables', f[r.block_tables][0].flat()), logits_at: this.ints('logits_at', f[r.logits_index][0]), logits,
      lora: adapters, exact_from: exactFrom, keep });
    const t0 = performance.now();
    const status = this.k.step_run(this.model, this.poolStruct, batch);
    if (status) throw new Error(`the WASM step refused a step: ${STEP.refusals[status] ?? `status ${status}`}`);
    const result = { topk_ids: [], topk_logprobs: [] };
    if (rows) {
      if (step.want_logits) {
        result.logits = Array.from({ length: rows }, (_, i) => Array.from(this.f32(logits + 4 * i * vocab, vocab)));
      }
      if (step.score_ids) result.scores = rowLogprobs((i) => this.f32(logits + 4 * i * vocab, vocab), step.score_ids);
      const k = Math.min(f[r.top_k][0][0], vocab), sparse = f[r.sparse_ids][0], width = sparse[0].length;
      let mask = 0;
      if (step.mask) { // per row a bitmask (bit i = token i allowed) or null: every token
        const rowBytes = (vocab + 7) >> 3;
        mask = this.buffer('mask', rows * rowBytes);
        step.mask.forEach((bits, i) => this.u8(mask + i * rowBytes, rowBytes).set(bits ?? new Uint8Array(rowBytes).fill(255)));
      }
      const out = [this.buffer('out_ids', 4 * rows * k), this.buffer('out_values', 4 * rows * k), this.buffer('out_stats', 8 * rows)];
      const sampling = this.buffer('sampling', sizeOf('Sampling'));
      writeStruct(this.k.memory.buffer, sampling, 'Sampling', { num_logits: rows, num_sparse: width, top_k: k,
        temperature: this.floats('temperature', f[r.temperature][0]), repetition: this.floats('repetition', f[r.repetition][0]),
        presence: this.floats('presence', f[r.presence][0]), frequency: this.floats('frequency', f[r.frequency][0]),
        sparse_ids: this.ints('sparse_ids', sparse.flat()), sparse_seen: this.floats('seen', f[r.sparse_seen][0].flat()),
        sparse_counts: this.floats('counts', f[r.sparse_counts][0].flat()), sparse_bias: this.floats('bias', f[r.sparse_bias][0].flat()),
        mask, logits, out_ids: out[0], out_values: out[1], out_stats: out[2] });
      if (this.k.step_sample(this.model, sampling)) throw new Error(`the WASM step cannot take the top ${k} of ${rows} rows`);
      const topIds = this.i32(out[0], rows * k), values = this.f32(out[1], rows * k), stats = this.f32(out[2], 2 * rows);
      for (let i = 0; i < rows; i++) {
        const lse = stats[2 * i] + Math.log(stats[2 * i + 1]);
        result.topk_ids.push(Array.from(topIds.subarray(i * k, (i + 1) * k)));
        result.topk_logprobs.push(Array.from(values.subarray(i * k, (i + 1) * k), (v) => v - lse));
      }
    }
    this.sessionMs += performance.now() - t0;
    this.steps++;
    this.stepMs += performance.now() - started;
    return result;
  }
}
