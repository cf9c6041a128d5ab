// The model's own Web Worker: fetches and verifies the package, opens it in onnxruntime-web and runs
// steps for the engine worker (worker.js) next door. Two workers let the model's session creation
// (weights expanded to fp32) and Pyodide's boot run at the same time on two cores; a step then costs
// one small message each way, and the KV pool never leaves this worker.

import { STEP } from './formats.js';
import { byteSource, fillStep, keepPackage } from './gguf_source.js';
import { loadPackage, pageGraph, readManifest, sha256Hex, streamFile } from './model_store.js';
import { promptKVName, readPromptKV, fits, writePromptKV } from './prompt_kv.js';
import { StepRunner, inputSpec, makeTensor } from './step_runner.js';
import { PageLearner } from './step_trainer.js';
import { STEP_FORMAT, TOKENS_PER_STEP, WasmStepRunner } from './wasm_step.js';

let runner = null;
let opened = null; // { ort, manifest, model, device }: what opening the LoRA graph needs
let opening = null; // the 'open' in flight: allocate and run wait for it
let allocationError = null; // the KV pool's allocation failed (no caller waits on it): every step throws it
let learner = null; // the page's users' trainer (step_trainer.js), made at the first feedback
let promptKV = null; // { name, saved: Promise<{keys, data} | null> }: the last prompt's blocks (prompt_kv.js)
let ggufFiles = null; // deferred: a GGUF's tokenizer.json and final manifest (worker.js makes them as step.bin fills)
const post = (msg, transfer = []) => self.postMessage(msg, transfer);

function nested(config) {
  // {"session.disable_quant_qdq": "1"} -> {session: {disable_quant_qdq: "1"}}, as onnxruntime-web's `extra` wants
  const out = {};
  for (const [key, value] of Object.entries(config || {})) {
    const parts = key.split('.');
    let at = out;
    for (const p of parts.slice(0, -1)) at = at[p] ??= {};
    at[parts.at(-1)] = String(value);
  }
  return out;
}

async function chooseDevice(wanted, kvDtype) {
  if (wanted === 'wasm') return 'wasm';
  if (kvDtype === 'int8' || kvDtype === 'int4') { // quantized pools live in WASM memory (the step's, or the int8-KV graph's)
    if (wanted === 'webgpu') throw new Error(`kvDtype "${kvDtype}" runs on the "wasm" device, not "webgpu"`);
    return 'wasm';
  }
  const adapter = self.navigator?.gpu ? await self.navigator.gpu.requestAdapter().catch(() => null) : null;
  // 'auto' passes over a software adapter (SwiftShader: a CPU behind the WebGPU API, far slower than WASM)
  const software = adapter && (adapter.info?.isFallbackAdapter ?? adapter.isFallbackAdapter);
  if (adapter && (wanted === 'webgpu' || !software)) return 'webgpu';
  if (wanted === 'webgpu') throw new Error('device "webgpu" was asked for, but this browser has no WebGPU adapter');
  return 'wasm';
}

// A one-node ONNX model (Identity): opening it starts onnxruntime-web (fetch and compile its WASM,
// start its threads) while the package is still being read, instead of inside the real session's creation.
const RUNTIME_PROBE = Uint8Array.from(atob(
  'CAgSADo6ChAKAXgSAXkiCElkZW50aXR5EgR3YXJtWg8KAXgSCgoICAESBAoCCAFiDwoBeRIKCggIARIECgIIAUIECgAQDQ=='), (c) => c.charCodeAt(0));

async function startRuntime(ortURL, device, threads) {
  const ort = await import(new URL(device === 'webgpu' ? 'ort.webgpu.min.mjs' : 'ort.wasm.min.mjs', ortURL).href);
  ort.env.wasm.wasmPaths = ortURL;
  ort.env.wasm.numThreads = threads;
  ort.env.logLevel = 'error';
  const probe = await ort.InferenceSession.create(RUNTIME_PROBE, { executionProviders: [device] });
  await probe.release();
  return ort;
}

