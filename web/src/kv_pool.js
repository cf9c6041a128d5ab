// The paged KV pool on the JS side: one Float32Array per layer and kind, [kv_heads, capacity, block_size, head_dim].
//
// onnxruntime-web copies every input into the WASM heap on each run, so the pool is fed at the
// capacity in use, not the engine's full budget: the block allocator hands out the lowest free
// ids, and capacity grows (a re-layout, amortised over `growBy` blocks (64 tokens)) only when a step needs a
// higher block. Python never sees these arrays.

export class KvPool {
  constructor({ numLayers, kvHeads, headDim }, maxBlocks, blockSize, growBy = 4) {
    Object.assign(this, { numLayers, kvHeads, headDim, maxBlocks, blockSize, growBy });
    this.capacity = 0;
    this.keys = [];
    this.values = [];
    this.ensure(1);
  }

  /** Make room for block ids below `blocks`. */
  ensure(blocks) {
    if (blocks <= this.capacity) return;
    if (blocks > this.maxBlocks) throw new Error(`KV block ${blocks - 1} is outside the pool (${this.maxBlocks} blocks)`);
    const cap = Math.min(this.maxBlocks, Math.ceil(blocks / this.growBy) * this.growBy);
    const { kvHeads: H, blockSize: bs, headDim: D } = this;
    const grow = (old) => {
      const next = new Float32Array(H * cap * bs * D);
      const oldHead = this.capacity * bs * D;
      for (let h = 0; h < H && old; h++) next.set(old.subarray(h * oldHead, (h + 1) * oldHead), h * cap * bs * D);
      return next;
    };
    for (let l = 0; l < this.numLayers; l++) {
      this.keys[l] = grow(this.keys[l]);
      this.values[l] = grow(this.values[l]);
    }
    this.capacity = cap;
  }

  get dims() {
    return [this.kvHeads, this.capacity, this.blockSize, this.headDim];
  }

  /** Write this step's K/V, present [layers, tokens, kv_heads, head_dim], into pool slots (block * bs + offset). */
  write(presentKey, presentValue, slots) {
    const { numLayers: L, kvHeads: H, headDim: D } = this;
    const n = slots.length;
    const headStride = this.capacity * this.blockSize * D;
    for (let l = 0; l < L; l++) {
      const k = this.keys[l], v = this.values[l];
      for (let t = 0; t < n; t++) {
        const slot = slots[t] * D;
        for (let h = 0; h < H; h++) {
          const src = ((l * n + t) * H + h) * D;
          const dst = h * headStride + slot;
          k.set(presentKey.subarray(src, src + D), dst);
          v.set(presentValue.subarray(src, src + D), dst);
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

  /** Copy whole blocks out, in blockSpans order. */
  readBlocks(ids) {
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
    return 2 * this.numLayers * this.kvHeads * this.capacity * this.blockSize * this.headDim * 4;
  }
}
