// ruvllm-web: the RuvLLM engine in the page, behind an OpenAI-shaped API.
//
//   const engine = await createEngine({ model: '/models/smollm2-135m/', onProgress });
//   for await (const chunk of await engine.chat.completions.create({ messages, stream: true })) { ... }
//
// The engine (Pyodide + onnxruntime-web) runs in a Web Worker; this module only posts messages (and
// fetches adapters, caching the hash-checked ones in the model store).

import { fetchChecked, matches, openCache, openStore, readStored, store } from './model_store.js';

export { forgetModel, keptModels } from './gguf_source.js';

class ChunkStream {
  constructor(engine, id) {
    this.engine = engine;
    this.id = id;
    this.queue = [];
    this.waiters = [];
    this.done = false;
  }

  push(item) {
    const waiter = this.waiters.shift();
    if (waiter) waiter(item);
    else this.queue.push(item);
  }

  /** Stop generating; the stream ends with finish_reason "stop". */
  abort() {
    return this.engine.abort(this.id);
  }

  async *[Symbol.asyncIterator]() {
    try {
      for (;;) {
        const item = this.queue.length ? this.queue.shift() : await new Promise((r) => this.waiters.push(r));
        if (item.type === 'done') return;
        if (item.type === 'error') throw apiError(item.payload);
        yield item.payload;
      }
    } finally {
      if (!this.done) this.abort(); // the consumer left early
    }
  }
}

function apiError(payload) {
  const err = new Error(payload?.error?.message ?? 'request failed');
  err.error = payload?.error;
  err.type = payload?.error?.type;
  err.code = payload?.error?.code;
  return err;
}

