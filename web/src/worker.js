// The engine's Web Worker: starts Pyodide with the RuvLLM runtime (restored from the bundle's memory
// snapshot, or booted and installed when that cannot be used) and serves chat requests posted by
// index.js. The model itself (fetch, verify, onnxruntime-web session, KV pool) lives in a second
// worker, ort_worker.js, so both load at once; everything heavy is off the page's thread.

import { HEADER_FIRST, byteSource, isGGUF, storedPackageURL } from './gguf_source.js';
import { fetchChecked, openStore, readManifest } from './model_store.js';
import { findSnapshot, readSnapshot } from './python_snapshot.js';
import { RemoteRunner } from './remote_runner.js';
import { installWheels, wheelClosure } from './wheels.js';
import { NO_XLORA } from './wasm_step.js';

let engine = null; // runtime.serve.web_api.WebEngine (a PyProxy)
let runner = null; // RemoteRunner
let info = null;

const post = (msg) => self.postMessage(msg);

// The wheels `name` needs, fetched and checked against pyodide-lock.json's sha256.
async function fetchWheels(lock, name) {
  return Promise.all(wheelClosure(lock, name).map(async (entry) => ({
    name: entry.file_name.split('/').pop(), bytes: await fetchChecked(entry.file_name, entry, 'pyodide-lock.json'),
  })));
}

async function bootPython(pyodideURL, pythonURL, mark = () => {}) {
  const { loadPyodide } = await import(new URL('pyodide.mjs', pyodideURL).href);
  const lock = await (await fetch(new URL('pyodide-lock.json', pythonURL))).json();
  for (const pkg of Object.values(lock.packages)) pkg.file_name = new URL(pkg.file_name, pythonURL).href;
  const options = { indexURL: pyodideURL, lockFileContents: lock, packageBaseUrl: pythonURL,
    stdout: () => {}, stderr: (s) => console.warn(s) };
  const snapshot = await findSnapshot(pythonURL);
  if (snapshot) {
    try { // the snapshot is fetched, checked and unzipped while Pyodide's WASM compiles
      const pyodide = await loadPyodide({ ...options, _loadSnapshot: readSnapshot(pythonURL, snapshot) });
      pyodide.runPython('import random; random.seed()'); // not the build machine's state
      mark('pyodide');
      mark('wheels');
      return { pyodide, python: 'snapshot' };
    } catch (err) {
      console.warn(`ruvllm: the bundle's Python snapshot was not usable (${err?.message ?? err}); starting Python`);
    }
  }
  const wheels = fetchWheels(lock, 'ruvllm');
  wheels.catch(() => {}); // awaited below
  const pyodide = await loadPyodide(options);
  mark('pyodide');
  installWheels(pyodide, await wheels);
  mark('wheels');
  pyodide.runPython('import runtime.serve.web_api'); // import (and compile) the engine while the model loads
  return { pyodide, python: 'booted' };
}

// A GGUF's package from its header (runtime/serve/web_gguf.py), read in growing pieces: { files, plan }, all
// but its tokenizer (web_gguf.gguf_tokenizer, in load), made while step.bin streams in
// (a split GGUF's parts: each one's header, the metadata in the first)
async function ggufPackage(pyodide, source, first) {
  const parts = source.parts ?? [source], bases = source.bases ?? [0];
  const heads = await Promise.all(parts.map((p, k) => (k === 0 ? first : p.read(0, HEADER_FIRST))));
  const want = parts.map(() => HEADER_FIRST);
  for (;;) {
    heads.forEach((head, k) => pyodide.FS.writeFile(`/tmp/gguf-header-${k}`, head));
    const given = JSON.stringify(heads.map((_, k) => ({ path: `/tmp/gguf-header-${k}`, base: bases[k] })));
    const made = JSON.parse(pyodide.pyimport('runtime.serve.web_gguf').gguf_package(given, source.key, source.name));
    heads.forEach((_, k) => pyodide.FS.unlink(`/tmp/gguf-header-${k}`));
    if (made.error) throw new Error(made.error);
    if (!made.need) return made;
    const k = made.part ?? 0;
    if (heads[k].length < want[k]) throw new Error(`${parts[k].name}: the GGUF header runs past the file's end (a truncated file)`);
    want[k] = made.need;
    heads[k] = await parts[k].read(0, want[k]);
  }
}

// Where the engine's Python reads a package: named by its decoder graph, or a GGUF's step.json (no graphs)
function packageFolder(manifest) {
  const named = manifest.graphs.decoder?.file ?? manifest.wasm_step.index;
  return `/models/${manifest.files[named].sha256.slice(0, 16)}`;
}

