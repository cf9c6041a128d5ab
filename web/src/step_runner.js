// Runs one engine step on an onnxruntime-web session: the bridge runtime/backends/web.py calls.
//
// Python sends the step's small arrays (token ids, positions, block tables, sampling rows); the
// KV pool never leaves JS. The reply holds only the top-K candidates (and full logits on request).

import { KvPool } from './kv_pool.js';
import { rowLogprobs } from './prompt_scores.js';
import { LoraStore } from './lora_store.js';

// ONNX TensorProto element types of the graph inputs a step builds (the manifest's io.inputs say which)
const ELEMENT_TYPES = { 1: ['float32', Float32Array.from.bind(Float32Array)], 7: ['int64', (d) => BigInt64Array.from(d, BigInt)] };

/** name -> { type, make, rank } for every graph input the manifest declares (the exporter writes them
 * from runtime/contract.py): a step's tensors get their dtype and rank from here, never from a copy. */
export function inputSpec(manifest) {
  const spec = {};
  for (const { name, dtype, shape } of manifest.io.inputs) {
    const [type, make] = ELEMENT_TYPES[dtype] ?? [];
    if (type) spec[name] = { type, make, rank: shape.length };
  }
  return spec;
}

/** A graph input from Python's [values, dims], with the dtype and rank `spec` (inputSpec) declares. */
export function makeTensor(ort, spec, name, [values, dims]) {
  const input = spec[name];
  if (!input) throw new Error(`the step feeds ${name}, which this model's graph does not declare`);
  const data = dims.length > 1 ? values.flat(dims.length - 1) : values;
  if (dims.length !== input.rank || data.length !== dims.reduce((a, b) => a * b, 1)) {
    throw new Error(`graph input ${name}: ${data.length} values as [${dims}], the graph declares rank ${input.rank}`);
  }
  return new ort.Tensor(input.type, input.make(data), dims);
}

export class StepRunner {
  constructor(ort, session, manifest) {
    const config = manifest.config;
    this.ort = ort;
    this.session = session;
    this.spec = inputSpec(manifest);
    this.config = { numLayers: config.num_layers, kvHeads: config.num_kv_heads, headDim: config.head_dim };
    this.vocabSize = config.vocab_size;
    this.io = null; // which inputs and outputs play which part (the manifest's io.roles), sent by Python
    this.pool = null;
    this.lora = null; // LoraStore, once Python enabled adapters
    this.loraSession = null; // Promise<InferenceSession> of the LoRA graph, which then runs every step
    this.steps = 0;
    this.sessionMs = 0; // inside onnxruntime-web's run
    this.stepMs = 0; // the whole bridge call: feeds, run, KV write, reply
  }

  timings() {
    return { steps: this.steps, session_ms: this.sessionMs, bridge_ms: this.stepMs, kv_pool_bytes: this.pool?.bytes ?? 0 };
  }

  allocate(numBlocks, blockSize, io) {
    this.pool = new KvPool(this.config, numBlocks, blockSize, { dtype: io.kv_dtype, group: io.kv_group });
    this.io = io;
  }

  /** Open the LoRA graph (openGraph: the worker's loader) and keep the adapters' columns for it. */
  enableLora(spec, openGraph) {
    this.lora ??= new LoraStore(spec);
    this.loraSession ??= openGraph();
    this.loraSession.catch(() => {}); // surfaces at the next step
  }

  /** Structured output's [rows, vocab] logits mask: 0 where a row's bitmask (little-endian, bit i =
   * token i; null for an unconstrained row) allows the token, -Infinity elsewhere. */
  maskTensor(rows) {
    const v = this.vocabSize;
    const data = new Float32Array(rows.length * v);
    rows.forEach((bits, r) => {
      if (!bits) return;
      for (let i = 0; i < v; i++) if (!((bits[i >> 3] >> (i & 7)) & 1)) data[r * v + i] = -Infinity;
    });
    return new this.ort.Tensor('float32', data, [rows.length, v]);
  }

  async run(step) {
    const started = performance.now();
    const { ort, pool } = this;
    if (step.lora) { // the LoRA graph runs every step from now on: the base session's memory goes
      if (this.loraError) throw this.loraError;
      const lora = await this.loraSession;
      if (this.session !== lora) {
        await this.session.release();
        this.session = lora;
      }
    }
    pool.ensure(step.blocks_needed);
    const feeds = {};
    for (const [name, value] of Object.entries(step.feeds)) feeds[name] = makeTensor(ort, this.spec, name, value);
    if (step.lora) this.lora.addFeeds(ort, feeds, step.lora);
    const mask = this.io.logits_mask;
    if (step.mask) feeds[mask] = this.maskTensor(step.mask);
    if (mask && !feeds[mask] && this.session.inputNames.includes(mask)) { // no constrained row: [1, vocab] zeros
      this.noMask ??= new Float32Array(this.vocabSize);
      feeds[mask] = new ort.Tensor('float32', this.noMask, [1, this.vocabSize]);
    }
    const { io } = this;
    const dims = pool.dims, type = pool.dtype === 'int8' ? 'int8' : 'float32';
    for (let l = 0; l < this.config.numLayers; l++) {
      feeds[io.past_keys[l]] = new ort.Tensor(type, pool.keys[l], dims);
      feeds[io.past_values[l]] = new ort.Tensor(type, pool.values[l], dims);
      if (type === 'int8') { // each row's groups' fp16 scales (runtime/contract.py past_key_scale)
        feeds[io.past_key_scales[l]] = new ort.Tensor('float16', pool.keyScales[l], pool.scaleDims);
        feeds[io.past_value_scales[l]] = new ort.Tensor('float16', pool.valueScales[l], pool.scaleDims);
      }
    }
    const rows = step.rows;
    const fetches = [io.present_key, io.present_value];
    if (step.classify) fetches.push(step.classify.hidden); // X-LoRA's scaling pass
    if (rows) fetches.push(io.topk_ids, io.topk_logprobs);
    if (rows && (step.want_logits || step.score_ids)) fetches.push(io.logits);
    const t0 = performance.now();
    const out = await this.session.run(feeds, fetches);
    this.sessionMs += performance.now() - t0;
    pool.write(out[io.present_key].data, out[io.present_value].data, step.kv_slots);
    this.steps++;
    const result = { topk_ids: [], topk_logprobs: [] };
    if (step.classify) {
      const hidden = out[step.classify.hidden].data;
      result.classified = step.classify.groups.map(([id, start, n]) => this.lora.classify(id, hidden, start, n));
    }
    if (rows) {
      const ids = out[io.topk_ids], lps = out[io.topk_logprobs].data;
      const k = ids.dims[1];
      for (let r = 0; r < rows; r++) {
        result.topk_ids.push(Array.from(ids.data.subarray(r * k, (r + 1) * k), Number));
        result.topk_logprobs.push(Array.from(lps.subarray(r * k, (r + 1) * k)));
      }
      if (step.want_logits) {
        const v = this.vocabSize, data = out[io.logits].data;
        result.logits = Array.from({ length: rows }, (_, r) => Array.from(data.subarray(r * v, (r + 1) * v)));
      }
      if (step.score_ids) {
        const v = this.vocabSize, data = out[io.logits].data;
        result.scores = rowLogprobs((r) => data.subarray(r * v, (r + 1) * v), step.score_ids);
      }
    }
    for (const t of Object.values(out)) t.dispose?.();
    this.stepMs += performance.now() - started;
    return result;
  }
}
