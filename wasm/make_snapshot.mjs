// node make_snapshot.mjs PYODIDE_MJS PYTHON_DIR OUT: Pyodide's memory snapshot of the page's Python.
// Boots the bundle's Pyodide, installs the wheels the page uses (pyodide-lock.json's closure of
// "ruvllm") with the page's own web/src/wheels.js, imports everything the page can reach
// (runtime/serve/web_preload.py) and writes the heap, gzipped, to OUT. Prints its byte counts as JSON.
import fs from 'node:fs';
import path from 'node:path';
import zlib from 'node:zlib';

const [pyodideMjs, pythonDir, out] = process.argv.slice(2);
const { loadPyodide } = await import(pyodideMjs);
const lock = JSON.parse(fs.readFileSync(path.join(pythonDir, 'pyodide-lock.json'), 'utf8'));
const { installWheels, wheelClosure } = await import(new URL('../web/src/wheels.js', import.meta.url).href);
const py = await loadPyodide({ indexURL: path.dirname(pyodideMjs) + '/', lockFileContents: lock, _makeSnapshot: true,
  stdout: () => {}, stderr: (s) => process.stderr.write(`${s}\n`) });
installWheels(py, wheelClosure(lock, 'ruvllm').map(({ file_name: name }) => ({
  name, bytes: fs.readFileSync(path.join(pythonDir, name)),
})));
py.runPython(`
import os, sys
import runtime.serve.web_preload as _p
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
