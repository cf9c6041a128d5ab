// Fetches a model package into the browser's Origin Private File System (OPFS), verifying every file
// against the manifest. Runs in the model worker (ort_worker.js).
//
// Files are stored under their sha256 (content-addressed: a new model version is new files), and a
// file gets its name only after its size and sha256 match, so a failed or partial download never
// leaves a broken entry. A stored file is re-hashed on every load and fetched again if it no longer
// matches (a corrupted disk, a tampered entry); for the graph files that check may run while
// onnxruntime-web already builds its session from them (see ort_worker.js). OPFS read through a
// worker's sync access handle returned 95 MB in ~60 ms in a persistent Chromium profile, the Cache
// API in ~150 ms; this read sits on the cached load's critical path. The manifest is kept in the
// Cache API by URL, for offline loads.

export const STORE_DIR = 'ruvllm-models-v1';

export async function sha256Hex(buffer) {
  const digest = await crypto.subtle.digest('SHA-256', buffer);
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, '0')).join('');
}

/** Whether bytes are the file a manifest entry ({ size, sha256 }) names. */
export async function matches(meta, bytes) {
  return bytes.length === Number(meta.size) && (await sha256Hex(bytes)) === meta.sha256;
}

/** The bytes at `url` once their sha256 (and size, when given) match; `source` names where those came from. */
export async function fetchChecked(url, { sha256, size }, source) {
  const res = await fetch(url);
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  const bytes = new Uint8Array(await res.arrayBuffer());
  if ((size !== undefined && bytes.length !== size) || (await sha256Hex(bytes)) !== sha256) {
    throw new Error(`${url}: size or sha256 does not match ${source}`);
  }
  return bytes;
}

export async function openStore() {
  try {
    const root = await navigator.storage.getDirectory();
    return await root.getDirectoryHandle(STORE_DIR, { create: true });
  } catch {
    return null; // storage disabled (private mode, opaque origin): download every time
  }
}

export async function openCache() {
  try {
    return typeof caches !== 'undefined' ? await caches.open(STORE_DIR) : null;
  } catch {
    return null;
  }
}

export async function readStored(dir, name) {
  let handle;
  try {
    handle = await dir.getFileHandle(name);
  } catch {
    return null; // not stored
  }
  try { // the fast path: a sync access handle (exclusive; another tab may hold it)
    const access = await handle.createSyncAccessHandle();
    try {
      const bytes = new Uint8Array(access.getSize());
      access.read(bytes, { at: 0 });
      return bytes;
    } finally {
      access.close();
    }
  } catch {
    return new Uint8Array(await (await handle.getFile()).arrayBuffer());
  }
}

export async function store(dir, name, bytes) {
  // write under a temporary name, then rename: a crash mid-write leaves no file under `name`
  const part = `${name}.part`;
  try {
    const handle = await dir.getFileHandle(part, { create: true });
    if (handle.createSyncAccessHandle) { // a worker's fast path
      const access = await handle.createSyncAccessHandle();
      try {
        access.truncate(0);
        access.write(bytes, { at: 0 });
        access.flush();
      } finally {
        access.close();
      }
    } else { // the page's main thread (adapters)
      const out = await handle.createWritable();
      await out.write(bytes);
      await out.close();
    }
    await handle.move(name);
  } catch {
    await dir.removeEntry(part).catch(() => {}); // storage full or locked: just not cached this time
  }
}

/** The bytes at `url` as they arrive, each piece handed to `put(bytes, at)` (awaited), which must come to
 * the manifest's `size`. With `pieceBytes`, the pieces are read (a BYOB reader) into one buffer of that
 * size, reused: each piece but the last is whole and starts at a multiple of `pieceBytes`, and nothing is
 * left behind for the garbage collector (a stream's own chunks, a few hundred MB of them on a large file,
 * sat in the heap until a collection). `put` must be done with the piece when it returns. */
async function fetchInto(url, size, put, pieceBytes = 0) {
  const res = await fetch(url, { cache: 'no-store' });
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  let at = 0;
  const take = async (value) => {
    if (at + value.length > size) throw new Error(`${url}: larger than the manifest's ${size} bytes`);
    await put(value, at);
    at += value.length;
  };
  let byob = null;
  try {
    byob = pieceBytes > 0 && res.body ? res.body.getReader({ mode: 'byob' }) : null;
  } catch {
    byob = null; // not a byte stream here: the stream's own chunks below
  }
  if (byob) {
    let buffer = new ArrayBuffer(pieceBytes);
    for (let done = false; !done;) {
      const want = Math.max(1, Math.min(pieceBytes, size - at)); // one byte more past the end: there must be none
      let filled = 0;
      while (filled < want && !done) {
        const got = await byob.read(new Uint8Array(buffer, filled, want - filled));
        done = got.done;
        if (got.value) { // the same memory, under a new ArrayBuffer (the read transfers it)
          buffer = got.value.buffer;
          filled += got.value.length;
        }
      }
      if (filled) await take(new Uint8Array(buffer, 0, filled));
    }
  } else if (!res.body) await take(new Uint8Array(await res.arrayBuffer()));
  else {
    for (const reader = res.body.getReader(); ;) {
      const { done, value } = await reader.read();
      if (done) break;
      await take(value);
    }
  }
  if (at !== size) throw new Error(`${url}: got ${at} bytes, the manifest says ${size}`);
}