const isGraphFile = (name) => name.endsWith('.onnx') || name.endsWith('.data');
// wasm32's memory (4 GB less a page), and what the step needs beside its weights: scratch, a KV pool
const WASM32_BYTES = 65535 * 65536;
const STEP_ROOM = 256 << 20;
// the WASM step's weights and their index (manifest.wasm_step: exporter/step_weights.py), in the layout
// this step reads (an older export's are another: the page then runs onnxruntime-web)
const hasStep = (manifest) => manifest.wasm_step?.format === STEP_FORMAT;
const stepFiles = (manifest) => (manifest.wasm_step ? [manifest.wasm_step.weights, manifest.wasm_step.index] : []);
// files Python never reads: onnxruntime-web's or the WASM step's
const modelFiles = (manifest) => [...Object.keys(manifest.files).filter(isGraphFile), ...stepFiles(manifest)];

// A tiny decoder in the browser package format (wasm/warmup.py, beside this file in the bundle):
// its steps run the model's own kernels while the package is still downloading, so that V8 has
// tiered up onnxruntime-web's hot WASM functions before the first generation instead of during it
// (a first visit's first ~60 steps ran 1.3-2.5x slower). Only while bytes come from the network: a
// reload reads the package from storage in well under a second and V8 has cached its optimized code.
// warmup.json holds its I/O spec and its steps' inputs, written by the Python that builds real steps.
// Optional: without the files, no warm-up.
const WARMUP_URL = new URL('./warmup.onnx', import.meta.url);
const WARMUP_STEPS_URL = new URL('./warmup.json', import.meta.url);
const WARMUP_MAX_STEPS = 600; // ~0.8 s: enough for the tier-up (Node), no longer competing with the download
const WARMUP_MAX_MS = 2000;

function warmupFeeds(ort, spec, roles, { feeds: values, pool_dims: dims }, inputs) {
  const feeds = {};
  for (const [name, value] of Object.entries(values)) feeds[name] = makeTensor(ort, spec, name, value);
  const zeros = new Float32Array(dims.reduce((a, b) => a * b, 1));
  for (const name of [...roles.past_keys, ...roles.past_values]) feeds[name] = new ort.Tensor('float32', zeros, dims);
  const mask = inputs.find((i) => i.name === roles.logits_mask); // structured output's mask: none constrained
  if (mask && !feeds[mask.name]) feeds[mask.name] = new ort.Tensor('float32', new Float32Array(mask.shape[1]), [1, mask.shape[1]]);
  return feeds;
}

/** Run the warm-up model until stop.requested (or a time cap); resolves to the steps run. */
async function warmUp(ort, stop) {
  const get = (url, as) => fetch(url).then((r) => (r.ok ? r[as]() : null)).catch(() => null);
  const [bytes, plan] = await Promise.all([get(WARMUP_URL, 'arrayBuffer'), get(WARMUP_STEPS_URL, 'json')]);
  if (!bytes || !plan || stop.requested) return 0;
  const session = await ort.InferenceSession.create(new Uint8Array(bytes), {
    executionProviders: ['wasm'], graphOptimizationLevel: 'basic', logSeverityLevel: 3,
    extra: { session: { disable_quant_qdq: '1' } },
  });
  const spec = inputSpec(plan);
  const deadline = performance.now() + WARMUP_MAX_MS;
  let steps = 0;
  try {
    while (!stop.requested && steps < WARMUP_MAX_STEPS && performance.now() < deadline) {
      await session.run(warmupFeeds(ort, spec, plan.io.roles, plan.steps[steps++ % plan.steps.length], plan.io.inputs));
      await new Promise((resolve) => setTimeout(resolve, 0)); // let the download's reads and digests in
    }
  } finally {
    await session.release();
  }
  return steps;
}

// a --target wasm package also holds a graph for WebGPU: onnxruntime-web's WebGPU backend has no kernel
// for the in-place K/V write (TensorScatter) of the main graph, which would run on the CPU there
// and kvDtype 'int8' opens the graph on an int8 pool (exporter: model_kv8.onnx)
const graphKey = (device, kvDtype = 'fp32') => {
  if (kvDtype === 'int8') return 'decoder_kv8';
  if (kvDtype === 'int4') throw new Error('kvDtype "int4" runs on the WASM step only: use backend "wasm-step" (or "auto") on a package with step weights (exported from a GGUF with --target wasm)');
  if (kvDtype !== 'fp32') throw new Error(`kvDtype ${JSON.stringify(kvDtype)}: choose "fp32", "int8" or "int4"`);
  return device === 'webgpu' ? 'decoder_webgpu' : 'decoder';
};

