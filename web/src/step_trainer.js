// A page user's MicroLoRA trainer on the WASM step (issue 51): the factors, Adam's moments and the EWC++
// Fisher in the module's memory, the gradients from step_learn (wasm/step/learn.h), the steps from
// learn_adam, as runtime/backends/micro_lora.py does natively. The state is kept per user in the
// origin's OPFS (ruvllm-users/<package>/<user>.bin), so it survives a reload; the factors leave as PEFT's
// adapter_model.safetensors, which Python serves as the user's adapter.

import { STEP } from './formats.js';
import { sizeOf, writeStruct } from './structs.js';

const TARGETS = STEP.targets; // Learn's tables: target t of layer l at TARGETS.length * l + t
const ATTENTION = new Set(['q_proj', 'k_proj', 'v_proj', 'o_proj']);
const ARRAYS = ['w', 'm', 'v', 'fisher', 'start']; // what the stored state holds, in this order
const FORMAT = 1;
const DIR = 'ruvllm-users';

function features(cfg) { // target -> [in, out]
  const q = cfg.heads * cfg.head_dim, kv = cfg.kv_heads * cfg.head_dim;
  return { q_proj: [cfg.dim, q], k_proj: [cfg.dim, kv], v_proj: [cfg.dim, kv], o_proj: [q, cfg.dim],
    gate_proj: [cfg.dim, cfg.hidden], up_proj: [cfg.dim, cfg.hidden], down_proj: [cfg.hidden, cfg.dim] };
}

function xorshift(seed) { // uniform numbers in [0, 1), for A's start (PEFT's Kaiming-uniform bounds)
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13; s >>>= 0; s ^= s >>> 17; s ^= s << 5; s >>>= 0;
    return s / 4294967296;
  };
}

async function usersDir(store, create) { // the package's folder of users in OPFS
  let dir = await navigator.storage.getDirectory();
  for (const part of [DIR, ...store.split('/').slice(0, -1)]) dir = await dir.getDirectoryHandle(part, { create });
  return dir;
}

export class StepTrainer {
  /** runner: the WasmStepRunner; spec: { targets, layers (the adapted ones; absent: all), rank, alpha, lr, ewc,
   * fisherDecay }. */
  constructor(runner, spec, roomTokens) {
    const cfg = runner.cfg, shapes = features(cfg);
    Object.assign(this, { runner, spec, cfg, scale: spec.alpha / spec.rank, t: 0 });
    for (const t of spec.targets) if (!TARGETS.includes(t)) throw new Error(`personalization target ${t} is not one of ${TARGETS.join(', ')}`);
    this.parts = [];
    let n = 0;
    const layers = spec.layers ?? [...Array(cfg.layers).keys()];
    for (const l of layers) if (!(Number.isInteger(l) && l >= 0 && l < cfg.layers)) throw new Error(`personalization layer ${l} is not among the model's 0-${cfg.layers - 1}`);
    for (const l of layers) {
      for (const target of spec.targets) {
        const [fin, fout] = shapes[target];
        this.parts.push({ layer: l, target, index: TARGETS.length * l + TARGETS.indexOf(target), fin, fout, a: n, b: n + spec.rank * fin });
        n += spec.rank * (fin + fout);
      }
    }
    this.n = n;
    this.at = {};
    for (const name of [...ARRAYS, 'g', 'fresh']) this.at[name] = runner.alloc(4 * n);
    this.tables = [0, 1, 2, 3].map(() => runner.alloc(4 * TARGETS.length * cfg.layers));
    this.parts.forEach((p) => {
      runner.i32(this.tables[0] + 4 * p.index, 1)[0] = this.at.w + 4 * p.a;
      runner.i32(this.tables[1] + 4 * p.index, 1)[0] = this.at.w + 4 * p.b;
      runner.i32(this.tables[2] + 4 * p.index, 1)[0] = this.at.g + 4 * p.a;
      runner.i32(this.tables[3] + 4 * p.index, 1)[0] = this.at.g + 4 * p.b;
    });
    this.room = roomTokens;
    if (runner.k.learn_init(runner.model, roomTokens) !== roomTokens) throw new Error(`the WASM step has no memory left to learn from ${roomTokens} tokens`);
    for (const p of this.parts) { // a part's step: lr times its projection's weight RMS (micro_lora.MicroLora.rates)
      p.rms = runner.k.learn_weight_rms(runner.model, p.layer, STEP.matrices.indexOf(p.target.replace('_proj', '')), p.fout, p.fin);
    }
    this.ids = runner.alloc(4 * roomTokens);
    this.loss = runner.alloc(4);
    this.struct = runner.alloc(sizeOf('Learn'));
    this.reset();
  }

  view(name) { return this.runner.f32(this.at[name], this.n); }

