// The paged KV pool on the JS side: one Float32Array per layer and kind, [kv_heads, capacity, block_size, head_dim].
//
// onnxruntime-web copies every input into the WASM heap on each run, so the pool is fed at the
// capacity in use, not the engine's full budget: the block allocator hands out the lowest free
// ids, and capacity grows (a re-layout, amortised over `growBy` blocks (64 tokens)) only when a step needs a
// higher block. Python never sees these arrays.
//
// dtype 'int8' (the page's kvDtype): Int8Array rows and, per layer and kind, a Uint16Array of fp16 scales
// [kv_heads, capacity, block_size, groups], one per group of `group` numbers (Python's kv_group, sent with
// the pool's layout); this step's rows are quantized as runtime/backends/kv_pool.py's quantize_rows does,
// op for op, which the int8-KV graph also does to the rows it attends to in the step that writes them.

import { fromHalf, toHalf } from './fp16.js';

/** Round half to even (numpy's rint). */
function rint(v) {
  const r = Math.round(v);
  return r - v === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** One row of n numbers from src[at..] as int8 q[qAt..] and fp16 scales s[sAt..], groups of g. */
export function quantizeRow(src, at, n, g, q, qAt, s, sAt) {
  for (let k = 0; k < n / g; k++) {
    let top = 0;
    for (let i = 0; i < g; i++) top = Math.max(top, Math.abs(src[at + k * g + i]));
    const bits = toHalf(Math.fround(top / 127));
    s[sAt + k] = bits;
    const scale = fromHalf(bits) || 1;
    for (let i = 0; i < g; i++) {
      const v = rint(Math.fround(src[at + k * g + i] / scale));
      q[qAt + k * g + i] = Math.max(-127, Math.min(127, v));
    }
  }
}

export class KvPool {
  /** rows: { dtype: 'fp32' | 'int8', group: numbers per int8 scale (runtime/core/kv_blocks.py kv_group) }. */
  constructor({ numLayers, kvHeads, headDim }, maxBlocks, blockSize, { dtype = 'fp32', group = headDim } = {}, growBy = 4) {
    if (dtype !== 'fp32' && dtype !== 'int8') throw new Error(`KV pool dtype ${dtype}: "fp32" or "int8"`);
    if (!(group > 0 && headDim % group === 0)) throw new Error(`KV pool: ${group} numbers per scale do not divide ${headDim}`);
    Object.assign(this, { numLayers, kvHeads, headDim, maxBlocks, blockSize, growBy, dtype, group });
    this.groups = headDim / group;
    this.capacity = 0;
    this.keys = [];
    this.values = [];
    this.keyScales = [];
    this.valueScales = [];
    this.ensure(1);
  }

  /** Make room for block ids below `blocks`. */
  ensure(blocks) {
    if (blocks <= this.capacity) return;
    if (blocks > this.maxBlocks) throw new Error(`KV block ${blocks - 1} is outside the pool (${this.maxBlocks} blocks)`);
    const cap = Math.min(this.maxBlocks, Math.ceil(blocks / this.growBy) * this.growBy);
    const { kvHeads: H, blockSize: bs, headDim: D } = this;
    const grow = (old, Type, row) => {
      const next = new Type(H * cap * bs * row);
      const oldHead = this.capacity * bs * row;
      for (let h = 0; h < H && old; h++) next.set(old.subarray(h * oldHead, (h + 1) * oldHead), h * cap * bs * row);
      return next;
    };
    const int8 = this.dtype === 'int8';
    for (let l = 0; l < this.numLayers; l++) {
      this.keys[l] = grow(this.keys[l], int8 ? Int8Array : Float32Array, D);
      this.values[l] = grow(this.values[l], int8 ? Int8Array : Float32Array, D);
      if (int8) {
        this.keyScales[l] = grow(this.keyScales[l], Uint16Array, this.groups);
        this.valueScales[l] = grow(this.valueScales[l], Uint16Array, this.groups);
      }
    }
    this.capacity = cap;
  }

  get dims() {
    return [this.kvHeads, this.capacity, this.blockSize, this.headDim];
  }

  get scaleDims() {
    return [this.kvHeads, this.capacity, this.blockSize, this.groups];
  }

  /** Write this step's K/V, present [layers, tokens, kv_heads, head_dim], into pool slots (block * bs + offset). */
  write(presentKey, presentValue, slots) {
    const { numLayers: L, kvHeads: H, headDim: D } = this;
    const n = slots.length;
    const headStride = this.capacity * this.blockSize * D;
    const { group: g, groups: G } = this, scaleStride = this.capacity * this.blockSize * G;
    for (let l = 0; l < L; l++) {
      const k = this.keys[l], v = this.values[l];
      for (let t = 0; t < n; t++) {
        const slot = slots[t] * D;
        for (let h = 0; h < H; h++) {
          const src = ((l * n + t) * H + h) * D;
          const dst = h * headStride + slot;
          if (this.dtype === 'int8') {
            const at = h * scaleStride + slots[t] * G;
            quantizeRow(presentKey, src, D, g, k, dst, this.keyScales[l], at);
            quantizeRow(presentValue, src, D, g, v, dst, this.valueScales[l], at);
          } else {
            k.set(presentKey.subarray(src, src + D), dst);
            v.set(presentValue.subarray(src, src + D), dst);
          }
        }
      }
    }
  }

  /** Each block's spans of block_size * head_dim floats, [block][layer][key, value][kv_head] order: [array, offset]. */
  *blockSpans(ids) {
    const span = this.blockSize * this.headDim, headStride = this.capacity * span;
    for (const id of ids) {
      for (let l = 0; l < this.numLayers; l++) {
        for (const pool of [this.keys[l], this.values[l]]) {
          for (let h = 0; h < this.kvHeads; h++) yield [pool, h * headStride + id * span];
        }
      }
    }
  }

  /** Copy whole blocks out, in blockSpans order (an fp32 pool's: prompt_kv.js keeps no int8 blocks). */
  readBlocks(ids) {
    if (this.dtype !== 'fp32') throw new Error('only an fp32 KV pool\'s blocks are copied out');
    const span = this.blockSize * this.headDim;
    const out = new Float32Array(ids.length * this.blockFloats);
    let at = 0;
    for (const [pool, from] of this.blockSpans(ids)) {
      out.set(pool.subarray(from, from + span), at);
      at += span;
    }
    return out;
  }

  /** The inverse of readBlocks: write `data` (the first ids.length blocks of it) into blocks `ids`. */
  writeBlocks(ids, data) {
    this.ensure(Math.max(...ids) + 1);
    const span = this.blockSize * this.headDim;
    let at = 0;
    for (const [pool, to] of this.blockSpans(ids)) {
      pool.set(data.subarray(at, at + span), to);
      at += span;
    }
  }

  get blockFloats() {
    return this.numLayers * 2 * this.kvHeads * this.blockSize * this.headDim;
  }

  get bytes() {
    const row = this.dtype === 'int8' ? this.headDim + 2 * this.groups : 4 * this.headDim;
    return 2 * this.numLayers * this.kvHeads * this.capacity * this.blockSize * row;
  }
}
