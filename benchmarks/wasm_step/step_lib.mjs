// What step.mjs (Node) and page.html (Chromium) both run: the page's own step runner
// (web/src/wasm_step.js over step.wasm) on export.py's output, the prompt a token a step against the
// native engine's logits, then the greedy continuation (the runner's top-1 candidate), timed per step:
// the model worker's path without the bridge. `threads` > 1: step-threads.wasm with helpers from
// `spawnHelper` (wasm_step.js).
import { WasmStepRunner } from '../../web/src/wasm_step.js';

// the step's inputs by part, named as themselves (the page gets the names from Python's contract)
const PARTS = ['ids', 'positions', 'query_index', 'block_tables', 'logits_index', 'temperature', 'repetition',
  'presence', 'frequency', 'sparse_ids', 'sparse_seen', 'sparse_counts', 'sparse_bias', 'top_k'];

export async function runStep({ manifest, weights, wasm, logits, threads = 1, threaded, spawnHelper }) {
  const cfg = manifest.config;
  const runner = await WasmStepRunner.create(wasm, manifest, weights, { config: { vocab_size: cfg.vocab } },
    { threads, threaded: threaded && (async () => threaded), spawnHelper });
  const bs = 16, blocks = Math.ceil(cfg.max_pos / bs), table = Array.from({ length: blocks }, (_, i) => i);
  const fp32 = { dtype: 'fp32', numbers: [4 * cfg.head_dim, 4 * cfg.head_dim], scales: [0, 0], tail_blocks: 1 };  // web.py's kv_layout
  runner.allocate(blocks, bs, { kv_dtype: 'fp32', kv_layout: fp32, step_feeds: Object.fromEntries(PARTS.map((p) => [p, p])) });
  const one = (v) => [[v], [1]], row = (v) => [[[v]], [1, 1]];
  const step = (token, pos, wantLogits) => runner.run({  // one token at `pos`, its K/V in slot `pos`
    feeds: { ids: one(token), positions: one(pos), query_index: row(0), block_tables: [[table], [1, blocks]],
      logits_index: one(0), temperature: one(1), repetition: one(1), presence: one(0), frequency: one(0),
      sparse_ids: row(0), sparse_seen: row(0), sparse_counts: row(0), sparse_bias: row(0), top_k: one(1) },
    kv_slots: [pos], rows: 1, want_logits: wantLogits,
  });

  const logsoftmax = (v) => {
    let mx = -Infinity;
    for (const x of v) mx = Math.max(mx, x);
    let s = 0;
    for (const x of v) s += Math.exp(x - mx);
    const lse = mx + Math.log(s);
    return Float64Array.from(v, (x) => x - lse);
  };
  const ref = new Float32Array(logits);
  const ids = manifest.prompt_ids;
  let worstKl = 0, meanKl = 0, worstDiff = 0, argmaxSame = 0;
  let res;
  for (let p = 0; p < ids.length; p++) {
    res = await step(ids[p], p, true);
    const out = res.logits[0];
    const want = ref.subarray(p * cfg.vocab, (p + 1) * cfg.vocab);
    const a = logsoftmax(want), b = logsoftmax(out);
    let kl = 0, best = 0, bestRef = 0;
    for (let i = 0; i < cfg.vocab; i++) {
      kl += Math.exp(a[i]) * (a[i] - b[i]);
      worstDiff = Math.max(worstDiff, Math.abs(want[i] - out[i]));
      if (out[i] > out[best]) best = i;
      if (want[i] > want[bestRef]) bestRef = i;
    }
    argmaxSame += best === bestRef;
    worstKl = Math.max(worstKl, kl);
    meanKl += kl / ids.length;
  }
  const got = [];
  let token = res.topk_ids[0][0];
  const times = [];
  for (let i = 0; i < manifest.greedy.length; i++) {
    got.push(token);
    const t = performance.now();
    res = await step(token, ids.length + i, false);
    times.push(performance.now() - t);
    token = res.topk_ids[0][0];
  }
  const firstDiff = got.findIndex((t, i) => t !== manifest.greedy[i]);
  const usedThreads = runner.threads;
  runner.close();
  const sorted = times.slice().sort((a, b) => a - b);
  return ({
    threads: usedThreads, prompt_tokens: ids.length, kl_mean: +meanKl.toExponential(2), kl_max: +worstKl.toExponential(2),
    max_logit_diff: +worstDiff.toFixed(4), argmax_equal: `${argmaxSame}/${ids.length}`,
    greedy_equal_tokens: firstDiff < 0 ? got.length : firstDiff, greedy_tokens: got.length,
    step_ms_median: +sorted[sorted.length >> 1].toFixed(2), decode_tok_s: +(1000 / sorted[sorted.length >> 1]).toFixed(1),
  });
}