  /** A new user's factors: A as PEFT starts it (uniform within 1 / sqrt(in)), B zero: nothing changes yet. */
  reset() {
    const w = this.view('w'), rand = xorshift(0x9e3779b9);
    w.fill(0);
    for (const p of this.parts) {
      const bound = 1 / Math.sqrt(p.fin);
      for (let i = 0; i < this.spec.rank * p.fin; i++) w[p.a + i] = (2 * rand() - 1) * bound;
    }
    for (const name of ['m', 'v', 'fisher']) this.view(name).fill(0);
    this.view('start').set(w);
    this.t = 0;
  }

  /** step_learn on ids: the loss, with the gradients in g. */
  gradients(ids, scoredFrom = 0, unlikely = false) {
    if (ids.length > this.room) throw new Error(`a feedback step of ${ids.length} tokens: the WASM step learns from ${this.room} at most`);
    const r = this.runner;
    r.i32(this.ids, ids.length).set(ids);
    const [a, b, ga, gb] = this.tables;
    writeStruct(r.k.memory.buffer, this.struct, 'Learn', { num_tokens: ids.length, scored_from: scoredFrom,
      unlikely: unlikely ? 1 : 0, exact: 0, rank: this.spec.rank, scale: this.scale, ids: this.ids, a, b, ga, gb, loss: this.loss });
    const status = r.k.step_learn(r.model, this.struct);
    if (status) throw new Error(`the WASM step's trainer refused a ${this.cfg.arch} text of ${ids.length} tokens: ${STEP.learnRefusals[status] ?? `status ${status}`}`);
    return r.f32(this.loss, 1)[0];
  }

  /** One Adam step (with the EWC++ pull) on the text's loss; the loss before it. */
  step(ids, scoredFrom = 0, unlikely = false, lrScale = 1) {
    const loss = this.gradients(ids, scoredFrom, unlikely);
    this.t += 1;
    const { at } = this, c1 = Math.fround(1 - 0.9 ** this.t), c2 = Math.fround(1 - 0.999 ** this.t);
    for (const p of this.parts) { // A then B of one part, side by side
      const off = 4 * p.a, n = this.spec.rank * (p.fin + p.fout);
      this.runner.k.learn_adam(n, at.w + off, at.g + off, at.m + off, at.v + off, at.fisher + off, at.start + off,
        this.spec.ewc, Math.fround(Math.fround(this.spec.lr * p.rms) * lrScale), c1, c2);
    }
    return loss;
  }

  /** The background loop's part: the Fisher refreshed at the current factors on the reference text. */
  consolidate(reference, chunk) {
    const parts = [];
    for (let s = 0; s < reference.length - 1; s += chunk) parts.push(reference.slice(s, s + chunk + 1));
    this.view('fresh').fill(0);
    for (const part of parts) {
      this.gradients(part);
      this.runner.k.learn_fisher_add(this.n, this.at.fresh, this.at.g, parts.length);
    }
    this.runner.k.learn_fisher_merge(this.n, this.at.fisher, this.at.fresh, this.spec.fisherDecay);
  }

  /** The factors as PEFT's adapter_model.safetensors: A [r, in], B [out, r], in the graph's row order. */
  peft() {
    const w = this.view('w'), r = this.spec.rank, hd = this.cfg.head_dim, half = hd / 2;
    const tensors = [];
    for (const p of this.parts) {
      const prefix = `base_model.model.model.layers.${p.layer}.${ATTENTION.has(p.target) ? 'self_attn' : 'mlp'}.${p.target}`;
      tensors.push([`${prefix}.lora_A.weight`, [r, p.fin], w.slice(p.a, p.a + r * p.fin)]);
      const b = new Float32Array(p.fout * r), interleaved = !this.cfg.rope_neox && (p.target === 'q_proj' || p.target === 'k_proj');
      for (let c = 0; c < r; c++) {
        for (let o = 0; o < p.fout; o++) { // step row o -> the graph's: 2i -> i, 2i + 1 -> half + i within a head
          const i = o % hd, graph = interleaved ? o - i + (i % 2 ? half + (i - 1) / 2 : i / 2) : o;
          b[graph * r + c] = w[p.b + c * p.fout + o];
        }
      }
      tensors.push([`${prefix}.lora_B.weight`, [p.fout, r], b]);
    }
    const header = {};
    let offset = 0;
    for (const [name, shape, data] of tensors) {
      header[name] = { dtype: 'F32', shape, data_offsets: [offset, offset + 4 * data.length] };
      offset += 4 * data.length;
    }
    let text = JSON.stringify(header);
    text += ' '.repeat((8 - ((8 + text.length) % 8)) % 8);
    const head = new TextEncoder().encode(text), out = new Uint8Array(8 + head.length + offset);
    new DataView(out.buffer).setBigUint64(0, BigInt(head.length), true);
    out.set(head, 8);
    let at = 8 + head.length;
    for (const [, , data] of tensors) {
      out.set(new Uint8Array(data.buffer, data.byteOffset, 4 * data.length), at);
      at += 4 * data.length;
    }
    return out;
  }

