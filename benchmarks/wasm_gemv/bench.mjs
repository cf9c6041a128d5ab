// Times gemv.wasm's one-row projections per SmolLM2 shape, single-threaded, and checks each against a
// float64 reference on the same rounded activations and weights.
//   node --experimental-wasm-relaxed-simd bench.mjs gemv.wasm [reps]
import { readFileSync } from "node:fs";

const [wasmPath, repsArg] = process.argv.slice(2);
const reps = Number(repsArg || 200);
const { instance } = await WebAssembly.instantiate(readFileSync(wasmPath), {});
const k = instance.exports;
const mem = () => k.memory.buffer;
k.arena(64 << 20);  // grow the memory once: views made before a later growth would be detached
k.arena_reset();
const SHAPES = [["q/o", 576, 576], ["k/v", 576, 192], ["gate/up", 576, 1536], ["down", 1536, 576], ["head", 576, 49152]];

let seed = 1;
const rand = () => ((seed = (seed * 1103515245 + 12345) >>> 0) / 4294967296) * 2 - 1;
const alloc = (Type, n) => {
  const p = k.arena(n * Type.BYTES_PER_ELEMENT);
  if (!p) throw new Error("arena full");
  return [p, new Type(mem(), p, n)];
};
const median = (a) => a.slice().sort((x, y) => x - y)[a.length >> 1];

const results = [];
for (const [name, K, N] of SHAPES) {
  const blocks = K / 32;
  for (const route of ["q8", "q4", "q4_relaxed", "q4x4"]) {
    k.arena_reset();
    const [px, x] = alloc(Float32Array, K);
    const [pxq, xq] = alloc(Int8Array, K);
    const [pxs, xs] = alloc(Float32Array, blocks);
    const [pxsum, xsum] = alloc(Float32Array, blocks);
    const [py, y] = alloc(Float32Array, N);
    const [pws, ws] = alloc(Float32Array, N * blocks);
    const [pwm, wm] = alloc(Float32Array, N * blocks);
    for (let i = 0; i < K; i++) x[i] = rand();
    for (let i = 0; i < N * blocks; i++) { ws[i] = 0.002 + 0.001 * rand(); wm[i] = -0.01 * Math.abs(rand()); }
    const q8 = route === "q8";
    const [pw, w] = q8 ? alloc(Int8Array, N * K) : alloc(Uint8Array, (N * K) / 2);
    for (let i = 0; i < w.length; i++) w[i] = q8 ? Math.round(rand() * 127) : Math.floor((rand() + 1) * 128) & 255;
    const call = () => {
      k.quantize_x(px, K, pxq, pxs, pxsum);
      if (q8) k.gemv_q8(pxq, pxs, K, pw, pws, N, py);
      else ({ q4: k.gemv_q4, q4_relaxed: k.gemv_q4_relaxed, q4x4: k.gemv_q4x4 })[route](pxq, pxs, pxsum, K, pw, pws, pwm, N, py);
    };
    call();
    // reference: the rounded activations against the weights they stand for, in float64
    let err = 0, mag = 0;
    for (let n = 0; n < N; n++) {
      let ref = 0;
      for (let b = 0; b < blocks; b++) {
        let dot = 0, sum = 0;
        for (let i = 0; i < 32; i++) {
          const xi = xq[32 * b + i];
          let wi;
          if (q8) wi = w[n * K + 32 * b + i];
          else { const byte = w[n * (K / 2) + 16 * b + (i & 15)]; wi = i < 16 ? byte & 15 : byte >> 4; }
          dot += xi * wi;
          sum += xi;
        }
        const at = route === "q4x4" ? (n - (n % 4)) * blocks + 4 * b + (n % 4) : n * blocks + b;  // [N/4, blocks, 4]
        ref += dot * xs[b] * ws[at] + (q8 ? 0 : wm[at] * xs[b] * sum);
      }
      err = Math.max(err, Math.abs(y[n] - ref));
      mag = Math.max(mag, Math.abs(ref));
    }
    const times = [];
    const inner = Math.max(1, Math.floor(2e6 / (K * N)));
    for (let r = 0; r < reps; r++) {
      const t = performance.now();
      for (let i = 0; i < inner; i++) call();
      times.push((performance.now() - t) / inner);
    }
    const ms = median(times);
    results.push({ shape: name, K, N, route, ms: +ms.toFixed(4), gmacs: +((K * N) / ms / 1e6).toFixed(2),
                   weight_mb: +((w.byteLength + 4 * (q8 ? 1 : 2) * N * blocks) / 1e6).toFixed(2),
                   rel_err: +(err / mag).toExponential(2) });
  }
}
console.log(JSON.stringify(results));
