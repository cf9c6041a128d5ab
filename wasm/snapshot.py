"""Pyodide's memory snapshot of the page's Python, made at bundle build by the bundle's own Pyodide in Node.

Booting Pyodide, installing the wheels and importing the engine took the engine worker ~2.6 s on
every load (4+ s on a first visit, beside the model's download). The page restores this heap
instead (web/src/worker.js): Python is ready in ~0.5 s, first visit or reload. Pyodide refuses a
snapshot of another build, and the worker boots Python itself when the snapshot is missing,
corrupt or refused. Without Node the bundle just has no snapshot.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SNAPSHOT = "python-snapshot.bin.gz"
INDEX = "snapshot.json"


def make_snapshot(python_dir: Path, node_modules: Path) -> dict | None:
    """Write python_dir/SNAPSHOT and python_dir/INDEX (file, size, sha256); None if it cannot be made."""
    out = python_dir / SNAPSHOT
    try:
        proc = subprocess.run(["node", str(HERE / "make_snapshot.mjs"), str(node_modules / "pyodide" / "pyodide.mjs"),
                               str(python_dir), str(out)], capture_output=True, check=True, timeout=600)
        made = json.loads(proc.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        out.unlink(missing_ok=True)
        (python_dir / INDEX).unlink(missing_ok=True)
        return None
    data = out.read_bytes()
    index = {"file": SNAPSHOT, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
             "heap_bytes": made["heap_bytes"], "not_imported": made["skipped"]}
    (python_dir / INDEX).write_text(json.dumps(index, indent=1))
    return index
