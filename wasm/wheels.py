"""Pure-Python wheels for Pyodide, written directly: our runtime, and markupsafe from its sdist.

A wheel is a zip with a dist-info folder; building it here (rather than through a build backend)
keeps the bytes, and so the lock file's sha256, the same for the same sources.
"""

from __future__ import annotations

import base64
import hashlib
import tarfile
import zipfile
from pathlib import Path

EPOCH = (2020, 1, 1, 0, 0, 0)  # fixed timestamps: reproducible archives


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def zip_entry(arc: str) -> zipfile.ZipInfo:
    """A deflated, world-readable entry with a fixed timestamp."""
    info = zipfile.ZipInfo(arc, EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def write_wheel(out_dir: Path, name: str, version: str, files: dict[str, bytes],
                requires: list[str] = ()) -> Path:
    """files maps archive paths (e.g. 'runtime/core/engine.py') to contents."""
    dist = f"{name.lower().replace('-', '_')}-{version}"
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
    meta += [f"Requires-Dist: {r}\n" for r in requires]
    entries = dict(sorted(files.items()))
    entries[f"{dist}.dist-info/METADATA"] = "".join(meta).encode()
    entries[f"{dist}.dist-info/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: ruvllm-wasm\nRoot-Is-Purelib: true\n"
                                          b"Tag: py3-none-any\n")
    record = "".join(f"{p},{record_hash(d)},{len(d)}\n" for p, d in entries.items())
    entries[f"{dist}.dist-info/RECORD"] = (record + f"{dist}.dist-info/RECORD,,\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in entries.items():
            z.writestr(zip_entry(arc), data)
    return path


def package_files(root: Path, package: str, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every .py (and py.typed) file of a package folder, by archive path."""
    out = {}
    for f in sorted((root / package).rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and (f.suffix == ".py" or f.name == "py.typed") and "__pycache__" not in rel \
                and not any(rel.startswith(s) for s in skip):
            out[rel] = f.read_bytes()
    return out


def markupsafe_from_sdist(sdist: Path, out_dir: Path) -> Path:
    """markupsafe without its C speedups (Pyodide cannot load a Linux extension): the sdist's .py files."""
    version = sdist.name[len("markupsafe-"):-len(".tar.gz")]
    files = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isfile() and parts[1:3] == ["src", "markupsafe"] and (
                    member.name.endswith(".py") or member.name.endswith("py.typed")):
                files["markupsafe/" + "/".join(parts[3:])] = tar.extractfile(member).read()
    if "markupsafe/__init__.py" not in files:
        raise RuntimeError(f"{sdist}: no src/markupsafe/__init__.py inside")
    return write_wheel(out_dir, "MarkupSafe", version, files)