async function createSession(ort, manifest, graph, files, device) {
  const external = Object.keys(files).filter((n) => n.endsWith('.data')).map((n) => ({ path: n, data: files[n] }));
  // on WASM the levels above 'basic' (constant folding, which expands the weights) add only the
  // SiLU -> QuickGelu fusion to our graphs: no faster per step (interleaved A/B in Node), and
  // ~0.25 s more session creation, which is on the cached load's critical path
  return ort.InferenceSession.create(files[graph], {
    executionProviders: [device], graphOptimizationLevel: device === 'wasm' ? 'basic' : 'all',
    externalData: external, logSeverityLevel: 3, extra: nested(manifest.quantization?.session_config),
  });
}

// The package's LoRA graph for the device (on WebGPU, its blocks kept as the base graph's are), read from
// storage (or fetched) like the rest, with the same weights file
async function openLoraGraph() {
  const { ort, model, device } = opened;
  const key = device === 'webgpu' ? 'decoder_webgpu_lora' : 'decoder_lora';
  const { manifest, files } = await loadPackage(model, () => {}, { graph: key });
  if (!manifest.graphs[key]) {
    throw new Error(device === 'webgpu' && manifest.graphs.decoder_lora
      ? 'this model package has no LoRA graph for WebGPU (model_webgpu_lora.onnx): re-export it, or use device "wasm"'
      : 'this model package has no LoRA graph');
  }
  return createSession(ort, manifest, manifest.graphs[key].file, files, device);
}

function deferred() {
  const out = {};
  out.promise = new Promise((resolve, reject) => Object.assign(out, { resolve, reject }));
  return out;
}

