// The page's Python as a memory snapshot: made at bundle build by the bundle's own Pyodide in Node
// (wasm/snapshot.py: wheels installed, every module the page can reach imported), restored here
// instead of booting Pyodide, installing the wheels and importing them (~2.6 s on a reload, 4+ s on
// a first visit beside the model's download; a restore takes ~0.5 s, the download 6.5 MB gzipped).
//
// python/snapshot.json names the file with its size and sha256; the bytes are checked before
// Pyodide sees them, and Pyodide itself refuses a snapshot of another build. The caller boots
// Python the ordinary way when there is no snapshot or it fails any of these.

import { fetchChecked } from './model_store.js';

/** The bundle's snapshot index ({file, size, sha256}), or null when it ships none. */
export async function findSnapshot(pythonURL) {
  const res = await fetch(new URL('snapshot.json', pythonURL)).catch(() => null);
  return res?.ok ? res.json() : null;
}

/** The heap bytes, once the gzipped file's size and sha256 match the index; rejects otherwise. */
export async function readSnapshot(pythonURL, index) {
  const gz = await fetchChecked(new URL(index.file, pythonURL), index, 'snapshot.json');
  const heap = new Response(new Blob([gz]).stream().pipeThrough(new DecompressionStream('gzip')));
  return new Uint8Array(await heap.arrayBuffer());
}