async function download(url, size, onBytes) {
  const buf = new Uint8Array(size);
  await fetchInto(url, size, (value, at) => {
    buf.set(value, at);
    onBytes(value.length);
  }, Math.min(size, 1 << 22));
  return buf;
}

// a GGUF's package the page made itself (gguf_source.js): kept in this browser only, no server has it
export const STORED_PACKAGES = 'ruvllm-gguf/';

async function readJSON(url, cache) {
  if (new URL(url).pathname.includes(`/${STORED_PACKAGES}`)) {
    const hit = await cache?.match(url);
    if (hit) return JSON.parse(await hit.text());
    throw new Error(`${url}: this GGUF's package is not in this browser's model store`);
  }
  try {
    const res = await fetch(url, { cache: 'no-cache' });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const text = await res.text();
    await cache?.put(url, new Response(text, { headers: { 'Content-Type': 'application/json' } }));
    return JSON.parse(text);
  } catch (err) {
    const hit = await cache?.match(url); // offline: the manifest from the last load
    if (hit) return JSON.parse(await hit.text());
    throw new Error(`cannot load the model manifest ${url}: ${err.message}`);
  }
}

const manifests = new Map(); // package URL -> Promise of its manifest: read once per worker
const packageURL = (baseURL) => new URL(baseURL.endsWith('/') ? baseURL : `${baseURL}/`, self.location.href);

/** A package's manifest (the network first, else the Cache API's copy from the last load), read once. */
export function readManifest(baseURL) {
  const url = new URL('manifest.json', packageURL(baseURL)).href;
  if (!manifests.has(url)) {
    const read = openCache().then((cache) => readJSON(url, cache));
    read.catch(() => manifests.delete(url)); // a failure is not kept: the next load tries again
    manifests.set(url, read);
  }
  return manifests.get(url);
}

/** The manifest's graph key the page runs: `wanted` where the package has it, else 'decoder' (no stand-in for the int8-KV graph). */
export const pageGraph = (manifest, wanted) => {
  if (manifest.graphs[wanted]) return wanted;
  // the int8-KV graph reads another pool: the main graph cannot stand in for it (the WebGPU one can)
  if (wanted === 'decoder_kv8') throw new Error('kvDtype "int8": this model package has no int8-KV graph (model_kv8.onnx); re-export it');
  return 'decoder';
};

/**
 * Load every file of the package at `baseURL`.
 * Returns { manifest, files: {name: Uint8Array}, stats: {fromCache, downloaded, refetched, ...ms}, checked }.
 *
 * A stored file for which `deferCheck(name)` is true is returned before its sha256 is known, so the
 * caller can start on it (onnxruntime-web's session creation) while the digest runs; `checked`
 * resolves to the names whose digest failed. Their entries are already deleted, so a second
 * loadPackage downloads them again. Every other file is checked before this returns. A file for which
 * `skip(name, manifest)` is true is neither read nor fetched (another runner's weights).
 */
export async function loadPackage(baseURL, onProgress = () => {}, { deferCheck = () => false, graph = 'decoder', skip = () => false } = {}) {
  const base = packageURL(baseURL);
  const dir = await openStore();
  const t0 = performance.now();
  const manifest = await readManifest(base.href);
  if (manifest.format !== 'ruvllm-package') throw new Error(`${base}: not a RuvLLM model package`);
  // one graph is used: `graph` (e.g. a GPU's variant, or the LoRA variant once an adapter is added)
  // where the package has it, else the decoder
  const used = pageGraph(manifest, graph);
  const unused = new Set(Object.entries(manifest.graphs).filter(([k]) => k !== used).map(([, g]) => g.file));
  const entries = Object.entries(manifest.files).filter(([name]) => !unused.has(name) && !skip(name, manifest));
  const total = entries.reduce((n, [, m]) => n + Number(m.size), 0);
  let loaded = 0;
  const stats = { fromCache: 0, downloaded: 0, refetched: 0, manifestMs: performance.now() - t0, readMs: 0, verifyMs: 0 };
  const files = {};
  const deferred = [];
  const verify = async (meta, bytes) => {
    const t = performance.now();
    const ok = await matches(meta, bytes);
    stats.verifyMs = Math.max(stats.verifyMs, performance.now() - t);
    if (!ok) await dir.removeEntry(meta.sha256).catch(() => {});
    return ok;
  };
  // every file at once: storage reads and sha256 digests (off-thread in the browser) overlap
  await Promise.all(entries.map(async ([name, meta]) => {
    const url = new URL(name, base).href;
    const t = performance.now();
    const stored = dir ? await readStored(dir, meta.sha256) : null;
    if (stored) {
      stats.readMs = Math.max(stats.readMs, performance.now() - t);
      const later = deferCheck(name) && stored.length === Number(meta.size);
      if (later) deferred.push(verify(meta, stored).then((ok) => (ok ? null : name)));
      if (later || await verify(meta, stored)) {
        files[name] = stored;
        loaded += stored.length;
        stats.fromCache++;
        onProgress({ stage: 'model', loaded, total, file: name, cached: true });
        return;
      }
      stats.refetched++;
    }
    const bytes = await download(url, Number(meta.size), (n) => {
      loaded += n;
      onProgress({ stage: 'model', loaded, total, file: name, cached: false });
    });
    if ((await sha256Hex(bytes)) !== meta.sha256) throw new Error(`${url}: sha256 does not match the manifest`);
    if (dir) await store(dir, meta.sha256, bytes);
    files[name] = bytes;
    stats.downloaded++;
  }));
  const checked = Promise.all(deferred).then((names) => names.filter(Boolean));
  return { manifest, files, stats, checked };
}

