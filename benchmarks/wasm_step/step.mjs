// Runs step.wasm (wasm/step/step.c) over export.py's output in Node (step_lib.mjs), one thread.
//   node --experimental-wasm-relaxed-simd --no-liftoff step.mjs OUT_DIR
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { runStep } from "./step_lib.mjs";

const dir = process.argv[2];
const file = (name) => readFileSync(join(dir, name));
const result = await runStep({
  manifest: JSON.parse(file("manifest.json").toString("utf8")), weights: file("step.bin"),
  wasm: file("step.wasm"), logits: file("logits.bin").buffer.slice(0),
});
console.log(JSON.stringify({ engine: `node ${process.version}`, ...result }));
