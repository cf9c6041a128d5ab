"""Assembles dist/web/: Pyodide core, our Pyodide lock and wheels, onnxruntime-web, the JS API,
the demo page and a model package exported for the browser. Nothing in it points off-origin.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from runtime.aliases import cached_package_dir, source_cache_key, source_name
from runtime.errors import RuvLLMError
from wasm.bytecode import add_bytecode
from wasm.snapshot import make_snapshot
from wasm.step_module import FALLBACK as STEP_FALLBACK
from wasm.step_module import THREADED as STEP_THREADED
from wasm.step_module import build as build_step
from wasm.warmup import write_warmup_model
from wasm.wheels import markupsafe_from_sdist, package_files, write_wheel

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
PYODIDE_CORE = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip")
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm",
             "ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
# Pure-Python wheels from PyPI, pinned: what Pyodide's own distribution would have served from its CDN.
PYPI_WHEELS = {"jinja2": "3.1.6", "micropip": "0.11.1"}
MARKUPSAFE = "3.0.3"


def log(msg: str) -> None:
    print(f"[wasm] {msg}", file=sys.stderr, flush=True)


def npm_install() -> Path:
    modules = WEB / "node_modules"
    if not (modules / "pyodide" / "pyodide.mjs").exists() or not (modules / "onnxruntime-web").exists():
        log("npm install (web/)")
        cmd = ["npm", "ci" if (WEB / "package-lock.json").exists() else "install", "--no-audit", "--no-fund"]
        subprocess.run(cmd, cwd=WEB, check=True)
    return modules


def _pip_fetch(args: list[str], dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
                    "-d", str(dest), *args], check=True)


def python_wheels(out: Path, cache: Path, node_modules: Path | None = None) -> dict[str, dict]:
    """Wheels into out/ and their lock entries (Pyodide lock format)."""
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, version in PYPI_WHEELS.items():
        wheel = next(cache.glob(f"{name}-{version}-py3-none-any.whl"), None)
        if wheel is None:
            _pip_fetch(["--only-binary=:all:", "--python-version", "3.14", f"{name}=={version}"], cache)  # Pyodide's Python
            wheel = next(cache.glob(f"{name}-{version}-py3-none-any.whl"))
        shutil.copy(wheel, out / wheel.name)
        entries[name] = (out / wheel.name, version, [name], ["markupsafe"] if name == "jinja2" else [])
    sdist = next(cache.glob(f"markupsafe-{MARKUPSAFE}.tar.gz"), None)
    if sdist is None:
        _pip_fetch(["--no-binary=:all:", f"markupsafe=={MARKUPSAFE}"], cache)
        sdist = next(cache.glob(f"markupsafe-{MARKUPSAFE}.tar.gz"))
    entries["markupsafe"] = (markupsafe_from_sdist(sdist, out), MARKUPSAFE, ["markupsafe"], [])
    version = _project_version()
    files = package_files(ROOT, "runtime", skip=("runtime/serve/scaleout/",))  # Ray Serve: servers only
    entries["ruvllm"] = (write_wheel(out, "ruvllm", version, files, ["jinja2>=3.1"]), version, ["runtime"], ["jinja2"])
    imported = [entries[n][0] for n in ("ruvllm", "jinja2", "markupsafe")]  # what the page imports (not micropip)
    if node_modules is not None and not add_bytecode(imported, node_modules):
        log("no bytecode added to the wheels (Node or Pyodide failed): Pyodide compiles them at load")
    lock = {}
    for name, (path, ver, imports, depends) in entries.items():
        lock[name] = {"name": name, "version": ver, "file_name": path.name, "install_dir": "site",
                      "sha256": _sha256(path), "package_type": "package", "imports": imports, "depends": depends,
                      "unvendored_tests": False, "tool": {}}
    return lock


def _sha256(path: Path) -> str:
    from runtime.package import file_digest

    return file_digest(path)


def _project_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def export_model(source: str, quant: str) -> Path:
    """The source's package for the page, exported once into the cache (runtime.aliases.source_cache_key)."""
    from runtime.formats.step_abi import FORMAT
    from runtime.resolve import export_into_cache

    cache_key, source = source_cache_key(source)
    dest = cached_package_dir(cache_key, quant, "wasm")
    manifest = dest / "manifest.json"
    step = manifest.exists() and json.loads(manifest.read_text()).get("wasm_step")
    if step and step.get("format") != FORMAT:  # exported by an older exporter: its step.bin is another layout
        log(f"{dest}: its WASM step weights are an older layout; exporting again")
        shutil.rmtree(dest)
    if not manifest.exists():
        log(f"exporting {source} ({quant}) for the browser, once, into {dest}")
        export_into_cache(source, quant, dest, target="wasm")
    return dest


