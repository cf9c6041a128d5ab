"""A GGUF file's header (metadata and tensor index), read with the standard library alone, so the same
reader runs natively (the exporter's WASM-step writer) and in the page's Pyodide, where the file arrives
in byte ranges: `read_header(head)` needs only the file's first bytes and says how many more it needs.

The layout is GGUF v2/v3 as ggml's `gguf.cpp` writes it, little-endian: magic, version, tensor count,
metadata count; the metadata (key, value type, value); each tensor's name, dims (innermost first), type and
offset from the data section, which starts at the header's end rounded up to `general.alignment` (32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

from runtime.errors import PackageError
from runtime.formats.block_types import BLOCK_TYPES

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type ids -> struct format of one scalar (8: a string, 9: an array, read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
TYPES_BY_ID = {t.ggml: t for t in BLOCK_TYPES}


class NeedBytes(Exception):  # noqa: N818 (a request, not a failure)
    """The header runs past the bytes given: read again with at least `total` bytes of the file."""

    def __init__(self, total: int):
        super().__init__(f"the GGUF header needs {total} bytes")
        self.total = total


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: `shape` outermost first (rows, cols) as numpy and transformers have it."""

    name: str
    shape: tuple[int, ...]
    type_name: str  # a block_types name, or "ggml type N" for one RuvLLM does not know
    offset: int  # from the file's start
    nbytes: int  # 0 for a type RuvLLM does not know
    ggml: int = -1  # the file's type id


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]
    data_offset: int

    def field(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise PackageError("the GGUF names no general.architecture")
        return arch

    def arch_field(self, key: str, default=None):
        """`{architecture}.{key}`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


_U64 = struct.Struct("<Q").unpack_from


class _Cursor:
    def __init__(self, buf: bytes | bytearray | memoryview):
        self.buf = memoryview(buf)
        self.at = 0

    def take(self, n: int) -> memoryview:
        end = self.at + n
        if end > len(self.buf):
            # what is known to be needed; strings and arrays further on may ask again
            raise NeedBytes(max(end, 2 * len(self.buf)))
        out = self.buf[self.at:end]
        self.at = end
        return out

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in one loop: a vocabulary's (Gemma 3's 262,144 tokens) is most of a header."""
        buf, start, end, out = self.buf, self.at, len(self.buf), []
        at = start

        def more(needed: int) -> NeedBytes:  # the rest at the mean length so far, with a margin, and the
            # token scores and types (4 bytes a token each) that follow a vocabulary's tokens: one more read
            rest = (count - len(out)) * (at - start) // max(1, len(out))
            return NeedBytes(max(needed, 2 * end, at + rest * 5 // 4 + 8 * count + (1 << 20)))

        for _ in range(count):
            if at + 8 > end:
                raise more(at + 8)
            n = _U64(buf, at)[0]
            at += 8
            if at + n > end:
                raise more(at + n)
            out.append(str(buf[at:at + n], "utf-8", "replace"))
            at += n
        self.at = at
        return out

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item == STRING:
                return self.strings(count)
            if item == ARRAY:
                return [self.value(self.unpack("I")) for _ in range(count)]
            fmt = SCALARS.get(item)
            if fmt is None:
                raise PackageError(f"GGUF metadata: unknown value type {item}")
            size = struct.calcsize("<" + fmt)
            return list(struct.unpack(f"<{count}{fmt}", self.take(size * count)))
        fmt = SCALARS.get(kind)
        if fmt is None:
            raise PackageError(f"GGUF metadata: unknown value type {kind}")
        return self.unpack(fmt)


def tensor_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of a known block type: whole blocks along its innermost dim."""
    t = next((t for t in BLOCK_TYPES if t.name == type_name), None)
    if t is None:
        raise PackageError(f"a tensor of {type_name}: RuvLLM does not know its block size")
    count = 1
    for d in shape:
        count *= d
    if shape and shape[-1] % t.elems:
        raise PackageError(f"a {type_name} tensor of shape {list(shape)}: its rows are not whole blocks of {t.elems}")
    return count // t.elems * t.nbytes


def read_header(head: bytes | bytearray | memoryview) -> GGUFHeader:
    """The header of a GGUF file whose first bytes are `head`. NeedBytes when it runs past them (read that
    many and call again); PackageError for a file that is not a GGUF."""
    c = _Cursor(head)
    if bytes(c.take(4)) != MAGIC:
        raise PackageError("not a GGUF file (no GGUF magic at its start)")
    version = c.unpack("I")
    if version not in (2, 3):
        raise PackageError(f"GGUF version {version}: RuvLLM reads versions 2 and 3")
    n_tensors, n_meta = c.unpack("Q"), c.unpack("Q")
    metadata = {}
    for _ in range(n_meta):
        key = c.string()
        metadata[key] = c.value(c.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.unpack("Q") for _ in range(c.unpack("I"))]
        kind, offset = c.unpack("I"), c.unpack("Q")
        infos.append((name, tuple(reversed(dims)), kind, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-c.at // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in infos:
        t = TYPES_BY_ID.get(kind)
        type_name = t.name if t else f"ggml type {kind}"
        nbytes = tensor_bytes(type_name, shape) if t else 0
        tensors[name] = TensorInfo(name, shape, type_name, data_offset + offset, nbytes, kind)
    return GGUFHeader(version, metadata, tensors, data_offset)


def joined_header(parts: list[tuple[GGUFHeader, int]]) -> GGUFHeader:
    """A split GGUF (llama.cpp's gguf-split, `<name>-00001-of-0000N.gguf`: each part a GGUF with its share of
    the tensors, the first holding the metadata) as one file: [(each part's header, where the part begins
    when the parts are laid end to end)]. One whole file comes back as it is. PackageError for parts missing,
    out of order or of another model."""
    first = parts[0][0]
    count = int(first.field("split.count", 1))
    if count == 1 and len(parts) == 1:
        return first
    if count != len(parts):
        raise PackageError(f"a split GGUF of {count} parts: {len(parts)} given (give every part, the first first)")
    tensors: dict[str, TensorInfo] = {}
    for k, (header, base) in enumerate(parts):
        if int(header.field("split.no", -1)) != k:
            raise PackageError(f"part {k + 1} of the split GGUF is not its part {k + 1} (split.no {header.field('split.no')})")
        if int(header.field("split.count", -1)) != count:
            raise PackageError(f"part {k + 1} of the split GGUF belongs to a split of {header.field('split.count')} parts")
        for name, t in header.tensors.items():
            if name in tensors:
                raise PackageError(f"tensor {name} is in two parts of the split GGUF")
            tensors[name] = replace(t, offset=t.offset + base)
    want = first.field("split.tensors.count")
    if want is not None and int(want) != len(tensors):
        raise PackageError(f"the split GGUF's parts hold {len(tensors)} tensors; its first part says {want}")
    metadata = {k: v for k, v in first.metadata.items() if not k.startswith("split.")}
    return GGUFHeader(first.version, metadata, tensors, first.data_offset)


def read_header_file(path, first: int = 1 << 20) -> GGUFHeader:
    """The header of the GGUF file at `path`, read in growing pieces."""
    size = first
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            head = f.read(size)
            try:
                return read_header(head)
            except NeedBytes as more:
                if len(head) < size:  # the file ended first
                    raise PackageError(f"{path}: the GGUF header runs past the file's end (a truncated file)") from None
                size = more.total
