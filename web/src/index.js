// ruvllm-web: the RuvLLM engine in the page, behind an OpenAI-shaped API.
//
//   const engine = await createEngine({ model: '/models/smollm2-135m/', onProgress });
//   for await (const chunk of await engine.chat.completions.create({ messages, stream: true })) { ... }
//
// The engine (Pyodide + onnxruntime-web) runs in a Web Worker; this module only posts messages.

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
    this.chat = { completions: { create: (request) => this.#create(request) } };
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

  #create(request) {
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
      this.worker.postMessage({ type: 'create', id, body: JSON.stringify(body) });
      return Promise.resolve(stream);
    }
    return new Promise((resolve, reject) => {
      let result = null;
      this.requests.set(id, (msg) => {
        if (msg.type === 'response') result = msg.payload;
        else if (msg.type === 'error') reject(apiError(msg.payload));
        else if (msg.type === 'done') resolve(result);
      });
      this.worker.postMessage({ type: 'create', id, body: JSON.stringify(body) });
    });
  }

  /** Abort one request (by the id a stream carries), or every request in flight. */
  async abort(id) {
    const ids = id === undefined ? [...this.requests.keys()] : [id];
    const results = await Promise.all(ids.map((target) => this.#call('abort', { target })));
    return results.some((r) => r.ok);
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

/**
 * Start the engine in a Web Worker and load a model package.
 * options: { model, device: 'auto'|'wasm'|'webgpu', threads, onProgress, assetsURL, pyodideURL, ortURL,
 *            pythonURL, kvMemoryMB, maxNumSeqs, maxBatchTokens, speculativeTokens, promptCache, modelName }
 */
export async function createEngine(options) {
  if (!options?.model) throw new Error('createEngine: options.model (the model package URL) is required');
  const { onProgress, ...rest } = options;
  rest.model = new URL(rest.model, location.href).href;
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
