// Runs one engine step on an onnxruntime-web session: the bridge runtime/backends/web.py calls.
//
// Python sends the step's small arrays (token ids, positions, block tables, sampling rows); the
// KV pool never leaves JS. The reply holds only the top-K candidates (and full logits on request).

import { KvPool } from './kv_pool.js';

const INT64 = ['input_ids', 'position_ids', 'query_index', 'flat_index', 'block_tables', 'logits_index', 'sparse_token_ids'];
const FLOAT = ['temperature', 'repetition_penalty', 'presence_penalty', 'frequency_penalty', 'sparse_token_seen',
  'sparse_token_counts', 'sparse_logit_bias'];

function flatten(value) {
  if (!Array.isArray(value[0])) return { data: value, dims: [value.length] };
  const rows = value.length, cols = rows ? value[0].length : 0;
  const data = new Array(rows * cols);
  for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) data[r * cols + c] = value[r][c];
  return { data, dims: [rows, cols] };
}

export class StepRunner {
  constructor(ort, session, config) {
    this.ort = ort;
    this.session = session;
    this.config = { numLayers: config.num_layers, kvHeads: config.num_kv_heads, headDim: config.head_dim };
    this.vocabSize = config.vocab_size;
    this.pool = null;
    this.steps = 0;
    this.sessionMs = 0; // inside onnxruntime-web's run
    this.stepMs = 0; // the whole bridge call: feeds, run, KV write, reply
  }

  timings() {
    return { steps: this.steps, session_ms: this.sessionMs, bridge_ms: this.stepMs, kv_pool_bytes: this.pool?.bytes ?? 0 };
  }

  allocate(numBlocks, blockSize) {
    this.pool = new KvPool(this.config, numBlocks, blockSize);
  }

  async run(step) {
    const started = performance.now();
    const { ort, pool } = this;
    pool.ensure(step.blocks_needed);
    const feeds = {};
    for (const name of INT64) {
      const { data, dims } = flatten(step[name]);
      feeds[name] = new ort.Tensor('int64', BigInt64Array.from(data, (x) => BigInt(x)), dims);
    }
    for (const name of FLOAT) {
      const { data, dims } = flatten(step[name]);
      feeds[name] = new ort.Tensor('float32', Float32Array.from(data), dims);
    }
    feeds.top_k = new ort.Tensor('int64', BigInt64Array.from([BigInt(step.top_k)]), [1]);
    const dims = pool.dims;
    for (let l = 0; l < this.config.numLayers; l++) {
      feeds[`past.${l}.key`] = new ort.Tensor('float32', pool.keys[l], dims);
      feeds[`past.${l}.value`] = new ort.Tensor('float32', pool.values[l], dims);
    }
    const rows = step.logits_index.length;
    const fetches = ['present.key', 'present.value'];
    if (rows) fetches.push('topk_ids', 'topk_logprobs');
    if (rows && step.want_logits) fetches.push('logits');
    const t0 = performance.now();
    const out = await this.session.run(feeds, fetches);
    this.sessionMs += performance.now() - t0;
    pool.write(out['present.key'].data, out['present.value'].data, step.kv_slots);
    this.steps++;
    const result = { topk_ids: [], topk_logprobs: [] };
    if (rows) {
      const k = out.topk_ids.dims[1];
      const ids = out.topk_ids.data, lps = out.topk_logprobs.data;
      for (let r = 0; r < rows; r++) {
        result.topk_ids.push(Array.from(ids.subarray(r * k, (r + 1) * k), Number));
        result.topk_logprobs.push(Array.from(lps.subarray(r * k, (r + 1) * k)));
      }
      if (step.want_logits) {
        const v = this.vocabSize, data = out.logits.data;
        result.logits = Array.from({ length: rows }, (_, r) => Array.from(data.subarray(r * v, (r + 1) * v)));
      }
    }
    for (const t of Object.values(out)) t.dispose?.();
    this.stepMs += performance.now() - started;
    return result;
  }
}
