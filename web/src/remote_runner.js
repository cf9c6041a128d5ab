// The engine worker's handle on the model worker (ort_worker.js): the same methods as StepRunner,
// so runtime/backends/web.py cannot tell them apart; each call is one message each way.

export class RemoteRunner {
  constructor(worker) {
    this.worker = worker;
    this.nextId = 1;
    this.pending = new Map();
    this.listeners = new Set();
    this.refuseXlora = null; // why X-LoRA cannot run on the model worker's backend, if it cannot
    worker.onmessage = ({ data }) => {
      const call = this.pending.get(data.id);
      if (call && data.type !== 'progress' && data.type !== 'files') {
        this.pending.delete(data.id);
        if (data.type === 'failed') call.reject(new Error(data.message));
        else call.resolve(data);
        return;
      }
      for (const listener of this.listeners) listener(data);
    };
    worker.onerror = (e) => {
      for (const call of this.pending.values()) call.reject(new Error(`the model worker failed: ${e.message ?? e}`));
      this.pending.clear();
    };
  }

  call(type, extra = {}, transfer = []) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage({ type, id, ...extra }, transfer);
    });
  }

  allocate(numBlocks, blockSize, io) {
    this.worker.postMessage({ type: 'allocate', numBlocks, blockSize, io });
  }

  enable_lora(spec) { // in order with the steps after it: the model worker opens the LoRA graph
    if (spec.xlora && this.refuseXlora) throw new Error(this.refuseXlora); // to Python, before anything changes
    this.worker.postMessage({ type: 'enableLora', spec });
  }

  set_adapter(meta, bytes) {
    this.worker.postMessage({ type: 'setAdapter', meta, bytes }, [bytes.buffer]);
  }

  set_classifier(id, layers, blobs) { // an X-LoRA's classifier: its Linear layers, [weight, bias] bytes each
    if (this.refuseXlora) throw new Error(this.refuseXlora);
    this.worker.postMessage({ type: 'setClassifier', xlora: id, layers, blobs }, blobs.map((b) => b.buffer));
  }

  async run(step) {
    return (await this.call('run', { step })).result;
  }

  // per-user adaptation (runtime/serve/web_personal.py): the model worker's trainer (step_trainer.js)
  learn_open(store, spec) {
    return this.call('learnOpen', { store, spec });
  }

  learn_feedback(store, spec, job) {
    return this.call('learnFeedback', { store, spec, job });
  }

  async learn_forget(store) {
    return (await this.call('learnForget', { store })).deleted;
  }

  async timings() {
    return (await this.call('timings')).timings;
  }

  terminate() {
    this.worker.terminate();
  }
}
