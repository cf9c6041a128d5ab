// The wheels a package needs from pyodide-lock.json, and their install into Pyodide's site-packages.
// Shared by the engine worker (worker.js) and the bundle build's Python snapshot
// (wasm/make_snapshot.mjs), so the snapshot holds Python installed exactly as the page installs it.
// Wheels are unzipped, not installed with pyodide.loadPackage, which leaves JS references in the
// interpreter that a memory snapshot cannot hold.

/** `name` and its dependencies (pyodide-lock.json's closure), as lock entries. */
export function wheelClosure(lock, name) {
  const wanted = new Map();
  const visit = (n) => {
    if (wanted.has(n)) return;
    const entry = lock.packages[n];
    if (!entry) throw new Error(`pyodide-lock.json has no package ${n}`);
    wanted.set(n, entry);
    for (const dep of entry.depends ?? []) visit(dep);
  };
  visit(name);
  return [...wanted.values()];
}

/** Unzip wheels ([{name, bytes}]) into site-packages. */
export function installWheels(pyodide, wheels) {
  pyodide.FS.mkdirTree('/tmp/wheels');
  for (const { name, bytes } of wheels) pyodide.FS.writeFile(`/tmp/wheels/${name}`, bytes);
  pyodide.runPython(`
import os, site, zipfile
for _w in sorted(os.listdir('/tmp/wheels')):
    with zipfile.ZipFile(f'/tmp/wheels/{_w}') as _z:
        _z.extractall(site.getsitepackages()[0])
    os.remove(f'/tmp/wheels/{_w}')
del _w, _z
`);
}
