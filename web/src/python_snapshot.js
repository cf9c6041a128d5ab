// A memory snapshot of the engine worker's Python, taken once its modules are imported (Pyodide's
// snapshot API) and kept in OPFS. A reload restores it instead of booting Python, installing the
// wheels and importing them again: ~2 s of a cached load become ~0.2 s.
//
// The key is what the heap holds: the wheels (their sha256 in our pyodide-lock.json) and the
// Python they were built for; Pyodide itself refuses a snapshot of another build. A stored snapshot
// carries its own sha256 in its file name, is checked on every read, and one that fails the check
// or fails to restore is deleted, so the next load boots Python and writes a fresh one.

import { readStored, sha256Hex, store } from './model_store.js';

export const SNAPSHOT_DIR = 'ruvllm-python-v1';

export class PythonSnapshots {
  static async open(lock) {
    let dir;
    try {
      dir = await (await navigator.storage.getDirectory()).getDirectoryHandle(SNAPSHOT_DIR, { create: true });
    } catch {
      return null; // no OPFS here (private mode, opaque origin): boot every time
    }
    const wheels = Object.entries(lock.packages).map(([name, p]) => `${name} ${p.version} ${p.sha256}`).sort();
    const what = JSON.stringify({ python: lock.info, wheels });
    return new PythonSnapshots(dir, (await sha256Hex(new TextEncoder().encode(what))).slice(0, 32));
  }

  constructor(dir, key) {
    this.dir = dir;
    this.key = key;
  }

  /** The stored snapshot's file name for this key, or null. */
  async find() {
    for await (const name of this.dir.keys()) {
      if (name.startsWith(`${this.key}-`) && !name.endsWith('.part')) return name;
    }
    return null;
  }

  /** Its bytes once their sha256 matches the name; rejects otherwise. */
  async read(name) {
    const bytes = await readStored(this.dir, name);
    if (!bytes) throw new Error('the snapshot vanished');
    if (`${this.key}-${await sha256Hex(bytes)}` !== name) throw new Error('the snapshot is corrupt');
    return bytes;
  }

  async remove(name) {
    await this.dir.removeEntry(name).catch(() => {});
  }

  /** Store a new snapshot for this key and drop every other one (older wheels or Pyodide). */
  async save(bytes) {
    const name = `${this.key}-${await sha256Hex(bytes)}`;
    const stale = [];
    for await (const old of this.dir.keys()) if (old !== name) stale.push(old);
    await Promise.all(stale.map((old) => this.remove(old)));
    await store(this.dir, name, bytes);
  }
}