const DIGESTS_IN_FLIGHT = 4; // chunks being hashed at once (each a copy WebCrypto makes as it is called)

/**
 * One large file (a manifest entry with `chunks`: each piece's sha256) placed straight into memory the
 * caller owns (`view(at, n)`: a Uint8Array of n bytes at offset `at`, e.g. the WASM step's weights),
 * from OPFS where it is stored and intact, else from the network (and then stored). Each chunk is checked
 * as it arrives, so JS never holds more than a few chunks: no whole second copy of the file. A stored
 * copy that fails its check is deleted and fetched again; a download that fails one throws.
 * Returns { cached, refetched, ms }.
 */
export async function streamFile(baseURL, name, meta, view, onBytes = () => {}) {
  const { bytes: chunkBytes, sha256: chunkDigests } = meta.chunks;
  const size = Number(meta.size);
  const dir = await openStore();
  const t0 = performance.now();
  const checker = () => { // digests in flight, bounded; resolves to the first failing chunk's index, or -1
    const pending = new Set();
    let bad = -1;
    return {
      async add(i, bytes) {
        const p = sha256Hex(bytes).then((hex) => { if (hex !== chunkDigests[i] && (bad < 0 || i < bad)) bad = i; });
        pending.add(p);
        p.finally(() => pending.delete(p));
        if (pending.size >= DIGESTS_IN_FLIGHT) await Promise.race(pending);
      },
      async done() { await Promise.all(pending); return bad; },
    };
  };
  let refetched = false;
  if (dir) { // stored: read chunk by chunk through a sync access handle, checked as read
    const access = await dir.getFileHandle(meta.sha256).then((h) => h.createSyncAccessHandle()).catch(() => null);
    if (access) {
      let bad = 0;
      try {
        if (access.getSize() === size) {
          const check = checker(), scratch = new Uint8Array(chunkBytes);
          for (let i = 0, at = 0; at < size; i++, at += chunkBytes) {
            const piece = scratch.subarray(0, Math.min(chunkBytes, size - at));
            access.read(piece, { at });
            await check.add(i, piece); // WebCrypto copies the bytes as it is called
            view(at, piece.length).set(piece);
            onBytes(piece.length, true);
          }
          bad = await check.done();
        }
      } finally {
        access.close();
      }
      if (bad < 0) return { cached: true, refetched, ms: performance.now() - t0 };
      await dir.removeEntry(meta.sha256).catch(() => {}); // damaged or partial: fetched again below
      refetched = true;
    }
  }
  const url = new URL(name, packageURL(baseURL)).href;
  const part = `${meta.sha256}.part`;
  const out = dir ? await dir.getFileHandle(part, { create: true }).then((h) => h.createSyncAccessHandle()).catch(() => null) : null;
  const check = checker();
  let scratch = null; // without a BYOB reader: whole chunks, copied out of the view
  let chunk = 0;
  try {
    out?.truncate(0);
    await fetchInto(url, size, async (value, at) => {
      view(at, value.length).set(value);
      out?.write(value, { at });
      onBytes(value.length, false);
      if (at === chunk * chunkBytes && (value.length === chunkBytes || at + value.length === size)) {
        await check.add(chunk++, value); // a whole chunk, read into fetchInto's own buffer (not shared memory)
        return;
      }
      const end = at + value.length;
      while ((chunk + 1) * chunkBytes <= end || (end === size && chunk * chunkBytes < size)) { // whole chunks, as they complete
        scratch ??= new Uint8Array(Math.min(chunkBytes, size));
        const start = chunk * chunkBytes, piece = scratch.subarray(0, Math.min(chunkBytes, size - start));
        piece.set(view(start, piece.length)); // WebCrypto takes no view of shared memory
        await check.add(chunk++, piece);
      }
    }, chunkBytes);
    const bad = await check.done();
    if (bad >= 0) throw new Error(`${url}: chunk ${bad} does not match the manifest's sha256`);
    out?.flush();
  } catch (err) {
    out?.close();
    await dir?.removeEntry(part).catch(() => {});
    throw err;
  }
  if (out) {
    out.close();
    await dir.getFileHandle(part).then((h) => h.move(meta.sha256)).catch(() => dir.removeEntry(part).catch(() => {}));
  }
  return { cached: false, refetched, ms: performance.now() - t0 };
}
