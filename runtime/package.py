"""Reads and validates a model package before anything is loaded from it."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from runtime import contract as C
from runtime.errors import PackageError

REQUIRED_KEYS = ("format", "format_version", "architecture", "config", "graphs", "io", "kv_cache",
                 "tokenizer", "files")


@dataclass
class ModelPackage:
    path: Path
    manifest: dict

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def name(self) -> str:
        return self.manifest.get("name") or self.path.name

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def graph_path(self) -> Path:
        return self.file(self.manifest["graphs"]["decoder"]["file"])

    @property
    def lora_graph_path(self) -> Path | None:
        g = self.manifest["graphs"].get("decoder_lora")
        return self.file(g["file"]) if g else None

    @property
    def io_roles(self) -> dict:
        """Which graph input or output plays each part of a step (runtime.contract.io_roles); packages
        exported before the manifest carried it follow the same contract."""
        return self.manifest["io"].get("roles") or C.io_roles(self.config["num_layers"])

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest.get("special_tokens", {}).get("eos_token_ids", []))

    @property
    def chat_template(self) -> str | None:
        name = self.manifest.get("chat_template")
        return self.file(name).read_text(encoding="utf-8") if name else None

    @property
    def session_config(self) -> dict:
        """onnxruntime session config entries the graphs need (the browser weight format sets one)."""
        return dict((self.manifest.get("quantization") or {}).get("session_config") or {})

    @property
    def weights_quantized(self) -> bool:
        """Whether the projections' weights are int4 or int8 (not fp32/fp16)."""
        return (self.manifest.get("quantization") or {}).get("weights") in ("int4", "int8")

    def size_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.manifest["files"].values())


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


CHUNK_BYTES = 1 << 24  # a large file's pieces, each with its own sha256 in the manifest


def file_entry(path: Path) -> dict:
    """A manifest's entry for a file: size and sha256, and for a file of more than one chunk each chunk's
    sha256 too, so that a page can check it piece by piece as it streams in, never holding it whole in
    JS (WebCrypto digests one buffer at a time)."""
    size, whole, pieces = path.stat().st_size, hashlib.sha256(), []
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK_BYTES), b""):
            whole.update(chunk)
            pieces.append(hashlib.sha256(chunk).hexdigest())
    entry = {"size": size, "sha256": whole.hexdigest()}
    if len(pieces) > 1:
        entry["chunks"] = {"bytes": CHUNK_BYTES, "sha256": pieces}
    return entry


def _verified_record(path: Path) -> Path:
    from runtime.aliases import cache_dir

    return cache_dir() / "verified" / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")


def verify_files(pkg: ModelPackage, record: bool = True) -> None:
    """Check every file's sha256 against the manifest, naming the first that differs.

    A file whose size, mtime and manifest digest match an earlier successful check (kept under the
    cache folder, keyed by the package's path) is not read again, so a second load is instant.
    """
    where = _verified_record(pkg.path)
    try:
        known = json.loads(where.read_text()) if record and where.exists() else {}
    except (OSError, ValueError):
        known = {}
    checked = {}
    for name, meta in pkg.manifest["files"].items():
        stamp = _stamp(pkg.path / name, meta["sha256"])
        if known.get(name) != stamp:
            if file_digest(pkg.path / name) != meta["sha256"]:
                raise PackageError(f"{pkg.path}: corrupt package, {name} does not match the sha256 in its manifest "
                                   "(re-export or re-download it; --no-verify skips this check)")
        checked[name] = stamp
    if record and checked != known:
        _keep_record(where, checked)


def record_verified(path: Path, manifest: dict) -> None:
    """Record a package's files as checked: for the exporter, which has just hashed the files it wrote
    into the manifest, so that the first load does not read them all again."""
    _keep_record(_verified_record(path), {name: _stamp(path / name, meta["sha256"])
                                          for name, meta in manifest["files"].items()})


def _stamp(path: Path, sha256: str) -> list:
    """What a verified record remembers of a file: its size, mtime and the digest it matched."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, sha256]


def _keep_record(where: Path, stamps: dict) -> None:
    keep_cache_file(where, json.dumps(stamps).encode())  # a read-only cache only costs the next load a re-check


def keep_cache_file(where: Path, data: bytes) -> bool:
    """Write a file under the cache folder whole or not at all (a temporary file, then an atomic rename);
    False where it cannot be written, which only costs a later load the work the file would have saved."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(where)
    except OSError:
        return False
    return True


def expected_inputs(num_layers: int, lora: bool = False) -> list[str]:
    names = [name for name, _, _ in C.STEP_INPUTS]
    for i in range(num_layers):
        names += [C.past_key(i), C.past_value(i)]
    if lora:
        names.append(C.LORA_WEIGHTS)
    return names


def expected_outputs(num_layers: int) -> list[str]:
    return list(C.GRAPH_OUTPUTS)


def load_package(path: str | Path, verify_hashes: bool = False, elsewhere: tuple[str, ...] = ()) -> ModelPackage:
    """Validate format, version, files (sizes; sha256 on request, see verify_files) and the declared graph I/O.

    elsewhere names files that are not in the folder because another part holds them (in the page,
    the graphs live in onnxruntime-web; the loader checked their sha256 when it fetched them).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise PackageError(f"{path}: no such model package (path does not exist)")
    if not p.is_dir():
        raise PackageError(f"{path}: a model package is a folder with a {C.MANIFEST}")
    mpath = p / C.MANIFEST
    if not mpath.exists():
        raise PackageError(f"{path}: not a RuvLLM model package (no {C.MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PackageError(f"{path}: corrupt {C.MANIFEST}: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != C.FORMAT_NAME:
        raise PackageError(f"{path}: not a RuvLLM model package (manifest format is "
                           f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("format_version")
    if version not in C.READABLE_FORMAT_VERSIONS:
        readable = ", ".join(str(v) for v in C.READABLE_FORMAT_VERSIONS)
        raise PackageError(f"{path}: package format version {version} is not supported "
                           f"(this runtime reads versions {readable}); re-export it")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise PackageError(f"{path}: corrupt manifest, missing {', '.join(missing)}")
    for name, meta in manifest["files"].items():
        if name in elsewhere:
            continue
        f = p / name
        if not f.exists():
            raise PackageError(f"{path}: corrupt package, file {name} is missing")
        if f.stat().st_size != int(meta["size"]):
            raise PackageError(f"{path}: corrupt package, {name} has {f.stat().st_size} bytes, "
                               f"manifest says {meta['size']}")
    for g in manifest["graphs"].values():
        if g["file"] not in manifest["files"]:
            raise PackageError(f"{path}: corrupt manifest, graph {g['file']} is not listed in files")
    n = manifest["config"].get("num_layers")
    declared = [i["name"] for i in manifest["io"].get("inputs", [])]
    if declared not in (expected_inputs(n), expected_inputs(n) + [C.LOGITS_MASK]):  # older graphs: no mask
        raise PackageError(f"{path}: graph inputs do not follow the I/O contract of format {C.FORMAT_VERSION}")
    if manifest["io"].get("outputs") != expected_outputs(n):
        raise PackageError(f"{path}: graph outputs do not follow the I/O contract of format {C.FORMAT_VERSION}")
    pkg = ModelPackage(p, manifest)
    if verify_hashes:
        verify_files(pkg)
    return pkg
