// What step.mjs (Node) and page.html (Chromium) both run: step.wasm over export.py's output, the prompt
// token by token against the native engine's logits, then the greedy continuation, timed (one thread).
export async function runStep({ manifest, weights, wasm, logits }) {
  const { instance } = await WebAssembly.instantiate(wasm, {});
  const k = instance.exports;
  const cfg = manifest.config;

  const ptr = {};
  for (const a of manifest.arrays) {
    const p = k.arena(a.bytes);
    if (!p) throw new Error(`out of memory at ${a.name}`);
    new Uint8Array(k.memory.buffer, p, a.bytes).set(weights.subarray(a.offset, a.offset + a.bytes));
    ptr[a.name] = p;
  }
  const cache = cfg.layers * cfg.kv_heads * cfg.ctx * cfg.head_dim * 4;
  const kcache = k.arena(cache), vcache = k.arena(cache);
  const layers = k.arena(cfg.layers * 23 * 4), model = k.arena(16 * 4);
  {
    const w = new Int32Array(k.memory.buffer, layers, cfg.layers * 23);
    for (let l = 0; l < cfg.layers; l++) {
      const row = [ptr[`${l}.attn_norm`]];
      for (const p of ["q", "k", "v", "o"]) row.push(ptr[`${l}.${p}.w`], ptr[`${l}.${p}.d`], ptr[`${l}.${p}.m`]);
      row.push(ptr[`${l}.ffn_norm`]);
      for (const p of ["gate", "up", "down"]) row.push(ptr[`${l}.${p}.w`], ptr[`${l}.${p}.d`], ptr[`${l}.${p}.m`]);
      w.set(row, l * 23);
    }
    const m = new Int32Array(k.memory.buffer, model, 16);
    m.set([cfg.dim, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab, cfg.ctx]);
    new Float32Array(k.memory.buffer, model + 32, 1)[0] = cfg.eps;
    m.set([ptr.embd, ptr.embd_d, ptr.out_norm, ptr.rope, kcache, vcache, layers], 9);
  }
  if (!k.model_init(model)) throw new Error("model_init: out of memory");

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
    out = new Float32Array(k.memory.buffer, k.step(model, ids[p], p), cfg.vocab);
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
    out = new Float32Array(k.memory.buffer, k.step(model, token, ids.length + i), cfg.vocab);
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
