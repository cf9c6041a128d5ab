// node make_snapshot.mjs PYODIDE_MJS PYTHON_DIR OUT: Pyodide's memory snapshot of the page's Python.
// Boots the bundle's Pyodide, installs the wheels the page uses (pyodide-lock.json's closure of
// "ruvllm") as web/src/worker.js does, imports everything the page can reach
// (runtime/web_preload.py) and writes the heap, gzipped, to OUT. Prints its byte counts as JSON.
import fs from 'node:fs';
import path from 'node:path';
import zlib from 'node:zlib';

const [pyodideMjs, pythonDir, out] = process.argv.slice(2);
const { loadPyodide } = await import(pyodideMjs);
const lock = JSON.parse(fs.readFileSync(path.join(pythonDir, 'pyodide-lock.json'), 'utf8'));
const wanted = new Set();
const visit = (n) => {
  if (wanted.has(n)) return;
  wanted.add(n);
  for (const dep of lock.packages[n].depends ?? []) visit(dep);
};
visit('ruvllm');
const py = await loadPyodide({ indexURL: path.dirname(pyodideMjs) + '/', lockFileContents: lock, _makeSnapshot: true,
  stdout: () => {}, stderr: (s) => process.stderr.write(`${s}\n`) });
py.FS.mkdirTree('/tmp/wheels');
for (const n of wanted) {
  const file = lock.packages[n].file_name;
  py.FS.writeFile(`/tmp/wheels/${file}`, fs.readFileSync(path.join(pythonDir, file)));
}
py.runPython(`
import os, site, sys, zipfile
for _w in sorted(os.listdir('/tmp/wheels')):
    with zipfile.ZipFile(f'/tmp/wheels/{_w}') as _z:
        _z.extractall(site.getsitepackages()[0])
    os.remove(f'/tmp/wheels/{_w}')
del _w, _z
import runtime.web_preload as _p
_skipped = _p.preload_modules()
del _p
# nothing of this build machine in the heap: what Emscripten says when the page boots Python itself
os.environ['_'] = './this.program'
sys.executable = ''
`);
const skipped = py.globals.get('_skipped').toJs();
py.runPython('del _skipped');
const heap = py.makeMemorySnapshot();
const gz = zlib.gzipSync(heap, { level: 6 });
fs.writeFileSync(out, gz);
process.stdout.write(JSON.stringify({ heap_bytes: heap.length, bytes: gz.length, skipped }));