  /** The state as stored: a JSON header (meta, Adam's step) and the arrays. */
  serialize(meta) {
    const head = new TextEncoder().encode(JSON.stringify({ format: FORMAT, t: this.t, n: this.n, spec: this.spec, meta }));
    const out = new Uint8Array(4 + head.length + 4 * this.n * ARRAYS.length);
    new DataView(out.buffer).setUint32(0, head.length, true);
    out.set(head, 4);
    ARRAYS.forEach((name, i) => {
      const v = this.view(name);
      out.set(new Uint8Array(v.buffer, v.byteOffset, 4 * this.n), 4 + head.length + 4 * this.n * i);
    });
    return out;
  }

  /** Resume from serialize's bytes; its meta, or null when they were made for other settings. */
  restore(bytes) {
    const len = new DataView(bytes.buffer, bytes.byteOffset).getUint32(0, true);
    const head = JSON.parse(new TextDecoder().decode(bytes.subarray(4, 4 + len)));
    if (head.format !== FORMAT || head.n !== this.n || JSON.stringify(head.spec.targets) !== JSON.stringify(this.spec.targets)
        || head.spec.rank !== this.spec.rank || JSON.stringify(head.spec.layers) !== JSON.stringify(this.spec.layers)) return null;
    const data = bytes.slice(4 + len); // aligned
    ARRAYS.forEach((name, i) => this.view(name).set(new Float32Array(data.buffer, 4 * this.n * i, this.n)));
    this.t = head.t;
    return head.meta;
  }

  static async read(store) {
    try {
      const dir = await usersDir(store, false);
      const file = await (await dir.getFileHandle(`${store.split('/').pop()}.bin`)).getFile();
      return new Uint8Array(await file.arrayBuffer());
    } catch {
      return null; // none stored (or no OPFS): a new user
    }
  }

  static async write(store, bytes) {
    const dir = await usersDir(store, true);
    const name = store.split('/').pop();
    const tmp = await dir.getFileHandle(`${name}.tmp`, { create: true });
    const w = await tmp.createWritable();
    await w.write(bytes);
    await w.close();
    await tmp.move(`${name}.bin`); // whole or not at all
  }

  static async remove(store) {
    try {
      await (await usersDir(store, false)).removeEntry(`${store.split('/').pop()}.bin`);
      return true;
    } catch {
      return false;
    }
  }
}

// The model worker's side of runtime/serve/web_personal.py: one trainer, switched between users.
export class PageLearner {
  /** room: the longest step (tokens) it learns from. */
  constructor(runner, room) {
    if (!runner.k?.step_learn) throw new Error('per-user adaptation in the page runs on the WASM step: load the engine with backend "wasm-step" (or "auto" on a CPU)');
    this.runner = runner;
    this.room = room;
    this.trainer = null;
    this.store = null;
    this.meta = null;
  }

  async open(store, spec) {
    if (this.store === store) return this.opened();
    if (!this.trainer || JSON.stringify(this.trainer.spec) !== JSON.stringify(spec)) this.trainer = new StepTrainer(this.runner, spec, this.room);
    else this.trainer.reset();
    const saved = await StepTrainer.read(store);
    this.meta = saved ? this.trainer.restore(saved) : null;
    if (!this.meta) this.trainer.reset();
    this.store = store;
    return this.opened();
  }

  opened() { // no nulls: Python reads a missing key as None
    return this.meta ? { meta: this.meta, peft: this.trainer.peft() } : {};
  }

  // refresh: the steps (indices) before which EWC++'s Fisher is measured again on `reference`
  // (runtime/core/feedback_plan.py: refresh_before)
  async feedback(store, spec, { steps, refresh, reference, chunk, meta }) {
    await this.open(store, spec);
    const t0 = performance.now(), losses = steps.map(([ids, from, unlikely, scale], j) => {
      if (refresh && refresh.includes(j)) this.trainer.consolidate(reference, chunk);
      return this.trainer.step(ids, from, unlikely, scale);
    });
    const seconds = (performance.now() - t0) / 1000;
    await StepTrainer.write(store, this.trainer.serialize(meta));
    this.meta = meta;
    return { losses, seconds, ...(steps.length ? { peft: this.trainer.peft() } : {}) };
  }

  async forget(store) {
    if (this.store === store) {
      this.store = null;
      this.meta = null;
    }
    return StepTrainer.remove(store);
  }
}