def copy_package(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = dest / f.name
        if not target.exists() or target.stat().st_size != f.stat().st_size or target.stat().st_mtime < f.stat().st_mtime:
            shutil.copy2(f, target)


def add_model(out: Path, source: str, quant: str) -> dict:
    """The source's package exported for the page and copied under out/models/<id>/; its models.json entry."""
    ident = source_name(source)
    pkg = export_model(source, quant)
    copy_package(pkg, out / "models" / ident)
    manifest = json.loads((pkg / "manifest.json").read_text())
    files = manifest["files"]
    step = {manifest["wasm_step"]["weights"], manifest["wasm_step"]["index"]} if manifest.get("wasm_step") else set()
    graphs = {n for n in files if n.endswith((".onnx", ".data"))}
    size = lambda names: sum(int(files[n]["size"]) for n in names)  # noqa: E731
    entry = {"id": ident, "url": f"models/{ident}/", "name": manifest["name"],
             "bytes": size(set(files) - step),  # what the page fetches on onnxruntime-web
             "quantization": manifest.get("quantization")}
    if step:  # and with backend 'wasm-step': its weights instead of the graphs
        entry["wasm_step_bytes"] = size(set(files) - graphs)
    return entry


def build(out: Path, model: str | list[str] | None = "smollm2-135m", quant: str = "int4") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    # the models first: a source that cannot be exported fails the build before anything else is done
    models = [add_model(out, source, quant) for source in ([model] if isinstance(model, str) else model or [])]
    ids = [m["id"] for m in models]
    if len(set(ids)) < len(ids):
        raise RuvLLMError(f"two models would share a name in the bundle: {ids}")
    modules = npm_install()
    for sub in ("pyodide", "ort", "python", "ruvllm"):
        shutil.rmtree(out / sub, ignore_errors=True)
    for name in PYODIDE_CORE:
        (out / "pyodide").mkdir(exist_ok=True)
        shutil.copy(modules / "pyodide" / name, out / "pyodide" / name)
    for name in ORT_FILES:
        (out / "ort").mkdir(exist_ok=True)
        shutil.copy(modules / "onnxruntime-web" / "dist" / name, out / "ort" / name)
    log("python wheels and lock")
    core_lock = json.loads((modules / "pyodide" / "pyodide-lock.json").read_text())
    lock = {"info": core_lock["info"], "packages": python_wheels(out / "python", ROOT / "build" / "web-cache", modules)}
    (out / "python" / "pyodide-lock.json").write_text(json.dumps(lock, indent=1))
    log("python memory snapshot")
    if make_snapshot(out / "python", modules) is None:
        log("no python snapshot (Node or Pyodide failed): the page will boot Python itself")
    shutil.rmtree(WEB / "python", ignore_errors=True)  # the npm package ships the same wheels and lock
    shutil.copytree(out / "python", WEB / "python")
    log("warm-up model")  # built into web/src (gitignored) so that the npm package ships it too
    write_warmup_model(WEB / "src" / "warmup.onnx")
    log("WASM step")  # wasm/step/step.c, beside the runner that loads it (web/src/wasm_step.js), as above
    build_step(WEB / "src" / "step.wasm")
    build_step(WEB / "src" / STEP_FALLBACK, relaxed=False)
    build_step(WEB / "src" / STEP_THREADED, threads=True)
    shutil.copytree(WEB / "src", out / "ruvllm")
    for f in (WEB / "demo").iterdir():
        shutil.copy(f, out / f.name)
    (out / "models.json").write_text(json.dumps({"models": models}, indent=1))
    versions = {n: json.loads((modules / n / "package.json").read_text())["version"] for n in ("pyodide", "onnxruntime-web")}
    (out / "bundle.json").write_text(json.dumps({"versions": versions, "python": lock["info"]["python"]}, indent=1))
    log(f"bundle ready: {out}")
    return out