// backend 'wasm-step': the package's own WASM step (wasm_step.js) runs the steps, no onnxruntime-web;
// only its weights are fetched (not the graphs'). With `threads` > 1 in a cross-origin isolated page, the
// threaded build and its helper workers (step_helper.js); fp32 KV (kept across loads as onnxruntime's
// is), LoRA adapters on the step, no X-LoRA yet.
async function openWasmStep({ model, device, kvDtype = 'fp32', threads, gguf }) {
  const t0 = performance.now();
  if (device === 'webgpu') throw new Error('backend "wasm-step" runs on the CPU: use device "wasm" or "auto"');
  if (!STEP.kvDtypes.includes(kvDtype)) throw new Error(`kvDtype ${JSON.stringify(kvDtype)}: the WASM step keeps "${STEP.kvDtypes.join('", "')}"`);
  const bytes = (name) => {
    const got = fetch(new URL(`./${name}`, import.meta.url)).then((r) => {
      if (!r.ok) throw new Error(`${name}: HTTP ${r.status}`);
      return r.arrayBuffer();
    });
    got.catch(() => {});
    return got;
  };
  const threaded = threads > 1 && self.crossOriginIsolated;
  const wasm = threaded ? null : bytes('step.wasm'); // else fetched only if the threaded build does not compile
  const threadedWasm = threaded ? bytes('step-threads.wasm') : null;
  // a GGUF not seen before: the package's small files come from its header (worker.js), step.bin from its ranges
  const encoded = gguf && Object.fromEntries(Object.entries(gguf.files).map(([n, text]) => [n, new TextEncoder().encode(text)]));
  const early = gguf ? JSON.parse(gguf.files['manifest.json']) : await readManifest(model);
  const stepMeta = early.wasm_step && early.files[early.wasm_step.weights];
  if (stepMeta && Number(stepMeta.size) + STEP_ROOM > WASM32_BYTES) { // before anything is downloaded
    const gb = (n) => `${(n / 2 ** 30).toFixed(1)} GB`;
    throw new Error(`this model's WASM step needs ${gb(Number(stepMeta.size) + STEP_ROOM)} of memory (${gb(Number(stepMeta.size))} of weights and room for its KV cache); a page's WebAssembly memory holds at most ${gb(WASM32_BYTES)} (wasm32): choose a smaller model or a smaller quantization`);
  }
  // the step's weights stream into the module's memory below (chunk by chunk, checked as they come) where
  // the manifest has each chunk's sha256; else they come whole with the other files
  const streamed = (m) => Boolean(m.wasm_step && m.files[m.wasm_step.weights]?.chunks);
  const skip = (name, manifest) => (!stepFiles(manifest).includes(name) && isGraphFile(name))
    || (streamed(manifest) && name === manifest.wasm_step.weights);
  const progress = (p) => post({ type: 'progress', progress: p });
  let { manifest, files, stats } = gguf ? { manifest: early, stats: { fromCache: 0, downloaded: 0, refetched: 0, gguf: true },
    files: Object.fromEntries(Object.entries(encoded).map(([n, b]) => [n, b.slice()])) } : await loadPackage(model, progress, { skip });
  if (!manifest.wasm_step) throw new Error('backend "wasm-step": this model package has no WASM step weights (step.bin); re-export it from a GGUF with --target wasm');
  if (!hasStep(manifest)) throw new Error(`backend "wasm-step": this model package's step weights are an older layout (format ${manifest.wasm_step.format ?? 1}; this page reads ${STEP_FORMAT}); re-export it with --target wasm`);
  const big = modelFiles(manifest);
  const small = Object.fromEntries(Object.entries(files).filter(([n]) => !big.includes(n)));
  post({ type: 'files', manifest, files: small, graphFiles: big, cache: stats, device: 'wasm', backend: 'wasm-step', fetchSeconds: (performance.now() - t0) / 1000 },
    Object.values(small).map((b) => b.buffer));
  const index = JSON.parse(new TextDecoder().decode(files[manifest.wasm_step.index]));
  const name = manifest.wasm_step.weights, meta = manifest.files[name];
  let weights = files[name];
  if (gguf) {
    const source = await byteSource(gguf.source, gguf.sizes);
    weights = (view, repack) => fillStep(source, gguf.plan, view, repack, (loaded, total) => progress({ stage: 'model', loaded, total,
      file: source.name, cached: false }));
  } else if (streamed(manifest)) {
    weights = async (view) => {
      let loaded = 0;
      const got = await streamFile(model, name, meta, view, (n, cached) => {
        loaded += n;
        progress({ stage: 'model', loaded, total: Number(meta.size), file: name, cached });
      });
      stats[got.cached ? 'fromCache' : 'downloaded']++;
      if (got.refetched) stats.refetched++;
      stats.weightsMs = got.ms;
    };
  }
  post({ type: 'progress', progress: { stage: 'session', message: 'preparing the model' } });
  const placing = performance.now();
  runner = await WasmStepRunner.create(wasm ?? (() => bytes('step.wasm')), index, weights, manifest, {
    fallback: () => bytes('step-simd128.wasm'), threads: threaded ? threads : 1, threaded: threaded && (() => threadedWasm),
    spawnHelper: () => new Worker(new URL('./step_helper.js', import.meta.url), { type: 'module' }),
  });
  const placed = performance.now();
  stats.placedSeconds = (placed - placing) / 1000; // the weights in the step's memory (a GGUF's: read and repacked)
  if (gguf) { // kept for the next load (step.bin's pieces' digests complete its manifest entry), with the
    // tokenizer the engine worker makes meanwhile, and the manifest listing it
    const rest = ggufFiles.promise.then((late) => ({ manifest: late.manifest, files: { ...encoded, ...late.files } }));
    const { base, size } = runner.weights;
    manifest = await keepPackage(gguf.packageURL, manifest, size, (at, n) => runner.u8(base + at, n).slice(), rest);
    stats.downloaded = 1;
    stats.keptSeconds = (performance.now() - placed) / 1000;
  }
  // the last prompt's K/V across loads: named by the weights and the build that computed them
  const kvName = sha256Hex(new Uint8Array(runner.moduleBytes))
    .then((build) => promptKVName(manifest, [manifest.wasm_step.weights, build], 'wasm-step'));
  promptKV = { name: kvName, saved: kvName.then(readPromptKV).catch(() => null) };
  return { device: 'wasm', threads: runner.threads, graph: manifest.wasm_step.weights, cache: stats, warmupSteps: 0,
    sessionSeconds: (performance.now() - t0) / 1000 };
}

