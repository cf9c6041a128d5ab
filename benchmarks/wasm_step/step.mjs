// Runs step.wasm (wasm/step/step.c) over export.py's output in Node (step_lib.mjs); with a thread count
// above 1, step-threads.wasm with that many threads (helpers in worker_threads).
//   node --experimental-wasm-relaxed-simd --no-liftoff step.mjs OUT_DIR [THREADS]
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { Worker } from "node:worker_threads";
import { runStep } from "./step_lib.mjs";

const dir = process.argv[2], threads = Number(process.argv[3] ?? 1);
const file = (name) => readFileSync(join(dir, name));
const helper = new URL("../../web/src/step_helper.js", import.meta.url);
const result = await runStep({
  manifest: JSON.parse(file("manifest.json").toString("utf8")), weights: file("step.bin"),
  wasm: file("step.wasm"), logits: file("logits.bin").buffer.slice(0),
  threads, threaded: threads > 1 ? file("step-threads.wasm") : null,
  spawnHelper: () => new Worker(helper), // V8 flags (relaxed SIMD, no Liftoff) are the process's
});
console.log(JSON.stringify({ engine: `node ${process.version}`, ...result }));
