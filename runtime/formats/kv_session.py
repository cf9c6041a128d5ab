"""A saved KV session's file: a conversation's K/V blocks, as the pool stores them, with what they were computed by.

Layout: MAGIC, a little-endian u32 header length, the header (UTF-8 JSON), zero bytes up to a multiple of
ALIGN, then the body: each block's arrays in the header's `arrays` order, `block_bytes` a block. The header
names the package (its weights files' sha256), the pool (kv dtype, block size, layers, kv heads, head dim),
the adapter, the tokens whose full blocks follow, and the body's sha256. A file is restored only into the
pool of the same package and layout (runtime/core/kv_sessions.py); any other is refused by name.

Standard library only (the page's Pyodide could read one too).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

MAGIC = b"RUVLLM-KV\0"
VERSION = 1
ALIGN = 64
# what must equal the restoring engine's, field by field, for the K/V to be the ones it would compute
IDENTITY = ("package", "weights", "kv_dtype", "block_size", "num_layers", "kv_heads", "head_dim", "arrays",
            "block_bytes")


class SessionFileError(ValueError):
    """Not a saved session, or a damaged one."""


def write(path: str | Path, header: dict, blocks: list[bytes]) -> int:
    """Write a session file atomically (a temporary file renamed); returns the bytes written."""
    body = b"".join(blocks)
    if any(len(b) != header["block_bytes"] for b in blocks):
        raise ValueError("every block must take block_bytes")
    meta = json.dumps({**header, "version": VERSION, "blocks": len(blocks),
                       "sha256": hashlib.sha256(body).hexdigest()}, separators=(",", ":")).encode("utf-8")
    head = MAGIC + struct.pack("<I", len(meta)) + meta
    head += b"\0" * (-len(head) % ALIGN)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(body)
    tmp.replace(path)
    return len(head) + len(body)


def read_header(path: str | Path) -> tuple[dict, int]:
    """The header of a session file and where its body starts; SessionFileError if it is not one."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 4)
        if len(start) < len(MAGIC) + 4 or not start.startswith(MAGIC):
            raise SessionFileError(f"{path} is not a saved KV session")
        (size,) = struct.unpack("<I", start[len(MAGIC):])
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError as err:
        raise SessionFileError(f"{path}: its header is damaged ({err})") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise SessionFileError(f"{path}: a saved KV session of version {header.get('version') if isinstance(header, dict) else '?'}"
                               f", this RuvLLM reads version {VERSION}")
    offset = len(MAGIC) + 4 + size
    return header, offset + (-offset % ALIGN)


def read_blocks(path: str | Path, header: dict, offset: int) -> list[bytes]:
    """The body's blocks, checked against the header's sha256."""
    with open(path, "rb") as f:
        f.seek(offset)
        body = f.read()
    n, size = header["blocks"], header["block_bytes"]
    if len(body) != n * size or hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise SessionFileError(f"{path}: its K/V are damaged (length or sha256 differ from its header's)")
    return [body[i * size:(i + 1) * size] for i in range(n)]


def mismatches(saved: dict, here: dict) -> list[str]:
    """The identity fields in which a saved header differs from the restoring engine's."""
    return [k for k in IDENTITY if saved.get(k) != here.get(k)]