// backend 'auto' (the default): the package's own WASM step where the package carries one and it would
// run on the CPU (no GPU adapter, device 'wasm', or a quantized KV cache); else onnxruntime-web
async function chooseBackend({ model, device, kvDtype }) {
  const manifest = await readManifest(model);
  if (hasStep(manifest) && !Object.keys(manifest.graphs).length) return 'wasm-step'; // a GGUF the page opened: no graphs
  if (!hasStep(manifest) || device === 'webgpu') return 'onnxruntime';
  return (await chooseDevice(device, kvDtype)) === 'wasm' ? 'wasm-step' : 'onnxruntime';
}

async function open(options) {
  const backend = options.backend === 'auto' ? await chooseBackend(options) : options.backend;
  if (backend === 'wasm-step') return { backend, ...await openWasmStep(options) };
  if (backend !== 'onnxruntime') throw new Error(`backend ${JSON.stringify(backend)}: choose "auto", "onnxruntime" or "wasm-step"`);
  const manifest = await readManifest(options.model);
  if (!manifest.graphs.decoder) {
    throw new Error('this model package has no onnxruntime-web graphs (a GGUF the page opened runs on its WASM step): use '
      + 'backend "wasm-step" (or "auto"), or export the GGUF with `python -m exporter convert FILE --target wasm`');
  }
  if (manifest.wasm_step?.only) { // a large GGUF's page package: native graphs and the step
    throw new Error('this model package runs in the page on its WASM step only (its graphs are the native engine\'s, '
      + 'with RuvLLM\'s CPU kernels): use backend "wasm-step" (or "auto") with device "wasm"');
  }
  if (manifest.target === 'cpu' && manifest.quantization?.weights === 'int4') { // ruvllm.MatMulQ4's layouts
    throw new Error('this model package was exported for native CPUs (--target cpu): its int4 weights are in RuvLLM\'s '
      + 'CPU kernels\' layout, which onnxruntime-web has no kernel for; export it with --target wasm for the page');
  }
  return { backend, ...await openOnnxruntime(options) };
}

async function openOnnxruntime({ model, ortURL, device: wanted, threads, kvDtype = 'fp32' }) {
  const t0 = performance.now();
  const device = await chooseDevice(wanted, kvDtype);
  const key = graphKey(device, kvDtype);
  const runtime = startRuntime(ortURL, device, threads);
  runtime.catch(() => {}); // awaited below; a failure surfaces there
  const stopWarmup = { requested: false };
  let warmup = null;
  const onProgress = (progress) => {
    if (!warmup && device === 'wasm' && progress.cached === false) { // bytes from the network: warm up meanwhile
      warmup = runtime.then((ort) => warmUp(ort, stopWarmup)).catch(() => 0);
    }
    post({ type: 'progress', progress });
  };
  // stored graph files are checked (sha256) while the session is being built from them
  let loaded;
  try {
    loaded = await loadPackage(model, onProgress, { deferCheck: isGraphFile, graph: key,
      skip: (name, manifest) => stepFiles(manifest).includes(name) });
  } finally {
    stopWarmup.requested = true;
  }
  let { manifest, files, stats, checked } = loaded;
  const warmupSteps = await (warmup ?? 0); // at most one tiny step more: the real session has the cores to itself
  const graph = manifest.graphs[pageGraph(manifest, key)].file;
  // graphs and weights stay here (or were never fetched: the LoRA variant); the rest goes to Python
  const graphFiles = modelFiles(manifest);
  const kvName = promptKVName(manifest, [graph, ...graphFiles.filter((n) => n.endsWith('.data'))], device);
  promptKV = { name: kvName, saved: kvName.then(readPromptKV).catch(() => null) }; // read while the session builds
  const small = Object.fromEntries(Object.entries(files).filter(([n]) => !graphFiles.includes(n)));
  post({ type: 'files', manifest, files: small, graphFiles, cache: stats, device, backend: 'onnxruntime', fetchSeconds: (performance.now() - t0) / 1000 },
    Object.values(small).map((b) => b.buffer));

  post({ type: 'progress', progress: { stage: 'session', message: 'preparing the model' } });
  const ort = await runtime;
  const graphs = Object.fromEntries(Object.entries(files).filter(([n]) => graphFiles.includes(n)));
  let session = await createSession(ort, manifest, graph, graphs, device).catch((err) => ({ err }));
  const corrupt = await checked;
  if (corrupt.length) { // a stored graph file failed its check (and was deleted): fetch it again, start over
    await session.release?.();
    ({ manifest, files, stats } = await loadPackage(model, onProgress, { graph: key, skip: (name, m) => stepFiles(m).includes(name) }));
    stats = { ...stats, refetched: corrupt.length };
    session = await createSession(ort, manifest, graph, files, device);
  } else if (session.err) {
    throw session.err;
  }
  files = null; // onnxruntime-web holds its own copy now
  runner = new StepRunner(ort, session, manifest);
  opened = { ort, model, device };
  return { device, threads, graph, cache: stats, warmupSteps, sessionSeconds: (performance.now() - t0) / 1000 };
}

