// The LoRA graph's adapter inputs in the model worker: per layer and target, every slot's A (transposed)
// and B side by side in columns, [columns, in] and [columns, out], as runtime/backends/web.py lays them
// out (slot s: columns (s-1)*perSlot .. s*perSlot - 1). Python reads an adapter's folder and sends its
// safetensors bytes with where each tensor lies; the numbers are decoded and placed here. A step feeds
// views over the columns up to its highest slot, with Python's per-token weights.

import { fromHalf } from './fp16.js';

/** One tensor of a safetensors file, as float32: [start, end, dtype, shape] (absolute byte offsets). */
export function decodeTensor(bytes, [start, end, dtype]) {
  const raw = bytes.slice(start, end); // a copy: aligned for the typed-array views below
  if (dtype === 'F32') return new Float32Array(raw.buffer, 0, raw.length / 4);
  const u16 = new Uint16Array(raw.buffer, 0, raw.length / 2);
  if (dtype === 'BF16') return new Float32Array(Uint32Array.from(u16, (v) => v << 16).buffer);
  if (dtype === 'F16') return Float32Array.from(u16, fromHalf);
  throw new Error(`adapter tensor dtype ${dtype} is not supported`);
}

const IN_JS = { make: (n) => new Float32Array(n), view: (held) => held };

export class LoraStore {
  /** spec (from Python): { maxColumns, weights: input name, targets: [[target, in, out, [[A name, B name] per layer]]] }.
   * arrays: where the columns live, { make(floats) -> held, view(held) -> Float32Array } (the WASM step's
   * store keeps them in its module's memory, where a view is made afresh each time). */
  constructor(spec, arrays = IN_JS) {
    this.arrays = arrays;
    this.weightsName = spec.weights;
    this.maxColumns = spec.maxColumns;
    this.perSlot = 0;
    this.targets = {};
    for (const [name, fin, fout, names] of spec.targets) {
      this.targets[name] = { fin, fout, names, a: names.map(() => arrays.make(spec.maxColumns * fin)),
        b: names.map(() => arrays.make(spec.maxColumns * fout)) };
    }
  }

  /** Put an adapter into a slot: { slot, columns (per slot), parts: [[layer, target, layout, aRef, bRef, scale]] }. */
  set({ slot, columns, parts }, bytes) {
    const view = this.arrays.view;
    if (columns !== this.perSlot) { // wider slots: Python sends every loaded adapter again
      for (const t of Object.values(this.targets)) for (const arr of [...t.a, ...t.b]) view(arr).fill(0);
      this.perSlot = columns;
    }
    const start = (slot - 1) * columns;
    if (start < 0 || (slot * columns) > this.maxColumns) throw new Error(`adapter slot ${slot} is outside the LoRA inputs`);
    for (const t of Object.values(this.targets)) {
      for (const a of t.a) view(a).fill(0, start * t.fin, (start + columns) * t.fin);
      for (const b of t.b) view(b).fill(0, start * t.fout, (start + columns) * t.fout);
    }
    for (const [layer, name, layout, aRef, bRef, scale] of parts) {
      const t = this.targets[name];
      if (!t) throw new Error(`adapter target ${name} is not in this model's LoRA graph`);
      const A = decodeTensor(bytes, aRef), B = decodeTensor(bytes, bRef);
      const { fin, fout } = t;
      if (layout === 'peft') { // A [r, in], B [out, r], times the scale
        const r = aRef[3][0], a = view(t.a[layer]), b = view(t.b[layer]);
        for (let j = 0; j < r; j++) {
          a.set(A.subarray(j * fin, (j + 1) * fin), (start + j) * fin);
          const row = (start + j) * fout;
          for (let o = 0; o < fout; o++) b[row + o] = B[o * r + j] * scale;
        }
      } else { // stacked: A [layers, in, r], B [layers, r, out], the scale folded in
        const [layers, , r] = aRef[3];
        for (let l = 0; l < layers; l++) {
          const a = view(t.a[l]), b = view(t.b[l]);
          for (let j = 0; j < r; j++) {
            const at = (start + j) * fin;
            for (let i = 0; i < fin; i++) a[at + i] = A[(l * fin + i) * r + j];
            b.set(B.subarray((l * r + j) * fout, (l * r + j + 1) * fout), (start + j) * fout);
          }
        }
      }
    }
  }

  /** An X-LoRA's classifier: layers [[weightRef, biasRef]] over blobs [weight, bias, weight, ...]. */
  setClassifier(id, layers, blobs) {
    this.classifiers ??= {};
    this.classifiers[id] = layers.map(([w, b], i) => ({ w: decodeTensor(blobs[2 * i], w), b: decodeTensor(blobs[2 * i + 1], b),
      out: w[3][0], in: w[3][1] }));
  }

  /** The classifier's outputs for rows [start, start + n) of hidden [tokens, H]: Linear, ReLU, ..., Linear. */
  classify(id, hidden, start, n) {
    const layers = this.classifiers?.[id];
    if (!layers) throw new Error(`no X-LoRA classifier ${id} was sent to the model worker`);
    const out = [];
    for (let r = start; r < start + n; r++) {
      let x = hidden.subarray(r * layers[0].in, (r + 1) * layers[0].in);
      layers.forEach((layer, i) => {
        const y = new Float32Array(layer.out);
        for (let o = 0; o < layer.out; o++) {
          let acc = layer.b[o];
          const row = o * layer.in;
          for (let k = 0; k < layer.in; k++) acc += layer.w[row + k] * x[k];
          y[o] = i + 1 < layers.length && acc < 0 ? 0 : acc; // ReLU between layers (dropout is off)
        }
        x = y;
      });
      out.push(Array.from(x));
    }
    return out;
  }

  /** The LoRA inputs of a step: the first `columns` columns of every A and B, and the tokens' weights
   * ([tokens, sets * columns]: contract.LORA_WEIGHTS). */
  addFeeds(ort, feeds, { columns, sets = 1, weights }) {
    for (const t of Object.values(this.targets)) {
      t.names.forEach(([aName, bName], l) => {
        feeds[aName] = new ort.Tensor('float32', this.arrays.view(t.a[l]).subarray(0, columns * t.fin), [columns, t.fin]);
        feeds[bName] = new ort.Tensor('float32', this.arrays.view(t.b[l]).subarray(0, columns * t.fout), [columns, t.fout]);
      });
    }
    const width = columns * sets; // a row: one set of weights for every target, or one per layer and target
    feeds[this.weightsName] = new ort.Tensor('float32', Float32Array.from(weights), [weights.length / width, width]);
  }
}
