// The model's own Web Worker: fetches and verifies the package, opens it in onnxruntime-web and runs
// steps for the engine worker (worker.js) next door. Two workers let the model's session creation
// (weights expanded to fp32) and Pyodide's boot run at the same time on two cores; a step then costs
// one small message each way, and the KV pool never leaves this worker.

import { loadPackage } from './model_store.js';
import { StepRunner } from './step_runner.js';

let runner = null;
let opening = null; // the 'open' in flight: allocate and run wait for it
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

async function chooseDevice(wanted) {
  if (wanted === 'wasm') return 'wasm';
  const adapter = self.navigator?.gpu ? await self.navigator.gpu.requestAdapter().catch(() => null) : null;
  if (adapter) return 'webgpu';
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

async function createSession(ort, manifest, files, device) {
  const graph = manifest.graphs.decoder.file;
  const external = Object.keys(files).filter((n) => n.endsWith('.data')).map((n) => ({ path: n, data: files[n] }));
  // on WASM the levels above 'basic' (constant folding, which expands the weights) add only the
  // SiLU -> QuickGelu fusion to our graphs: no faster per step (interleaved A/B in Node), and
  // ~0.25 s more session creation, which is on the cached load's critical path
  return ort.InferenceSession.create(files[graph], {
    executionProviders: [device], graphOptimizationLevel: device === 'wasm' ? 'basic' : 'all',
    externalData: external, logSeverityLevel: 3, extra: nested(manifest.quantization?.session_config),
  });
}

async function open({ model, ortURL, device: wanted, threads }) {
  const t0 = performance.now();
  const device = await chooseDevice(wanted);
  const runtime = startRuntime(ortURL, device, threads);
  runtime.catch(() => {}); // awaited below; a failure surfaces there
  const onProgress = (progress) => post({ type: 'progress', progress });
  // stored graph files are checked (sha256) while the session is being built from them
  let { manifest, files, stats, checked } = await loadPackage(model, onProgress, { deferCheck: isGraphFile });
  // graphs and weights stay here (or were never fetched: the LoRA variant); the rest goes to Python
  const graphFiles = Object.keys(manifest.files).filter(isGraphFile);
  const small = Object.fromEntries(Object.entries(files).filter(([n]) => !graphFiles.includes(n)));
  post({ type: 'files', manifest, files: small, graphFiles, cache: stats, device, fetchSeconds: (performance.now() - t0) / 1000 },
    Object.values(small).map((b) => b.buffer));

  post({ type: 'progress', progress: { stage: 'session', message: 'preparing the model' } });
  const ort = await runtime;
  const graphs = Object.fromEntries(Object.entries(files).filter(([n]) => graphFiles.includes(n)));
  let session = await createSession(ort, manifest, graphs, device).catch((err) => ({ err }));
  const corrupt = await checked;
  if (corrupt.length) { // a stored graph file failed its check (and was deleted): fetch it again, start over
    await session.release?.();
    ({ manifest, files, stats } = await loadPackage(model, onProgress));
    stats = { ...stats, refetched: corrupt.length };
    session = await createSession(ort, manifest, files, device);
  } else if (session.err) {
    throw session.err;
  }
  files = null; // onnxruntime-web holds its own copy now
  runner = new StepRunner(ort, session, manifest.config);
  return { device, threads, cache: stats, sessionSeconds: (performance.now() - t0) / 1000 };
}

self.onmessage = async ({ data }) => {
  const { type, id } = data;
  try {
    if (type === 'open') {
      opening = open(data.options);
      post({ type: 'opened', id, ...(await opening) });
    } else if (type === 'allocate') {
      await opening;
      runner.allocate(data.numBlocks, data.blockSize);
    } else if (type === 'run') {
      await opening;
      post({ type: 'result', id, result: await runner.run(data.step) });
    }
    else if (type === 'timings') post({ type: 'timings', id, timings: runner?.timings() ?? null });
  } catch (err) {
    post({ type: 'failed', id, message: String(err?.message ?? err) });
  }
};