self.onmessage = async ({ data }) => {
  const { type, id } = data;
  try {
    if (type === 'open') {
      ggufFiles = deferred();
      ggufFiles.promise.catch(() => {});
      opening = open(data.options);
      post({ type: 'opened', id, ...(await opening) });
    } else if (type === 'allocate') {
      await opening;
      runner.allocate(data.numBlocks, data.blockSize, data.io);
    } else if (type === 'enableLora') {
      await opening;
      runner.enableLora(data.spec, openLoraGraph); // the LoRA graph, or the step's own adapters
    } else if (type === 'setAdapter') {
      await opening;
      if (!runner.loraError) runner.lora.set(data.meta, data.bytes); // else the next step with adapters says why
    } else if (type === 'setClassifier') {
      await opening;
      if (!runner.loraError) runner.lora.setClassifier(data.xlora, data.layers, data.blobs);
    } else if (type === 'run') {
      await opening;
      if (allocationError) throw allocationError;
      post({ type: 'result', id, result: await runner.run(data.step) });
    }
    else if (type === 'ggufFiles') { // the rest of a GGUF's package (worker.js), or why it could not be made
      if (data.error) ggufFiles.reject(new Error(data.error));
      else ggufFiles.resolve({ manifest: data.manifest, files: data.files });
    }
    else if (type === 'timings') post({ type: 'timings', id, timings: runner?.timings() ?? null });
    else if (type === 'learnOpen' || type === 'learnFeedback' || type === 'learnForget') { // per-user adaptation
      await opening;
      learner ??= new PageLearner(runner, TOKENS_PER_STEP); // on the WASM step only; its steps' scratch bounds a step
      if (type === 'learnOpen') post({ type: 'learnOpened', id, room: learner.room, ...(await learner.open(data.store, data.spec)) });
      else if (type === 'learnFeedback') post({ type: 'learned', id, ...(await learner.feedback(data.store, data.spec, data.job)) });
      else post({ type: 'learnForgot', id, deleted: await learner.forget(data.store) });
    }
    else if (type === 'promptKVKeys') { // the saved prompt blocks' keys, if they fit this pool
      await opening;
      const saved = await promptKV?.saved;
      post({ type: 'promptKVKeys', id, keys: saved && runner.pool?.dtype === 'fp32' && fits(saved, runner.pool) ? saved.keys : [] });
    } else if (type === 'promptKVRestore') { // the engine parked the first ids.length keys in blocks `ids`
      const saved = await promptKV.saved;
      if (data.ids.length) runner.pool.writeBlocks(data.ids, saved.data);
      promptKV.saved = Promise.resolve(null); // the K/V live in the pool now
      post({ type: 'promptKVRestored', id, blocks: data.ids.length });
    } else if (type === 'promptKVSave') {
      await opening;
      const fp32 = runner.pool.dtype === 'fp32'; // an int8 pool's blocks are not kept across loads (yet)
      const name = await promptKV.name; // none once the steps moved to another backend
      post({ type: 'promptKVSaved', id, ok: fp32 && name !== null && await writePromptKV(name, runner.pool, data.keys, data.ids) });
    }
  } catch (err) {
    if (runner && ['enableLora', 'setAdapter', 'setClassifier'].includes(type)) runner.loraError = err; // no caller waits: the next step throws it
    if (type === 'allocate') allocationError = new Error(`the KV cache could not be allocated: ${err?.message ?? err}`);
    post({ type: 'failed', id, message: String(err?.message ?? err) });
  }
};