class Engine {
  constructor(worker, info) {
    this.worker = worker;
    this.info = info;
    this.nextId = 1;
    this.pending = new Map(); // control calls: id -> {resolve, reject}
    this.requests = new Map(); // create() calls: id -> handler(msg)
    this.chat = { completions: { create: (request) => this.#create(request, 'chat') } };
    // a text prompt, OpenAI's legacy completions: what a base model without a chat template answers
    this.completions = { create: (request) => this.#create(request, 'completion') };
    worker.onmessage = ({ data }) => this.#dispatch(data);
  }

  #dispatch(msg) {
    const handler = this.requests.get(msg.id);
    if (handler && ['chunk', 'response', 'error', 'done'].includes(msg.type)) {
      handler(msg);
      if (msg.type === 'done') this.requests.delete(msg.id);
      return;
    }
    const call = this.pending.get(msg.id);
    if (!call) return;
    this.pending.delete(msg.id);
    if (msg.type === 'failed') call.reject(new Error(msg.message));
    else call.resolve(msg);
  }

  #call(type, extra = {}) {
    if (!this.worker) return Promise.reject(new Error('the engine is unloaded'));
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage({ type, id, ...extra });
    });
  }

  #create(request, kind) {
    if (!this.worker) return Promise.reject(new Error('the engine is unloaded'));
    const { signal, ...body } = request ?? {};
    const id = this.nextId++;
    signal?.addEventListener('abort', () => this.abort(id), { once: true });
    if (body.stream) {
      const stream = new ChunkStream(this, id);
      this.requests.set(id, (msg) => {
        if (msg.type === 'done') stream.done = true;
        stream.push(msg);
      });
      this.worker.postMessage({ type: 'create', id, kind, body: JSON.stringify(body) });
      return Promise.resolve(stream);
    }
    return new Promise((resolve, reject) => {
      let result = null;
      this.requests.set(id, (msg) => {
        if (msg.type === 'response') result = msg.payload;
        else if (msg.type === 'error') reject(apiError(msg.payload));
        else if (msg.type === 'done') resolve(result);
      });
      this.worker.postMessage({ type: 'create', id, kind, body: JSON.stringify(body) });
    });
  }

  /** Abort one request (by the id a stream carries), or every request in flight. */
  async abort(id) {
    const ids = id === undefined ? [...this.requests.keys()] : [id];
    const results = await Promise.all(ids.map((target) => this.#call('abort', { target })));
    return results.some((r) => r.ok);
  }

  /**
   * Serve a LoRA adapter under `name`: requests then pick it with `model: name`. `source` is the URL of
   * its folder (PEFT's adapter_config.json + adapter_model.safetensors, or `python -m exporter adapter`'s
   * adapter.json + adapter.safetensors, whose sha256 is checked) or its files as { fileName: bytes | Blob }.
   * A PEFT X-LoRA folder needs its expert adapters too: { experts: { name: url | files } }, by the names
   * its adapter_config.json gives them. Resolves to { name, kind, rank, targets, experts }; rejects with
   * the reason when it does not fit the model.
   */
  async loadAdapter(name, source, { experts } = {}) {
    const cache = { downloaded: 0, fromCache: 0, refetched: 0 };
    const files = await adapterFiles(source, cache);
    const expertFiles = experts ? {} : undefined;
    for (const [expert, src] of Object.entries(experts ?? {})) expertFiles[expert] = await adapterFiles(src, cache);
    return { ...(await this.#call('loadAdapter', { name, files, experts: expertFiles })).adapter, cache };
  }

  /** Stop serving an adapter: new requests naming it fail with model_not_found; running ones finish. */
  async unloadAdapter(name) {
    return (await this.#call('unloadAdapter', { name })).ok;
  }

  /**
   * Teach the page's user (createEngine's `user`, or the body's `user`) from one feedback, as the server's
   * POST /v1/feedback takes it: { text } (their own writing), { messages, preferred } (the answer they
   * wanted) or { messages, completion, rating } (rating from -1 to 1). Their next requests are served the
   * adapter learned (kept in this origin's storage: it survives a reload). Runs on the WASM step. Resolves
   * to { steps, losses, version, feedbacks, seconds, ... }; rejects with the field at fault.
   */
  async feedback(body) {
    return this.#answer('feedback', { body: JSON.stringify(body ?? {}) });
  }

  /** Reset a user (by default the page's): their stored adapter is deleted; the base model serves them. */
  async forget(user) {
    return (await this.#answer('forget', { user })).deleted;
  }

  /** What a user (by default the page's) has learned: { version, feedbacks, tokens, targets, rank }. */
  async userState(user) {
    return this.#answer('userState', { user });
  }

  /** A user's (by default the page's) adapter as PEFT's files { 'adapter_config.json', 'adapter_model.safetensors' }
   * (Uint8Arrays), to train further elsewhere; null before they have learned anything. */
  async userAdapter(user) {
    return (await this.#answer('userAdapter', { user })).files ?? null;
  }

  async #answer(type, extra) {
    const { answer } = await this.#call(type, extra);
    if (answer?.error) throw apiError(answer);
    return answer;
  }

  /** Engine counters: running/waiting, KV blocks, prefix-cache hits, tokens. */
  async stats() {
    return (await this.#call('stats')).stats;
  }

  async unload() {
    if (!this.worker) return;
    await this.#call('unload');
    this.worker.terminate();
    this.worker = null;
  }
}

// An adapter's files, as ArrayBuffers by name: fetched from its folder's URL, or given
async function adapterFiles(source, cache) {
  const files = typeof source === 'string' || source instanceof URL ? await fetchAdapter(source, cache) : source;
  const bytes = {};
  for (const [file, data] of Object.entries(files ?? {})) {
    bytes[file] = data instanceof Blob ? await data.arrayBuffer() : ArrayBuffer.isView(data) ? data.slice().buffer : data;
  }
  return bytes;
}

// An adapter folder's files by URL: PEFT's (an X-LoRA's with its classifier's files), or the exporter's.
// The exporter's adapter.json gives its weights' sha256: those are kept in the model store like a
// package's files (checked on every read, fetched again when damaged), and the small JSON in the Cache
// API, so the adapter loads offline. A PEFT folder names no hashes: it is fetched each time (the
// browser's HTTP cache applies); `python -m exporter adapter` converts one.
async function fetchAdapter(url, cache) {
  const base = new URL(String(url).endsWith('/') ? String(url) : `${url}/`, location.href);
  const get = async (file) => {
    const res = await fetch(new URL(file, base));
    return res.ok ? new Uint8Array(await res.arrayBuffer()) : null;
  };
  const failed = []; // network errors (offline, with no copy kept)
  const peft = await getConfig(new URL('adapter_config.json', base), failed);
  const config = peft && JSON.parse(new TextDecoder().decode(peft));
  if (config?.peft_type === 'XLORA') { // the classifier's layers: at the top, or in the experts' subfolders
    const files = { 'adapter_config.json': peft };
    const wanted = ['adapter_model.safetensors', 'xlora_classifier.safetensors',
      ...Object.keys(config.adapters ?? {}).map((k) => `${k}/adapter_model.safetensors`)];
    for (const file of wanted) {
      const data = await get(file);
      if (data) files[file] = data;
    }
    return files;
  }
  if (peft) {
    const w = await get('adapter_model.safetensors');
    if (!w) throw new Error(`${base}: adapter_config.json without adapter_model.safetensors`);
    return { 'adapter_config.json': peft, 'adapter_model.safetensors': w };
  }
  const own = await getConfig(new URL('adapter.json', base), failed);
  if (!own) throw new Error(failed.length ? `cannot fetch the adapter ${base}: ${failed.join('; ')}`
    : `${base}: no adapter_config.json or adapter.json there`);
  const meta = JSON.parse(new TextDecoder().decode(own)).files?.['adapter.safetensors'];
  const w = meta?.sha256 ? await storedOrFetched(new URL('adapter.safetensors', base).href, meta, cache)
    : await get('adapter.safetensors');
  if (!w) throw new Error(`${base}: adapter.json without adapter.safetensors`);
  return { 'adapter.json': own, 'adapter.safetensors': w };
}

// A small config file: from the network (and remembered), or, when the network fails, as last seen;
// null when the server has none (or the network failed and none was kept: `failed` says so)
async function getConfig(url, failed) {
  const kept = await openCache();
  try {
    const res = await fetch(url, { cache: 'no-cache' });
    if (!res.ok) return null;
    const bytes = new Uint8Array(await res.arrayBuffer());
    await kept?.put(url.href, new Response(bytes)).catch(() => {});
    return bytes;
  } catch (err) {
    const hit = await kept?.match(url.href);
    if (hit) return new Uint8Array(await hit.arrayBuffer());
    failed.push(`${url.href}: ${err.message}`);
    return null;
  }
}

// Hash-checked bytes: the stored copy when it still matches, else downloaded, checked and stored
async function storedOrFetched(url, meta, cache) {
  const dir = await openStore();
  const stored = dir ? await readStored(dir, meta.sha256) : null;
  if (stored) {
    if (await matches(meta, stored)) {
      cache.fromCache += 1;
      return stored;
    }
    cache.refetched += 1;
    await dir.removeEntry(meta.sha256).catch(() => {});
  }
  const bytes = await fetchChecked(url, { sha256: meta.sha256, size: Number(meta.size) }, 'its adapter.json');
  cache.downloaded += 1;
  if (dir) await store(dir, meta.sha256, bytes);
  return bytes;
}

/**
 * Start the engine in a Web Worker and load a model package, or a GGUF: `model` is a package folder's URL, or a
 * .gguf's URL (read in byte ranges), a File, a Blob or an ArrayBuffer. A GGUF becomes a package in the page
 * itself (no exporter): its header is read first, and one the WASM step cannot run is refused by name before
 * any weight is fetched; its weights stream into the step at the file's own bits and the package is kept in
 * the browser's storage (OPFS), so the next load of the same URL or file is read from there, offline.
 * options: { model, device: 'auto'|'wasm'|'webgpu', threads, onProgress, assetsURL, pyodideURL, ortURL,
 *            pythonURL, kvMemoryMB, kvDtype: 'fp32'|'int8'|'int4', maxNumSeqs, maxBatchTokens, speculativeTokens,
 *            promptCache, modelName, backend: 'auto'|'onnxruntime'|'wasm-step', maxRequestBytes }
 * maxRequestBytes: a request whose JSON is larger is refused (code 'request_too_large') before it is parsed;
 * by default 1 KiB a token of the model's context plus 1 MiB, as the server's. A prompt that cannot fit the
 * context is refused before it is tokenized.
 * kvDtype 'int8' keeps the KV cache as int8 rows with fp16 group scales (a quarter of the memory), 'int4' as
 * Hadamard-rotated 4-bit rows (about a seventh), each behind exact copies of the blocks being written, as the
 * native engine keeps them; on the WASM step (int8 also on onnxruntime-web's int8-KV graph, one-tier, without
 * adapters). WASM only.
 * backend 'wasm-step' runs the package's own WASM decode step (a GGUF's blocks, wasm/step/step.c) instead
 * of onnxruntime-web, on `threads` threads: LoRA but no X-LoRA yet. 'auto' (the default) takes it where
 * the package carries one and the step would run on the CPU, else onnxruntime-web.
 */
export async function createEngine(options) {
  if (!options?.model) throw new Error('createEngine: options.model (a model package URL, or a GGUF: its URL, a File, Blob or ArrayBuffer) is required');
  const { onProgress, ...rest } = options;
  if (typeof rest.model === 'string') rest.model = new URL(rest.model, location.href).href; // else a GGUF's bytes (File, Blob, ArrayBuffer)
  for (const key of ['assetsURL', 'pyodideURL', 'ortURL', 'pythonURL']) if (rest[key]) rest[key] = new URL(rest[key], location.href).href;
  const worker = new Worker(new URL('./worker.js', import.meta.url), { type: 'module' });
  const info = await new Promise((resolve, reject) => {
    worker.onerror = (e) => reject(new Error(`the engine worker failed to start: ${e.message ?? e}`));
    worker.onmessage = ({ data }) => {
      if (data.type === 'progress') onProgress?.(data.progress);
      else if (data.type === 'loaded') resolve(data.info);
      else if (data.type === 'failed') reject(new Error(data.message));
    };
    worker.postMessage({ type: 'load', id: 0, options: rest });
  }).catch((err) => {
    worker.terminate();
    throw err;
  });
  return new Engine(worker, info);
}
