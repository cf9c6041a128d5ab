// The engine's Web Worker: boots Pyodide with the RuvLLM runtime, opens the model in
// onnxruntime-web, and serves chat requests posted by index.js. Everything heavy happens here,
// so the page stays responsive.

import { loadPackage } from './model_store.js';
import { StepRunner } from './step_runner.js';

let engine = null; // runtime.web_api.WebEngine (a PyProxy)
let info = null;
let runner = null;

const post = (msg) => self.postMessage(msg);

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

async function bootPython(pyodideURL, pythonURL, onProgress) {
  onProgress({ stage: 'runtime', message: 'starting Python' });
  const { loadPyodide } = await import(new URL('pyodide.mjs', pyodideURL).href);
  const lock = await (await fetch(new URL('pyodide-lock.json', pythonURL))).json();
  for (const pkg of Object.values(lock.packages)) pkg.file_name = new URL(pkg.file_name, pythonURL).href;
  const pyodide = await loadPyodide({ indexURL: pyodideURL, lockFileContents: lock, packageBaseUrl: pythonURL,
    stdout: () => {}, stderr: (s) => console.warn(s) });
  await pyodide.loadPackage(['ruvllm'], { messageCallback: () => {}, errorCallback: (s) => console.warn(s) });
  return pyodide;
}

async function load(opts) {
  const t0 = performance.now();
  const progress = (p) => post({ type: 'progress', progress: p });
  const here = new URL('./', import.meta.url);
  const assets = new URL(opts.assetsURL ?? '../', here);
  const pyodideURL = new URL(opts.pyodideURL ?? 'pyodide/', assets).href;
  const pythonURL = new URL(opts.pythonURL ?? 'python/', assets).href;
  const ortURL = new URL(opts.ortURL ?? 'ort/', assets).href;
  const device = await chooseDevice(opts.device ?? 'auto');
  const threads = self.crossOriginIsolated ? Math.max(1, opts.threads ?? Math.min(4, navigator.hardwareConcurrency || 1)) : 1;

  const [pyodide, pkg, ort] = await Promise.all([
    bootPython(pyodideURL, pythonURL, progress),
    loadPackage(opts.model, progress),
    import(new URL(device === 'webgpu' ? 'ort.webgpu.min.mjs' : 'ort.wasm.min.mjs', ortURL).href),
  ]);
  ort.env.wasm.wasmPaths = ortURL;
  ort.env.wasm.numThreads = threads;
  ort.env.logLevel = 'error';
  const loadedAt = performance.now();

  progress({ stage: 'session', message: 'preparing the model' });
  const { manifest, files } = pkg;
  const graph = manifest.graphs.decoder.file;
  const external = Object.keys(files).filter((n) => n.endsWith('.data')).map((n) => ({ path: n, data: files[n] }));
  const session = await ort.InferenceSession.create(files[graph], {
    executionProviders: [device], graphOptimizationLevel: 'all', externalData: external, logSeverityLevel: 3,
    extra: nested(manifest.quantization?.session_config),
  });
  // graphs and weights stay with onnxruntime-web (or were never fetched: the LoRA variant)
  const graphFiles = Object.keys(manifest.files).filter((n) => n.endsWith('.onnx') || n.endsWith('.data'));
  const dir = `/models/${manifest.files[graph].sha256.slice(0, 16)}`;
  pyodide.FS.mkdirTree(dir);
  pyodide.FS.writeFile(`${dir}/manifest.json`, JSON.stringify(manifest));
  for (const [name, bytes] of Object.entries(files)) if (!graphFiles.includes(name)) pyodide.FS.writeFile(`${dir}/${name}`, bytes);
  for (const name of graphFiles) delete files[name]; // onnxruntime-web holds its own copy now

  runner = new StepRunner(ort, session, manifest.config);
  const api = pyodide.pyimport('runtime.web_api');
  const name = opts.modelName ?? manifest.name;
  engine = api.WebEngine.callKwargs(dir, runner, graphFiles, name, {
    kv_memory_mb: opts.kvMemoryMB ?? 256, max_num_seqs: opts.maxNumSeqs ?? 16,
    max_batch_tokens: opts.maxBatchTokens ?? 256,
  });
  info = {
    model: name, device, threads, crossOriginIsolated: self.crossOriginIsolated,
    quantization: manifest.quantization, cache: pkg.stats,
    loadSeconds: (performance.now() - t0) / 1000, fetchSeconds: (loadedAt - t0) / 1000,
  };
  progress({ stage: 'ready' });
  return info;
}

async function create(id, body) {
  const emit = (kind, json) => post({ type: kind, id, payload: JSON.parse(json) });
  try {
    await engine.create(String(id), body, emit);
  } catch (err) {
    post({ type: 'error', id, payload: { error: { message: String(err.message ?? err), type: 'internal_error' } } });
  } finally {
    post({ type: 'done', id });
  }
}

self.onmessage = async ({ data }) => {
  const { type, id } = data;
  try {
    if (type === 'load') post({ type: 'loaded', id, info: await load(data.options) });
    else if (type === 'create') create(data.id, data.body);
    else if (type === 'abort') post({ type: 'aborted', id, ok: engine ? engine.abort(String(data.target)) : false });
    else if (type === 'stats') post({ type: 'stats', id, stats: { ...JSON.parse(engine.stats()), backend: runner.timings(), info } });
    else if (type === 'unload') {
      if (engine) await engine.unload();
      engine = null;
      post({ type: 'unloaded', id });
    }
  } catch (err) {
    post({ type: 'failed', id, message: String(err.message ?? err) });
  }
};
