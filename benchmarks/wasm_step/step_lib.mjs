// What step.mjs (Node) and page.html (Chromium) both run: step.wasm (wasm/step/step.c) over export.py's
// output, the prompt a token a step against the native engine's logits, then the greedy continuation,
// timed (one thread). Structs are wasm32: 4-byte ints, floats and pointers, in step.c's order.
export async function runStep({ manifest, weights, wasm, logits }) {
  const { instance } = await WebAssembly.instantiate(wasm, {});
  const k = instance.exports;
  const cfg = manifest.config;
  const alloc = (bytes) => {
    const p = k.arena(bytes);
    if (!p) throw new Error(`out of memory for ${bytes} bytes`);
    return p;
  };
  const ints = (p, n) => new Int32Array(k.memory.buffer, p, n);  // a fresh view: memory may have grown

  const ptr = {};
  for (const a of manifest.arrays) {
    ptr[a.name] = alloc(a.bytes);
    new Uint8Array(k.memory.buffer, ptr[a.name], a.bytes).set(weights.subarray(a.offset, a.offset + a.bytes));
  }
  const layers = alloc(cfg.layers * 23 * 4), model = alloc(14 * 4);
  for (let l = 0; l < cfg.layers; l++) {
    const row = [ptr[`${l}.attn_norm`]];
    for (const p of ["q", "k", "v", "o"]) row.push(ptr[`${l}.${p}.w`], ptr[`${l}.${p}.d`], ptr[`${l}.${p}.m`]);
    row.push(ptr[`${l}.ffn_norm`]);
    for (const p of ["gate", "up", "down"]) row.push(ptr[`${l}.${p}.w`], ptr[`${l}.${p}.d`], ptr[`${l}.${p}.m`]);
    ints(layers + l * 23 * 4, 23).set(row);
  }
  ints(model, 8).set([cfg.dim, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab, cfg.max_pos]);
  new Float32Array(k.memory.buffer, model + 32, 1)[0] = cfg.eps;
  ints(model + 36, 5).set([ptr.embd, ptr.embd_d, ptr.out_norm, ptr.rope, layers]);
  // the KV pool: blocks of 16 covering max_pos, in table order; one-token steps
  const bs = 16, blocks = Math.ceil(cfg.max_pos / bs);
  const poolBytes = cfg.layers * cfg.kv_heads * blocks * bs * cfg.head_dim * 4;
  const pool = alloc(16), poolK = alloc(poolBytes), poolV = alloc(poolBytes);
  ints(pool, 4).set([blocks, bs, poolK, poolV]);
  if (k.step_init(model, 1) !== 1) throw new Error("step_init: out of memory");
  const tok = alloc(4 * 6), table = alloc(4 * blocks), row = alloc(4 * cfg.vocab), batch = alloc(12 * 4);
  ints(table, blocks).set(Array.from({ length: blocks }, (_, i) => i));
  const step = (token, pos) => {  // ids, pos, slots, row_first, row_count, logits_at
    ints(tok, 6).set([token, pos, pos, 0, 1, 0]);
    ints(batch, 12).set([1, 1, blocks, 1, tok, tok + 4, tok + 8, tok + 12, tok + 16, table, tok + 20, row]);
    const status = k.step_run(model, pool, batch);
    if (status) throw new Error(`step_run: ${status}`);
    return new Float32Array(k.memory.buffer, row, cfg.vocab);
  };

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
  let out;
  for (let p = 0; p < ids.length; p++) {
    out = step(ids[p], p);
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
  const argmax = (v) => { let b = 0; for (let i = 1; i < v.length; i++) if (v[i] > v[b]) b = i; return b; };
  const got = [];
  let token = argmax(out);
  const times = [];
  for (let i = 0; i < manifest.greedy.length; i++) {
    got.push(token);
    const t = performance.now();
    out = step(token, ids.length + i);
    times.push(performance.now() - t);
    token = argmax(out);
  }
  const firstDiff = got.findIndex((t, i) => t !== manifest.greedy[i]);
  const sorted = times.slice().sort((a, b) => a - b);
  return ({
    prompt_tokens: ids.length, kl_mean: +meanKl.toExponential(2), kl_max: +worstKl.toExponential(2),
    max_logit_diff: +worstDiff.toFixed(4), argmax_equal: `${argmaxSame}/${ids.length}`,
    greedy_equal_tokens: firstDiff < 0 ? got.length : firstDiff, greedy_tokens: got.length,
    step_ms_median: +sorted[sorted.length >> 1].toFixed(2), decode_tok_s: +(1000 / sorted[sorted.length >> 1]).toFixed(1),
  });
}
