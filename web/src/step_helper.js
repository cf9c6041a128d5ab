// A helper thread of the page's WASM step (wasm/step/threads.h), started by wasm_step.js: its first message
// brings the threaded module, the shared memory and the top of this thread's own stack; it replies once
// instantiated, then stays inside step_helper, taking its share of every job, until step_stop or termination.
// Runs as a browser Worker or a Node worker_threads Worker (the benchmarks).
const node = typeof self === 'undefined';
const port = node ? (await import('node:worker_threads')).parentPort : self;

async function start({ module, memory, stackTop }) {
  try {
    const instance = await WebAssembly.instantiate(module, { env: { memory } });
    instance.exports.__stack_pointer.value = stackTop;
    port.postMessage({ started: true });
    instance.exports.step_helper(); // never returns
  } catch (err) {
    port.postMessage({ error: String(err?.message ?? err) });
  }
}

if (node) port.once('message', start);
else self.addEventListener('message', (e) => start(e.data), { once: true });