// A GGUF `model` (URL, File, Blob, ArrayBuffer): the package kept from an earlier load ({ model }), or what
// making it needs ({ model, source }); a package URL as it is.
async function resolveModel(model) {
  if (!isGGUF(model)) return { model: new URL(model, self.location.href).href };
  const source = await byteSource(model);
  const url = await storedPackageURL(source.key);
  const kept = await readManifest(url).then(async (m) => { // whole: every file still in storage
    const dir = await openStore();
    if (!dir || !m.files?.[m.wasm_step?.weights]?.chunks) return false;
    const there = await Promise.all(Object.values(m.files).map((f) => dir.getFileHandle(f.sha256).then(() => true, () => false)));
    return there.every(Boolean);
  }, () => false);
  return kept ? { model: url, gguf: source.name } : { model: url, gguf: source.name, source, given: model };
}

async function load(opts) {
  const t0 = performance.now();
  const timings = {};
  const mark = (name) => { timings[name] = Number(((performance.now() - t0) / 1000).toFixed(3)); };
  const progress = (p) => post({ type: 'progress', progress: p });
  const here = new URL('./', import.meta.url);
  const assets = new URL(opts.assetsURL ?? '../', here);
  const pyodideURL = new URL(opts.pyodideURL ?? 'pyodide/', assets).href;
  const pythonURL = new URL(opts.pythonURL ?? 'python/', assets).href;
  const ortURL = new URL(opts.ortURL ?? 'ort/', assets).href;
  const threads = self.crossOriginIsolated ? Math.max(1, opts.threads ?? Math.min(4, navigator.hardwareConcurrency || 1)) : 1;

  const resolved = await resolveModel(opts.model);
  if (resolved.gguf && opts.backend && !['auto', 'wasm-step'].includes(opts.backend)) {
    throw new Error(`backend ${JSON.stringify(opts.backend)}: a GGUF opened in the page runs on the WASM step (backend "wasm-step" or "auto"); `
      + 'for onnxruntime-web export it with `python -m exporter convert FILE --target wasm`');
  }
  runner = new RemoteRunner(new Worker(new URL('./ort_worker.js', import.meta.url), { type: 'module' }));
  let filesMessage = null;
  const filesArrived = new Promise((resolve) => runner.listeners.add((msg) => {
    if (msg.type === 'progress') progress(msg.progress);
    else if (msg.type === 'files') { filesMessage = msg; mark('fetched'); resolve(msg); }
  }));
  progress({ stage: 'runtime', message: 'starting Python' });
  const first = (resolved.source?.parts?.[0] ?? resolved.source)?.read(0, HEADER_FIRST); // the header's first bytes while Python starts
  first?.catch(() => {});
  const python = bootPython(pyodideURL, pythonURL, mark).then((py) => { mark('python'); return py; });
  python.catch(() => {});
  let gguf;
  if (resolved.source) { // a GGUF not seen before: its header makes the package (Python), then its weights stream in
    progress({ stage: 'model', message: `reading ${resolved.source.name}'s header` });
    const made = await ggufPackage((await python).pyodide, resolved.source, first);
    mark('gguf_header');
    gguf = { source: resolved.given, files: made.files, plan: made.plan, packageURL: resolved.model,
      sizes: resolved.source.parts?.map((p) => p.size) ?? null };
  }
  const opened = runner.call('open', { options: { model: resolved.model, gguf, ortURL, device: opts.device ?? 'auto', threads,
    kvDtype: opts.kvDtype ?? 'fp32', backend: resolved.gguf ? 'wasm-step' : opts.backend ?? 'auto' } })
    .then((r) => { mark('session'); return r; });
  opened.catch(() => {});
  let late = null; // a GGUF's manifest, listing the tokenizer made here while its weights stream in
  if (gguf) {
    const { pyodide } = await python;
    const folder = packageFolder(JSON.parse(gguf.files['manifest.json'])); // the step.json the final manifest lists too
    const made = JSON.parse(pyodide.pyimport('runtime.serve.web_gguf').gguf_tokenizer(resolved.source.key, folder));
    const tokenizer = made.manifest && pyodide.FS.readFile(`${folder}/tokenizer.json`);
    runner.worker.postMessage({ type: 'ggufFiles', manifest: made.manifest, files: { 'tokenizer.json': tokenizer },
      error: made.error ?? null }, tokenizer ? [tokenizer.buffer] : []);
    if (made.error) throw new Error(made.error);
    late = made.manifest;
    mark('gguf_tokenizer');
  }

  // Python needs only the small files (manifest, tokenizer, template), which come before the session
  const openFailed = opened.then(() => new Promise(() => {})); // settles only if opening fails
  const [{ pyodide, python: pythonStart }] = await Promise.race([Promise.all([python, filesArrived]), openFailed]);
  const { files, graphFiles, backend: stepper } = filesMessage;
  const manifest = late ?? filesMessage.manifest;
  const dir = packageFolder(manifest);
  pyodide.FS.mkdirTree(dir);
  for (const [name, bytes] of Object.entries(files)) pyodide.FS.writeFile(`${dir}/${name}`, bytes);
  pyodide.FS.writeFile(`${dir}/manifest.json`, JSON.stringify(manifest)); // a GGUF's: the one listing its tokenizer
  self.pyodideFS = pyodide.FS; // adapters' files are written there later
  const api = pyodide.pyimport('runtime.serve.web_api');
  const name = opts.modelName ?? manifest.name;
  // the engine (tokenizer, template, scheduler) is built while the session may still be in creation;
  // the model worker holds the KV-pool allocation until its session is open
  // only what the caller chose: the page's defaults are Python's (runtime/core/config.py, EngineConfig.web)
  // drafts are nearly free in onnxruntime-web's memory-bound fp32 step, not on the compute-bound WASM step:
  // it verifies them at their full cost (docs/PERFORMANCE.md), so it drafts only when asked to
  // the WASM step's scratch grows with a step's tokens (~136 KB a token at 1B): 128 at a time kept 14 MB
  // off a 1B model's page at the same prefill speed (16-token tiles either way; docs/PERFORMANCE.md)
  const chosen = { kv_memory_mb: opts.kvMemoryMB, max_num_seqs: opts.maxNumSeqs,
    max_batch_tokens: opts.maxBatchTokens ?? (stepper === 'wasm-step' ? 128 : undefined),
    kv_dtype: opts.kvDtype, max_request_bytes: opts.maxRequestBytes, user: opts.user, stepper,
    speculative_tokens: opts.speculativeTokens ?? (stepper === 'wasm-step' ? 0 : undefined) };
  engine = api.WebEngine.callKwargs(dir, runner, graphFiles, name,
    Object.fromEntries(Object.entries(chosen).filter(([, v]) => v != null)));
  mark('engine');
  const { backend, device, graph, sessionSeconds, cache, warmupSteps, threads: usedThreads } = await opened;
  if (backend === 'wasm-step') runner.refuseXlora = NO_XLORA; // refused in Python, before anything changes
  keepPromptKV = opts.promptCache !== false;
  const promptBlocks = keepPromptKV ? await restorePromptKV() : 0;
  timings.model_worker = { fetch: Number(filesMessage.fetchSeconds.toFixed(3)), session: Number(sessionSeconds.toFixed(3)),
    warmup_steps: warmupSteps };
  info = {
    model: name, backend, device, graph, threads: usedThreads ?? threads, gguf: resolved.gguf ?? null,
    kvDtype: opts.kvDtype ?? 'fp32', crossOriginIsolated: self.crossOriginIsolated,
    quantization: manifest.quantization, cache, python: pythonStart, restoredPromptBlocks: promptBlocks,
    loadSeconds: (performance.now() - t0) / 1000, timings, sampling: JSON.parse(engine.sampling_defaults()),
    // the step computes each token alike in any step (tests/web/test_wasm_step.py); onnxruntime-web's kernels do not say
    batchInvariant: backend === 'wasm-step',
    ...(backend === 'wasm-step' ? {} : { batchInvariance: "attention and projections on onnxruntime-web's kernels" }),
  };
  progress({ stage: 'ready' });
  return info;
}

