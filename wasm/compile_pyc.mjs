// Compiles the .py files of wheels to bytecode with Pyodide's own Python (run by wasm/bytecode.py):
// node compile_pyc.mjs PATH/TO/pyodide.mjs
// Input on stdin: JSON {wheel name: {archive path: base64 source}}. Output on stdout: JSON
// {wheel name: {archive path of the .pyc: base64 bytecode}}. Hash-checked pycs: valid whatever the
// files' timestamps after Pyodide unpacks the wheel, and still checked against their sources.
import { pathToFileURL } from 'node:url';

const { loadPyodide } = await import(pathToFileURL(process.argv[2]).href); // the npm pyodide's pyodide.mjs

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const wheels = JSON.parse(Buffer.concat(chunks).toString('utf8'));
const pyodide = await loadPyodide();
pyodide.globals.set('wheels_json', JSON.stringify(wheels));
const out = await pyodide.runPythonAsync(`
import base64, json, os, py_compile, importlib.util
result = {}
for wheel, files in json.loads(wheels_json).items():
    root = f"/compile/{wheel}"
    result[wheel] = {}
    for arc, b64 in files.items():
        src = os.path.join(root, arc)
        os.makedirs(os.path.dirname(src), exist_ok=True)
        with open(src, "wb") as f:
            f.write(base64.b64decode(b64))
        pyc = importlib.util.cache_from_source(src)
        py_compile.compile(src, cfile=pyc, dfile=arc, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
        with open(pyc, "rb") as f:
            result[wheel][os.path.relpath(pyc, root)] = base64.b64encode(f.read()).decode()
json.dumps(result)
`);
process.stdout.write(out);
