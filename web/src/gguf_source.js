// A GGUF opened by the page itself (a URL, a File or Blob, an ArrayBuffer), with no exporter: the engine
// worker's Python reads the file's header (runtime/formats/gguf_page.py: the manifest, tokenizer, template
// and the plan of step.bin, the same description the exporter follows) and the model worker fills step.bin
// in the WASM step's memory from the file's byte ranges, each matrix repacked by the step itself
// (wasm/step/repack.h), a few MB at a time: nothing holds the file whole. The package it makes is then kept
// in the model store (OPFS, the Cache API) under a name of its own, so a reload opens it offline.

import { fromHalf } from './fp16.js';
import { STORED_PACKAGES, openCache, openStore, sha256Hex, store } from './model_store.js';

export const HEADER_FIRST = 1 << 20; // the header's first read; Python asks for more where it runs past it
const PIECE = 4 << 20; // at most this many bytes of a matrix's rows repacked at once
export const CHUNK = 1 << 24; // step.bin's pieces, each with its sha256 (runtime/package.py's CHUNK_BYTES)

// llama.cpp's gguf-split names a model's parts `<name>-00001-of-00003.gguf`; each is a GGUF holding its share
// of the tensors, the first all the metadata (runtime/formats/gguf_file.py, joined_header)
const SPLIT = /-(\d{5})-of-(\d{5})\.gguf([?#].*)?$/i;

/** Whether `model` names a GGUF rather than a package folder: a URL, bytes, a File or Blob, or a split GGUF's
 * parts as Files or Blobs (in order, or named `-0000k-of-0000n.gguf`). */
export function isGGUF(model) {
  if (typeof model === 'string') return /\.gguf([?#]|$)/i.test(model);
  if (Array.isArray(model)) return model.length > 0 && model.every((m) => m instanceof Blob);
  return model instanceof Blob || model instanceof ArrayBuffer || ArrayBuffer.isView(model);
}

const fileName = (url) => decodeURIComponent(new URL(url).pathname.split('/').pop() || 'model.gguf');

/** A split GGUF's parts (URLs or Blobs, in order), or null for one file. A URL names the first part. */
function partsOf(model) {
  if (Array.isArray(model)) {
    if (model.length === 1) return null;
    const numbered = model.map((m) => [Number(SPLIT.exec(m.name ?? '')?.[1] ?? NaN), m]);
    return numbered.every(([k]) => k > 0) ? numbered.sort((a, b) => a[0] - b[0]).map(([, m]) => m) : model;
  }
  const m = typeof model === 'string' ? SPLIT.exec(new URL(model, self.location.href).pathname) : null;
  if (!m || Number(m[2]) === 1) return null;
  const url = new URL(model, self.location.href);
  if (Number(m[1]) !== 1) throw new Error(`${fileName(url.href)} is part ${Number(m[1])} of a split GGUF: open it by its first part (-00001-of-${m[2]}.gguf)`);
  return Array.from({ length: Number(m[2]) }, (_, k) => {
    const part = new URL(url);
    part.pathname = url.pathname.replace(SPLIT, `-${String(k + 1).padStart(5, '0')}-of-${m[2]}.gguf`);
    return part.href;
  });
}

/** The file's bytes: { name, key (what it is kept under), read(at, n), stream(from) (a reader of the bytes from
 * there on), size (known once read, for a URL) } over a URL (HTTP ranges), a Blob or File (slices) or an
 * ArrayBuffer; a split GGUF's parts laid end to end as one file (`parts`, `bases`: where each begins), its
 * parts' sizes given where known. A read near the end may return fewer bytes. */
export async function byteSource(model, sizes = null) {
  const parts = partsOf(model);
  if (!parts) return oneSource(Array.isArray(model) ? model[0] : model);
  const sources = await Promise.all(parts.map((p) => oneSource(p)));
  await Promise.all(sources.map(async (p, k) => { p.size ??= sizes?.[k] ?? (await p.read(0, 1), p.size); }));
  return joined(sources);
}

/** Parts laid end to end: a tensor's offset in the joined file is its part's base plus its own. */
function joined(parts) {
  const bases = [];
  let size = 0;
  for (const p of parts) {
    bases.push(size);
    size += p.size;
  }
  const partAt = (at) => { let k = 0; while (k + 1 < parts.length && bases[k + 1] <= at) k++; return k; };
  return { name: parts[0].name, key: parts[0].key, parts, bases, size,
    async read(at, n) {
      const out = new Uint8Array(Math.max(0, Math.min(n, size - at)));
      for (let got = 0, k = partAt(at); got < out.length; k++) {
        const from = at + got - bases[k], piece = await parts[k].read(from, Math.min(out.length - got, parts[k].size - from));
        out.set(piece, got);
        got += piece.length;
      }
      return out;
    },
    async stream(from) {
      let k = partAt(from), reader = await parts[k].stream(from - bases[k]);
      return {
        async read() {
          for (;;) {
            const got = await reader.read();
            if (!got.done || k + 1 >= parts.length) return got;
            reader = await parts[++k].stream(0);
          }
        },
        cancel: () => reader.cancel(),
      };
    } };
}

async function oneSource(model) {
  if (typeof model === 'string') {
    const url = new URL(model, self.location.href).href;
    return { name: fileName(url), key: url, size: undefined, async read(at, n) {
      const res = await fetch(url, { headers: { Range: `bytes=${at}-${at + n - 1}` }, cache: 'no-store' });
      if (res.status === 416) return new Uint8Array(0);
      if (res.status !== 206) {
        throw new Error(res.ok ? `${url}: the server sent the whole file for a byte range (HTTP ${res.status}); opening a GGUF `
          + 'in the page reads it in ranges, as every static host and the Hugging Face Hub serve them' : `${url}: HTTP ${res.status}`);
      }
      const total = /\/(\d+)$/.exec(res.headers.get('Content-Range') ?? '');
      if (total) this.size = Number(total[1]);
      return new Uint8Array(await res.arrayBuffer());
    }, async stream(from) {
      const res = await fetch(url, { headers: { Range: `bytes=${from}-` }, cache: 'no-store' });
      if (res.status !== 206 || !res.body) throw new Error(`${url}: HTTP ${res.status} for its bytes from ${from}`);
      return res.body.getReader();
    } };
  }
  if (model instanceof Blob) {
    const name = model.name || 'model.gguf';
    return { name, key: `file:${name}:${model.size}:${model.lastModified ?? 0}`, size: model.size,
      read: async (at, n) => new Uint8Array(await model.slice(at, at + n).arrayBuffer()),
      stream: async (from) => model.slice(from).stream().getReader() };
  }
  const bytes = model instanceof ArrayBuffer ? new Uint8Array(model) : new Uint8Array(model.buffer, model.byteOffset, model.byteLength);
  const head = await sha256Hex(bytes.slice(0, HEADER_FIRST));
  return { name: 'model.gguf', key: `bytes:${head}:${bytes.length}`, size: bytes.length, read: async (at, n) => bytes.subarray(at, at + n),
    stream: async (from) => {
      let done = false;
      return { read: async () => (done ? { done } : (done = true, { done: false, value: bytes.subarray(from) })), cancel: async () => {} };
    } };
}

/** The package URL a GGUF's page package is kept under (by the source's key). */
export async function storedPackageURL(key) {
  const id = await sha256Hex(new TextEncoder().encode(key));
  return new URL(`${STORED_PACKAGES}${id.slice(0, 32)}/`, self.location.href).href;
}

export const isStoredPackage = (url) => new URL(url, self.location.href).pathname.includes(`/${STORED_PACKAGES}`);

/** The bytes of a stream from file offset `at` on, taken in increasing order: take(at, n) a copy of n bytes
 * (the ones before `at` skipped). One request for the whole read: the network runs ahead of the step's work. */
class Sequential {
  constructor(reader, at, name) {
    Object.assign(this, { reader, at, name, chunk: new Uint8Array(0) });
  }

  async more() {
    const { done, value } = await this.reader.read();
    if (done) throw new Error(`${this.name}: the file ends inside a tensor (a truncated GGUF)`);
    this.chunk = value;
  }

  async take(at, n) {
    if (at < this.at) throw new Error(`${this.name}: a tensor at ${at} before the read's place ${this.at}`);
    while (this.at < at) { // skip the alignment's padding (or a tensor the step does not read)
      if (!this.chunk.length) await this.more();
      const skip = Math.min(this.chunk.length, at - this.at);
      this.chunk = this.chunk.subarray(skip);
      this.at += skip;
    }
    const out = new Uint8Array(n);
    for (let got = 0; got < n;) {
      if (!this.chunk.length) await this.more();
      const k = Math.min(this.chunk.length, n - got);
      out.set(this.chunk.subarray(0, k), got);
      this.chunk = this.chunk.subarray(k);
      got += k;
      this.at += k;
    }
    return out;
  }
}

/** step.bin filled from the file: `plan` (StepPlan.to_json: step.json, each array's source), `view(at, n)`
 * step.bin's bytes in the module's memory, `repack(name, rows, cols, src, row0, n)` the step's own repacking
 * of a matrix's rows. The tensors are read in file order in one stream, a piece of at most PIECE bytes at a time. */
export async function fillStep(source, plan, view, repack, onBytes = () => {}) { // onBytes(read, of): the file's bytes
  const arrays = Object.fromEntries(plan.index.arrays.map((a) => [a.name, a]));
  const pieces = []; // [file offset, what to do]
  for (const [name, src] of Object.entries(plan.sources)) {
    const placed = plan.fill.filter((f) => f.source === name);
    if (placed.some((f) => f.part)) { // a matrix: whole groups of four rows at a time
      const [rows, cols] = src.shape, rowBytes = src.bytes / rows;
      const step = Math.max(4, Math.floor(PIECE / rowBytes / 4) * 4);
      for (let r = 0; r < rows; r += step) {
        const n = Math.min(step, rows - r);
        pieces.push([src.at + r * rowBytes, async () => repack(name, rows, cols, await read(src.at + r * rowBytes, n * rowBytes), r, n),
          n * rowBytes]);
      }
    } else {
      const a = arrays[placed[0].name];
      pieces.push([src.at, async () => widen(src.type, await read(src.at, src.bytes), new Float32Array(a.bytes / 4))
        .then((f) => view(a.offset, a.bytes).set(new Uint8Array(f.buffer))), src.bytes]);
    }
  }
  pieces.sort((x, y) => x[0] - y[0]);
  const stream = new Sequential(await source.stream(pieces[0][0]), pieces[0][0], source.name);
  const read = (at, n) => stream.take(at, n);
  let done = 0;
  const total = pieces.reduce((n, p) => n + p[2], 0);
  for (const [, run, bytes] of pieces) {
    await run();
    onBytes(done += bytes, total);
  }
  await stream.reader.cancel?.().catch(() => {});
  for (const f of plan.fill.filter((x) => x.rope !== null)) {
    const a = arrays[f.name];
    view(a.offset, a.bytes).set(new Uint8Array(ropeFrequencies(f.rope, plan.index.config.head_dim).buffer));
  }
}

// a norm's or bias's numbers as fp32 (F32, F16 or BF16 in the file)
async function widen(type, bytes, out) {
  const copy = bytes.slice(); // aligned
  if (type === 'F32') out.set(new Float32Array(copy.buffer));
  else if (type === 'BF16') {
    const u = new Uint16Array(copy.buffer), w = new Uint32Array(out.buffer);
    for (let i = 0; i < u.length; i++) w[i] = u[i] << 16;
  } else if (type === 'F16') {
    const u = new Uint16Array(copy.buffer);
    for (let i = 0; i < u.length; i++) out[i] = fromHalf(u[i]);
  } else throw new Error(`a ${type} vector: the page reads F32, F16 and BF16 ones`);
  return out;
}

/** float64 [head_dim / 2]: base ** (-2i / head_dim), as exporter/step_weights.py's rope_frequencies; step.c turns a
 * position's angles from them (and divides each by its llama 3 factor, rope_factors, where the file has them). */
export function ropeFrequencies(base, hd) {
  const inv = new Float64Array(hd / 2);
  for (let i = 0; i < hd / 2; i++) inv[i] = base ** (-(2 * i) / hd);
  return inv;
}

/** step.bin (`bytes(at, n)`: a copy of its bytes at `at`) and the small files kept in the model store, then the
 * manifest (its step.bin entry completed with the pieces' digests) in the Cache API under `packageURL`: the
 * commit point, so a reload finds a whole package or none. `rest` resolves to { manifest, files }: the package's
 * small files and the manifest listing them, which may come after `early` (the manifest step.bin was placed by:
 * the tokenizer is made while step.bin is kept). Returns the completed manifest. */
export async function keepPackage(packageURL, early, size, bytes, rest) {
  const dir = await openStore(), cache = await openCache();
  const digests = [];
  const name = early.wasm_step.weights;
  // one pass: each piece copied once, hashed and written. The file is named by its pieces' digests, known only
  // after, so it is written under a name of the model's step.json first: a write cut short is overwritten next
  const tmp = `${early.files[early.wasm_step.index].sha256}.step.part`;
  const part = dir && cache ? await dir.getFileHandle(tmp, { create: true }).catch(() => null) : null;
  const access = await part?.createSyncAccessHandle().catch(() => null);
  let kept = Boolean(access);
  try {
    access?.truncate(0);
    for (let at = 0; at < size; at += CHUNK) {
      const piece = bytes(at, Math.min(CHUNK, size - at));
      digests.push(await sha256Hex(piece));
      if (kept) {
        try {
          access.write(piece, { at });
        } catch (err) { // storage full, say: this load goes on, the next reads the GGUF again
          kept = false;
          console.warn(`ruvllm: the GGUF's package was not kept for the next load (${err?.message ?? err})`);
        }
      }
    }
    if (kept) access.flush();
  } finally {
    access?.close();
  }
  const id = await sha256Hex(new TextEncoder().encode(digests.join('')));
  const { manifest, files } = await rest;
  const done = { ...manifest, files: { ...manifest.files, [name]: { size, sha256: id, chunks: { bytes: CHUNK, sha256: digests } } } };
  if (!kept) { // storage disabled or full: this load only
    if (part) await dir.removeEntry(tmp).catch(() => {});
    return done;
  }
  try {
    await part.move(id);
    for (const [file, data] of Object.entries(files)) {
      if (file !== 'manifest.json') await store(dir, manifest.files[file].sha256, data);
    }
    await cache.put(new URL('manifest.json', packageURL).href,
      new Response(JSON.stringify(done), { headers: { 'Content-Type': 'application/json' } }));
  } catch (err) {
    console.warn(`ruvllm: the GGUF's package was not kept for the next load (${err?.message ?? err})`);
  }
  return done;
}

/** The GGUFs' packages kept in this browser: [{ url, name, source, bytes }] (source: the GGUF's URL or file name). */
export async function keptModels() {
  const cache = await openCache();
  if (!cache) return [];
  const out = [];
  for (const request of await cache.keys()) {
    if (!isStoredPackage(request.url) || !request.url.endsWith('/manifest.json')) continue;
    const m = await (await cache.match(request)).json().catch(() => null);
    if (!m?.files) continue;
    out.push({ url: request.url.slice(0, -'manifest.json'.length), name: m.name, source: m.provenance?.source ?? m.name,
      bytes: Object.values(m.files).reduce((n, f) => n + Number(f.size), 0) });
  }
  return out;
}

/** Forget a kept GGUF package (its url from keptModels): its files in OPFS and its manifest. */
export async function forgetModel(url) {
  const cache = await openCache(), dir = await openStore();
  const at = new URL('manifest.json', url).href;
  const hit = await cache?.match(at);
  if (!hit) return false;
  const m = await hit.json();
  const others = (await keptModels()).filter((k) => k.url !== url); // files another kept package shares stay
  const shared = new Set();
  for (const k of others) {
    const o = await (await cache.match(new URL('manifest.json', k.url).href)).json();
    for (const f of Object.values(o.files)) shared.add(f.sha256);
  }
  for (const f of Object.values(m.files)) if (!shared.has(f.sha256)) await dir?.removeEntry(f.sha256).catch(() => {});
  await cache.delete(at);
  return true;
}
