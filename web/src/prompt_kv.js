// The last prompt's K/V blocks, kept in OPFS across page loads (model worker side).
//
// After a request the engine names the cached full blocks of its prompt (chained prefix keys, see
// runtime/core/kv_blocks.py); the model worker copies them out of the KV pool into one file per package
// and device. After a reload the engine parks blocks under those keys and the worker writes the K/V
// back, so a returning visitor's first prompt skips the prefill of what it shares with the last one
// (the system prompt at least). The K/V were computed by this browser's own kernels on this very
// package and device, so a hit is exact. A file that fails its sha256 or does not fit is deleted.

import { openStore, readStored, sha256Hex, store } from './model_store.js';

const utf8 = new TextEncoder();

/** The file name for a package's graph files (by sha256) on one device. */
export async function promptKVName(manifest, graphFiles, device) {
  const shas = graphFiles.map((name) => manifest.files[name]?.sha256 ?? name).sort();
  return `prompt-kv-${(await sha256Hex(utf8.encode(JSON.stringify([shas, device])))).slice(0, 32)}.bin`;
}

const layout = (pool) => ({ blockSize: pool.blockSize, numLayers: pool.numLayers, kvHeads: pool.kvHeads, headDim: pool.headDim });

/** { keys, data } saved under `name`, or null; `data` holds keys.length blocks as KvPool.readBlocks lays them out. */
export async function readPromptKV(name) {
  const dir = await openStore();
  const bytes = dir ? await readStored(dir, name).catch(() => null) : null;
  if (!bytes || bytes.length < 4) return null;
  try {
    const headerLength = new DataView(bytes.buffer, bytes.byteOffset).getUint32(0, true);
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(4, 4 + headerLength)));
    const start = Math.ceil((4 + headerLength) / 4) * 4;
    const body = bytes.slice(start);
    if (header.version !== 1 || (await sha256Hex(body)) !== header.sha256) throw new Error('damaged');
    return { ...header, data: new Float32Array(body.buffer) };
  } catch {
    await dir.removeEntry(name).catch(() => {});
    return null;
  }
}

/** Whether saved blocks fit the pool they would be written into. */
export function fits(saved, pool) {
  const want = layout(pool);
  return Object.entries(want).every(([k, v]) => saved[k] === v)
    && saved.data.length === saved.keys.length * pool.blockFloats;
}

/** Save blocks `ids` of `pool` under their prefix `keys` (hex), replacing what `name` held. */
export async function writePromptKV(name, pool, keys, ids) {
  const dir = await openStore();
  if (!dir) return false;
  const body = new Uint8Array(pool.readBlocks(ids).buffer);
  const header = utf8.encode(JSON.stringify({ version: 1, keys, ...layout(pool), sha256: await sha256Hex(body) }));
  const start = Math.ceil((4 + header.length) / 4) * 4;
  const bytes = new Uint8Array(start + body.length);
  new DataView(bytes.buffer).setUint32(0, header.length, true);
  bytes.set(header, 4);
  bytes.set(body, start);
  await store(dir, name, bytes);
  return true;
}
