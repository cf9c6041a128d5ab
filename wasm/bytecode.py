"""Bytecode for the wheels the page imports, compiled by Pyodide's own Python (in Node).

Wheels carry only sources, so Pyodide compiled jinja2 and the runtime on every page load: ~0.4 s of
the engine worker's start, on a cached load's critical path. The .pyc files (hash-checked, for
Pyodide's Python version) are added to the wheels; without Node or Pyodide the wheels stay as they were.
"""

from __future__ import annotations

import base64
import json
import subprocess
import zipfile
from pathlib import Path

from wasm.wheels import record_hash, zip_entry

HERE = Path(__file__).resolve().parent


def compile_sources(sources: dict[str, dict[str, bytes]], node_modules: Path) -> dict[str, dict[str, bytes]]:
    """{wheel: {archive path: source}} -> {wheel: {archive path of the pyc: bytecode}}."""
    payload = {w: {p: base64.b64encode(d).decode() for p, d in files.items()} for w, files in sources.items()}
    proc = subprocess.run(["node", str(HERE / "compile_pyc.mjs"), str(node_modules / "pyodide" / "pyodide.mjs")],
                          input=json.dumps(payload).encode(), capture_output=True, check=True)
    out = json.loads(proc.stdout)
    return {w: {p: base64.b64decode(d) for p, d in files.items()} for w, files in out.items()}


def wheel_sources(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as z:
        return {n: z.read(n) for n in z.namelist() if n.endswith(".py")}


def add_to_wheel(wheel: Path, extra: dict[str, bytes]) -> None:
    """Rewrite the wheel with extra files, listed in its RECORD."""
    with zipfile.ZipFile(wheel) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    record_at = next(i for i, (info, _) in enumerate(entries) if info.filename.endswith(".dist-info/RECORD"))
    info, record = entries[record_at]
    lines = "".join(f"{p},{record_hash(d)},{len(d)}\n" for p, d in sorted(extra.items()))
    entries[record_at] = (info, record + lines.encode())
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in entries:
            z.writestr(info, data)
        for arc, data in sorted(extra.items()):
            z.writestr(zip_entry(arc), data)


def add_bytecode(wheels: list[Path], node_modules: Path) -> bool:
    """Add Pyodide-compiled .pyc files to the wheels in place; False (and wheels untouched) on failure."""
    try:
        compiled = compile_sources({w.name: wheel_sources(w) for w in wheels}, node_modules)
    except (OSError, subprocess.CalledProcessError, json.JSONDecodeError):
        return False
    for wheel in wheels:
        add_to_wheel(wheel, compiled[wheel.name])
    return True