// The last prompt's cached K/V blocks survive a reload (web/src/prompt_kv.js): restored before the
// first request, saved after each. Best effort: storage trouble only costs the prefill it would save.
const PROMPT_KV_BLOCKS = 8; // up to 128 tokens of prompt, ~5.9 MB for SmolLM2-135M
let keepPromptKV = true;
let savedPromptKV = '[]';
let savingPromptKV = Promise.resolve();

async function restorePromptKV() {
  let ids = [];
  try {
    const { keys } = await runner.call('promptKVKeys');
    ids = keys.length ? JSON.parse(engine.restore_prompt_blocks(JSON.stringify(keys))) : [];
    await runner.call('promptKVRestore', { ids });
    savedPromptKV = JSON.stringify(keys.slice(0, ids.length));
    return ids.length;
  } catch (err) {
    if (ids.length) engine.forget_prompt_blocks(JSON.stringify(ids)); // keys without their K/V would be wrong hits
    console.warn(`ruvllm: the saved prompt cache was not restored (${err?.message ?? err})`);
    return 0;
  }
}

function savePromptKV() {
  if (!keepPromptKV) return;
  savingPromptKV = savingPromptKV.then(async () => {
    const blocks = JSON.parse(engine?.recent_prompt_blocks(PROMPT_KV_BLOCKS) ?? '[]');
    const keys = JSON.stringify(blocks.map(([key]) => key));
    if (!blocks.length || keys === savedPromptKV) return;
    await runner.call('promptKVSave', { keys: blocks.map(([key]) => key), ids: blocks.map(([, block]) => block) });
    savedPromptKV = keys;
  }).catch((err) => console.warn(`ruvllm: the prompt cache was not saved (${err?.message ?? err})`));
}

