// Fetches a model package into the browser's Cache API, verifying every file against the manifest.
//
// A file enters the cache only after its size and sha256 match, so a failed or partial download
// never leaves a broken entry; a cached entry is re-hashed on every load and re-fetched if it no
// longer matches (a corrupted disk, a tampered entry).

export const CACHE_NAME = 'ruvllm-models-v1';

async function sha256Hex(buffer) {
  const digest = await crypto.subtle.digest('SHA-256', buffer);
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, '0')).join('');
}

async function openCache() {
  try {
    return typeof caches !== 'undefined' ? await caches.open(CACHE_NAME) : null;
  } catch {
    return null; // storage disabled (private mode, opaque origin): download every time
  }
}

async function download(url, size, onBytes) {
  const res = await fetch(url, { cache: 'no-store' });
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  if (!res.body) return new Uint8Array(await res.arrayBuffer());
  const buf = new Uint8Array(size);
  const reader = res.body.getReader();
  let at = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (at + value.length > size) throw new Error(`${url}: larger than the manifest's ${size} bytes`);
    buf.set(value, at);
    at += value.length;
    onBytes(value.length);
  }
  if (at !== size) throw new Error(`${url}: got ${at} bytes, the manifest says ${size}`);
  return buf;
}

async function readJSON(url, cache) {
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

/**
 * Load every file of the package at `baseURL`.
 * Returns { manifest, files: {name: Uint8Array}, stats: {fromCache, downloaded, refetched} }.
 */
export async function loadPackage(baseURL, onProgress = () => {}) {
  const base = new URL(baseURL.endsWith('/') ? baseURL : `${baseURL}/`, self.location.href);
  const cache = await openCache();
  const manifest = await readJSON(new URL('manifest.json', base).href, cache);
  if (manifest.format !== 'ruvllm-package') throw new Error(`${base}: not a RuvLLM model package`);
  // the LoRA graph variant is not used in the page (adapters are native-only for now)
  const unused = new Set(Object.entries(manifest.graphs).filter(([k]) => k !== 'decoder').map(([, g]) => g.file));
  const entries = Object.entries(manifest.files).filter(([name]) => !unused.has(name));
  const total = entries.reduce((n, [, m]) => n + Number(m.size), 0);
  let loaded = 0;
  const stats = { fromCache: 0, downloaded: 0, refetched: 0 };
  const files = {};
  // every file at once: the Cache API reads and the sha256 digests (off-thread in the browser) overlap
  await Promise.all(entries.map(async ([name, meta]) => {
    const url = new URL(name, base).href;
    const key = `${url}?sha256=${meta.sha256}`;
    const hit = await cache?.match(key);
    if (hit) {
      const bytes = new Uint8Array(await hit.arrayBuffer());
      if (bytes.length === Number(meta.size) && (await sha256Hex(bytes)) === meta.sha256) {
        files[name] = bytes;
        loaded += bytes.length;
        stats.fromCache++;
        onProgress({ stage: 'model', loaded, total, file: name, cached: true });
        return;
      }
      await cache.delete(key);
      stats.refetched++;
    }
    const bytes = await download(url, Number(meta.size), (n) => {
      loaded += n;
      onProgress({ stage: 'model', loaded, total, file: name, cached: false });
    });
    if ((await sha256Hex(bytes)) !== meta.sha256) throw new Error(`${url}: sha256 does not match the manifest`);
    await cache?.put(key, new Response(bytes, { headers: { 'Content-Type': 'application/octet-stream' } }));
    files[name] = bytes;
    stats.downloaded++;
  }));
  return { manifest, files, stats };
}