async function create(id, body, kind = 'chat') {
  const emit = (kind, json) => post({ type: kind, id, payload: JSON.parse(json) });
  try {
    // a body past the limit in UTF-16 units is past it in UTF-8 bytes: refused before it is copied into Python
    if (body.length > engine.max_request_bytes) emit('error', engine.too_large());
    else await engine.create(String(id), body, emit, kind);
  } catch (err) {
    post({ type: 'error', id, payload: { error: { message: String(err.message ?? err), type: 'internal_error' } } });
  } finally {
    post({ type: 'done', id });
    savePromptKV();
  }
}

// An adapter's files go into Pyodide's file system, one fresh folder per load; Python reads and checks
// them (runtime/core/adapters.py) and sends the numbers to the model worker when a request needs them.
let adapterLoads = 0;

function writeFiles(FS, dir, files) {
  for (const [file, bytes] of Object.entries(files)) {
    const parts = file.split('/');
    if (parts.length > 2 || parts.some((p) => !p || p.startsWith('.'))) throw new Error(`adapter file name ${file} is not allowed`);
    FS.mkdirTree(parts.length === 2 ? `${dir}/${parts[0]}` : dir);
    FS.writeFile(`${dir}/${file}`, new Uint8Array(bytes));
  }
}

function loadAdapter(name, files, experts) {
  if (!engine) throw new Error('the engine is not loaded');
  const dir = `/adapters/${adapterLoads++}`;
  const FS = self.pyodideFS;
  writeFiles(FS, dir, files);
  const paths = {};
  Object.entries(experts ?? {}).forEach(([expert, expertFiles], i) => {
    paths[expert] = `${dir}-experts/${i}`;
    writeFiles(FS, paths[expert], expertFiles);
  });
  return JSON.parse(engine.add_adapter(name, dir, experts ? JSON.stringify(paths) : null));
}

self.onmessage = async ({ data }) => {
  const { type, id } = data;
  try {
    if (type === 'load') post({ type: 'loaded', id, info: await load(data.options) });
    else if (type === 'loadAdapter') post({ type: 'adapterLoaded', id, adapter: loadAdapter(data.name, data.files, data.experts) });
    else if (type === 'unloadAdapter') post({ type: 'adapterUnloaded', id, ok: engine ? engine.remove_adapter(data.name) : false });
    else if (type === 'create') create(data.id, data.body, data.kind);
    else if (['feedback', 'forget', 'userState', 'userAdapter'].includes(type)) { // per-user adaptation
      if (!engine) throw new Error('the engine is not loaded');
      const user = data.user ?? null;
      const ask = { feedback: () => engine.feedback(data.body), forget: () => engine.forget(user),
        userState: () => engine.user_state(user), userAdapter: () => engine.user_adapter(user) }[type];
      const answer = JSON.parse(await ask());
      if (type === 'userAdapter' && answer.path) { // the folder's files, out of Pyodide's file system
        const FS = self.pyodideFS;
        answer.files = Object.fromEntries(FS.readdir(answer.path).filter((f) => !f.startsWith('.'))
          .map((f) => [f, FS.readFile(`${answer.path}/${f}`)]));
      }
      post({ type: 'answered', id, answer });
    }
    else if (type === 'abort') post({ type: 'aborted', id, ok: engine ? engine.abort(String(data.target)) : false });
    else if (type === 'stats') {
      await savingPromptKV; // a caller reading stats after a request sees its prompt saved
      post({ type: 'stats', id, stats: { ...JSON.parse(engine.stats()), backend: await runner.timings(), info } });
    }
    else if (type === 'unload') {
      if (engine) await engine.unload();
      engine = null;
      runner?.terminate();
      post({ type: 'unloaded', id });
    }
  } catch (err) {
    post({ type: 'failed', id, message: String(err.message ?? err) });
  }
};
