"""Weight layouts the exporter writes for RuvLLM's CPU kernels, and their portable form (native only: numpy).

A GGUF's Q4_K reaches the package at its own bits in the layout ruvllm.MatMulQ4 computes on (its
k-quant mode, runtime/backends/kernels/matmul_q4.h), so that a package is about the size of its GGUF
and nothing is unpacked to 8 bits or fp32 scales: per tile of 16 output columns, the 4-bit weights
interleaved as the kernel reads them, per block of 32 each column's 6-bit scale and minimum as bytes,
per super-block of 256 its fp16 d and dmin (4.625 bits a weight; the file's 4.5). A host without the
kernels (no AVX2, RUVLLM_CPU_KERNELS=0, another execution provider) gets the same weights as a
MatMulNBits grid and its block-minimum term, unpacked at load (graph_rewrite/portable.py).

The MatMulNBits side (`GridLayout`, `nbits_names`, `nbits_nodes`, `pack_4bit`) is shared with the
exporter's block_matmul.py, which writes it for the types the kernels do not read at their own bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.formats.block_types import BY_KIND, GRID_KIND, OWN, SUPER, own_sections  # noqa: F401 (readers import them here)

MS_DOMAIN, DOMAIN = "com.microsoft", "ruvllm"
TILE, BLOCK = 16, 32


# ---- MatMulNBits: a grid x . ((q - z) * s) (+ the blocks' minimums times their activation sums) ----

@dataclass(frozen=True)
class GridLayout:
    """What a graph needs of a grid to wire its MatMulNBits (its numbers aside)."""

    n: int
    k: int
    bits: int
    block: int
    mins: str | None  # None, "fp16" (held exactly) or "fp32"


def nbits_names(w: str, layout: GridLayout) -> dict[str, str]:
    """The initializers of weight `w`'s grid, by role."""
    names = {"q": f"{w}_Q{layout.bits}", "scales": f"{w}_scales", "zero_points": f"{w}_zero_points"}
    if layout.mins:
        names["mins"] = f"{w}_mins_fp16" if layout.mins == "fp16" else f"{w}_mins"
        names["block_ones"] = f"{w}/block_ones"
    return names


def nbits_nodes(w: str, x: str, y: str, layout: GridLayout, accuracy_level: int = 4) -> list:
    """The nodes computing y = x . W for weight `w` on its grid (nbits_names' initializers): MatMulNBits,
    and for minimums `Gemm(MatMul(x, block_ones), mins, C=MatMulNBits(x))`."""
    from onnx import TensorProto, helper

    names = nbits_names(w, layout)
    out = y if not layout.mins else f"{w}/nbits_out"
    nodes = [helper.make_node("MatMulNBits", [x, names["q"], names["scales"], names["zero_points"]], [out],
                              name=f"{w}/MatMulNBits", domain=MS_DOMAIN, K=layout.k, N=layout.n, bits=layout.bits,
                              block_size=layout.block, accuracy_level=accuracy_level)]
    if layout.mins:
        mins = f"{w}_mins"
        if layout.mins == "fp16":
            nodes.append(helper.make_node("Cast", [names["mins"]], [mins], name=f"{w}/mins_fp32", to=TensorProto.FLOAT))
        nodes += [helper.make_node("MatMul", [x, names["block_ones"]], [f"{w}/block_sums"], name=f"{w}/block_sums"),
                  helper.make_node("Gemm", [f"{w}/block_sums", mins, out], [y], name=f"{w}/add_mins")]
    return nodes


def block_ones(k: int, block: int) -> np.ndarray:
    """[K, blocks]: column b sums block b's activations."""
    return np.kron(np.eye(k // block, dtype=np.float32), np.ones((block, 1), np.float32))


def pack_4bit(q: np.ndarray, zero: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' 4-bit B [N, blocks, block/2] (low nibble first) and zero points [N, ceil(blocks/2)]."""
    out_f, in_f = q.shape
    pad = -in_f % block
    q = (np.pad(q, ((0, 0), (0, pad))) if pad else q).reshape(out_f, -1, block)
    b = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    z = zero if zero.shape[1] % 2 == 0 else np.pad(zero, ((0, 0), (0, 1)))
    return b, (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)



def unpack_4bit(packed: np.ndarray, cols: int) -> np.ndarray:
    """pack_4bit's bytes (B or zero points; low nibble first) back to one integer a byte, [rows, cols]: the
    rows are packed's first axis, its padding (an odd count of zero points) dropped."""
    rows = packed.shape[0]
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(rows, -1)[:, :cols]

# ---- a GGUF's block types at their own bits, for ruvllm.MatMulQ4 (kquant = OWN[type].kind): OWN, BY_KIND and
# own_sections are runtime/formats/block_types.py's, from which kernels/block_types.h is generated ----


def own_bytes(name: str, n: int, k: int) -> int:
    return sum(own_sections(OWN[name], n, k))


def _lanes(q: np.ndarray, block: int) -> np.ndarray:
    """q [N, K] as the kernel's registers see it: [tiles, blocks, groups, 2 (low, high nibble), 64 lanes],
    lane 4j + i holding column j's k = 8g + i (+ 4 in the high nibble register)."""
    n, k = q.shape
    qq = q.reshape(n // TILE, TILE, k // block, block // 8, 2, 4)  # [t, j, b, g, h, i]
    return qq.transpose(0, 2, 3, 4, 1, 5).reshape(n // TILE, k // block, block // 8, 2, 64)


def _from_lanes(lanes: np.ndarray, n: int, k: int) -> np.ndarray:
    """_lanes' inverse: q [N, K]."""
    tiles, nblk, groups = lanes.shape[:3]
    return lanes.reshape(tiles, nblk, groups, 2, TILE, 4).transpose(0, 4, 1, 2, 3, 5).reshape(n, k).astype(np.uint8)


def own_layout(name: str, q: np.ndarray, *scales: np.ndarray) -> np.ndarray:
    """The kernel's bytes for a matrix of GGUF type `name` from its parts (q uint8 [N, K], then the type's
    scales: see BlockType.scales; fp16 d, dmin and m, uint8 sc and m, int8 Q6_K and Q3_K sc). Per tile of 16
    columns and block, each of the type's fields (BlockType.fields) as lines, all groups of one field, then the
    next: 4 bits, 64 bytes a group (byte 4j + i: the low register's lane 4j + i | the high one's << 4, the
    low register holding column j's k = 8g + i, the high one k = 8g + 4 + i); 2 bits, 32 bytes a group
    (byte p: lanes p and p + 32 of the low register, then of the high one); 1 bit, 16 bytes a group (bit q
    of byte p: lane 16q + p of the low register, bit 4 + q of the high one). Then the scale bytes, then the
    fp16 scales, each [tile, block (or super-block of 256), ..., column]."""
    t = OWN[name]
    n, k = q.shape
    if n % TILE or k % t.superblock:
        raise ValueError(f"{name} at its own bits needs N a multiple of {TILE} and K of {t.superblock} (got {n} x {k})")
    if t.op == "MatMulQ8":
        bytes_ = (q.astype(np.int16) - t.zero).astype(np.int8).view(np.uint8)
        lines = bytes_.reshape(n // TILE, TILE, k // t.block, t.block // 4, 4).transpose(0, 2, 3, 1, 4)  # [t, b, g, j, i]
        d = scales[0].reshape(n // TILE, TILE, -1).transpose(0, 2, 1).astype(np.float16)  # [t, b, j]
        return np.concatenate([lines.reshape(-1), np.ascontiguousarray(d).reshape(-1).view(np.uint8)])
    lanes = _lanes(q, t.block)
    tiles, nblk = lanes.shape[:2]
    lines = []
    for width, at in t.fields:
        f = (lanes >> at) & ((1 << width) - 1)  # [t, b, g, 2, 64]
        if width == 4:
            lines.append(f[..., 0, :] | (f[..., 1, :] << 4))
        elif width == 2:
            lines.append(f[..., 0, :32] | (f[..., 0, 32:] << 2) | (f[..., 1, :32] << 4) | (f[..., 1, 32:] << 6))
        else:
            lo4, hi4 = (f[..., h, :].reshape(*f.shape[:3], 4, 16) for h in (0, 1))  # [t, b, g, q, p]
            shift = np.arange(4, dtype=np.uint8).reshape(1, 1, 1, 4, 1)
            lines.append(((lo4 << shift) | (hi4 << (shift + 4))).sum(axis=3, dtype=np.uint8))
    weights = np.concatenate([x.reshape(tiles, nblk, -1) for x in lines], axis=2).astype(np.uint8).reshape(-1)
    per_tile = lambda a: a.reshape(tiles, TILE, -1).transpose(0, 2, 1)  # noqa: E731  [t, blocks, j]
    if t.scales == "kquant":
        d, dmin, sc, m = scales
        parts = [np.stack([per_tile(sc), per_tile(m)], axis=2).astype(np.uint8),
                 np.stack([per_tile(d), per_tile(dmin)], axis=2).astype(np.float16)]
    elif t.scales == "kquant4":
        d, dmin, sc, m = scales
        parts = [per_tile(sc | (m << 4)).astype(np.uint8), np.stack([per_tile(d), per_tile(dmin)], axis=2).astype(np.float16)]
    elif t.scales == "six":
        d, sc = scales
        parts = [per_tile(sc).astype(np.int8), per_tile(d).astype(np.float16)]
    elif t.scales == "half":
        parts = [per_tile(scales[0]).astype(np.float16)]
    else:
        d, m = scales
        parts = [np.stack([per_tile(d), per_tile(m)], axis=2).astype(np.float16)]
    return np.concatenate([weights] + [np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts])


def own_parts(name: str, blob: np.ndarray, n: int, k: int) -> tuple:
    """own_layout's inverse: (q, *scales)."""
    t = OWN[name]
    tiles, nblk, groups = n // TILE, k // t.block, t.block // 8
    w_bytes, sc_bytes, _ = own_sections(t, n, k)
    if t.op == "MatMulQ8":
        lines = blob[:w_bytes].reshape(tiles, nblk, t.block // 4, TILE, 4).view(np.int8)
        q = (lines.transpose(0, 3, 1, 2, 4).reshape(n, k).astype(np.int16) + t.zero).astype(np.uint8)
        d = blob[w_bytes:].view(np.float16).reshape(tiles, nblk, TILE).transpose(0, 2, 1).reshape(n, nblk)
        return q, d
    blocks = blob[:w_bytes].reshape(tiles, nblk, -1)
    lanes = np.zeros((tiles, nblk, groups, 2, 64), np.uint8)
    start = 0
    for width, at in t.fields:
        line = blocks[..., start:start + groups * 16 * width].reshape(tiles, nblk, groups, 16 * width)
        start += groups * 16 * width
        if width == 4:
            f = np.stack([line & 15, line >> 4], axis=3)
        elif width == 2:
            f = np.stack([np.concatenate([line & 3, (line >> 2) & 3], axis=-1),
                          np.concatenate([(line >> 4) & 3, line >> 6], axis=-1)], axis=3)
        else:
            h = line.reshape(tiles, nblk, groups, 1, 16)
            bit = np.arange(4, dtype=np.uint8).reshape(1, 1, 1, 4, 1)
            f = np.stack([((h >> bit) & 1).reshape(tiles, nblk, groups, 64),
                          ((h >> (bit + 4)) & 1).reshape(tiles, nblk, groups, 64)], axis=3)
        lanes |= f << at
    q = _from_lanes(lanes, n, k)
    rest = blob[w_bytes:]
    rows = lambda a, count: a.reshape(tiles, -1, count, TILE).transpose(0, 3, 1, 2).reshape(n, -1, count)  # noqa: E731
    if t.scales == "kquant":
        scm = rows(rest[:sc_bytes], 2)
        dm = rows(rest[sc_bytes:].view(np.float16), 2)
        return q, dm[..., 0], dm[..., 1], scm[..., 0], scm[..., 1]
    if t.scales == "kquant4":
        scm = rows(rest[:sc_bytes], 1)[..., 0]
        dm = rows(rest[sc_bytes:].view(np.float16), 2)
        return q, dm[..., 0], dm[..., 1], scm & 15, scm >> 4
    if t.scales == "six":
        return q, rows(rest[sc_bytes:].view(np.float16), 1)[..., 0], rows(rest[:sc_bytes].view(np.int8), 1)[..., 0]
    if t.scales == "half":
        return q, rows(rest.view(np.float16), 1)[..., 0]
    dm = rows(rest.view(np.float16), 2)
    return q, dm[..., 0], dm[..., 1]


def own_grid(name: str, blob: np.ndarray, n: int, k: int):
    """The same weights as a grid: (q [N, K], scales fp32 [N, K/block], zero points uint8 or None,
    minimums fp32 or None) with w = scale * (q - zero) or scale * q + minimum, each the fp32 product gguf
    forms."""
    t, parts = OWN[name], own_parts(name, blob, n, k)
    q = parts[0]
    per_block = lambda a: np.repeat(a.astype(np.float32), SUPER // t.block, axis=1)  # noqa: E731 (super-block -> block)
    if t.scales in ("kquant", "kquant4"):
        _, d, dmin, sc, m = parts
        return q, per_block(d) * sc.astype(np.float32), None, -(per_block(dmin) * m.astype(np.float32))
    if t.scales == "six":
        _, d, sc = parts
        scale = per_block(d) * sc.astype(np.float32)
        return q, scale, np.full(scale.shape, t.zero, np.uint8), None
    if t.scales == "half":
        scale = parts[1].astype(np.float32)
        return q, scale, np.full(scale.shape, t.zero, np.uint8), None
    return q, parts[1].astype(np.float32), None, parts[2].astype(np.float32)


def dequantize_own(name: str, blob: np.ndarray, n: int, k: int) -> np.ndarray:
    """The matrix [N, K] in fp32, as gguf dequantizes it."""
    return dequantize_node({"N": n, "K": k, "kquant": OWN[name].kind}, blob)


# ---- an int4 grid (RTN, AWQ, GPTQ: zero points and fp32 scales) in the kernel's layout ----



def kernel_grid(node, inits: dict) -> GridLayout | None:
    """The grid of a MatMulNBits that RuvLLM's kernels compute as onnxruntime does (int8 compute; uint8
    weights, fp32 scales and uint8 zero points, all initializers; blocks a multiple of 32, N of 16), or None."""
    from onnx import TensorProto

    if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN or len(node.input) != 4:
        return None
    attrs = {a.name: a.i for a in node.attribute}
    layout = GridLayout(attrs.get("N", 0), attrs.get("K", 0), attrs.get("bits", 4), attrs.get("block_size", 0), None)
    weights = [inits.get(name) for name in node.input[1:]]
    if (attrs.get("accuracy_level", 0) != 4 or not layout.block or layout.block % BLOCK or layout.n % TILE
            or None in weights
            or [t.data_type for t in weights] != [TensorProto.UINT8, TensorProto.FLOAT, TensorProto.UINT8]):
        return None
    return layout


def grid_fits(layout: GridLayout) -> bool:
    """Whether ruvllm.MatMulQ4 reads this grid in its own layout: 4 bits, no minimums, whole tiles and blocks."""
    return (layout.bits == 4 and not layout.mins and layout.n % TILE == 0 and layout.block % BLOCK == 0
            and layout.k % layout.block == 0)


def grid_bytes(n: int, k: int, block: int) -> int:
    return n * k // 2 + n * (k // block) * 5


def grid_layout(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, block: int) -> np.ndarray:
    """The kernel's bytes for w = (q - zero) * scale in blocks of `block`, as the kernel would otherwise pack
    them at load (so that a load maps them): per tile of 16 columns and block, the 4-bit lines as
    own_layout writes them, then the fp32 scales, then the zero points, each [tile, block, column]."""
    n, k = q.shape
    lanes = _lanes(q, block)
    weights = (lanes[..., 0, :] | (lanes[..., 1, :] << 4)).astype(np.uint8).reshape(-1)
    del lanes

    def per_tile(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(n // TILE, TILE, -1).transpose(0, 2, 1)).reshape(-1)

    return np.concatenate([weights, per_tile(scale.astype(np.float32)).view(np.uint8), per_tile(zero.astype(np.uint8))])


def grid_parts(blob: np.ndarray, n: int, k: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """grid_layout's inverse: (q uint8 [N, K], scales fp32 [N, blocks], zero points uint8 [N, blocks])."""
    nblk, w = k // block, n * k // 2
    lines = blob[:w].reshape(n // TILE, nblk, block // 8, 64)
    q = _from_lanes(np.stack([lines & 15, lines >> 4], axis=3), n, k)

    def rows(a: np.ndarray) -> np.ndarray:
        return a.reshape(n // TILE, nblk, TILE).transpose(0, 2, 1).reshape(n, nblk)

    return q, rows(blob[w:w + n * nblk * 4].view(np.float32)), rows(blob[w + n * nblk * 4:grid_bytes(n, k, block)])


def node_layout(attrs: dict) -> GridLayout:
    """The MatMulNBits grid (and minimum term) a ruvllm.MatMulQ4/Q8 weight the exporter wrote becomes, from its
    attributes alone: an int4 grid's own block, or the type's block at 4 bits (8 above 4)."""
    n, k, kind = attrs["N"], attrs["K"], attrs["kquant"]
    if kind == GRID_KIND:
        return GridLayout(n, k, 4, attrs["block_size"], None)
    t = OWN[BY_KIND[kind]]
    return GridLayout(n, k, 4 if t.bits <= 4 else 8, t.block, "fp32" if t.mins else None)


def node_grid(attrs: dict, blob: np.ndarray) -> tuple:
    """A ruvllm.MatMulQ4/Q8 weight the exporter wrote (its attributes, its bytes) as a grid: (q [N, K], scales
    fp32 [N, blocks], zero points uint8 or None, minimums fp32 or None, block, bits of MatMulNBits)."""
    n, k, kind = attrs["N"], attrs["K"], attrs["kquant"]
    layout = node_layout(attrs)
    parts = grid_parts(blob, n, k, layout.block) + (None,) if kind == GRID_KIND else own_grid(BY_KIND[kind], blob, n, k)
    return (*parts, layout.block, layout.bits)


def dequantize_node(attrs: dict, blob: np.ndarray) -> np.ndarray:
    """node_grid's weights [N, K] in fp32."""
    q, scale, zero, mins, block, _ = node_grid(attrs, blob)
    n, k = q.shape
    qb = q.reshape(n, -1, block).astype(np.float32)
    w = (qb - zero[..., None]) * scale[..., None] if zero is not None else qb * scale[..., None] + mins[..., None]
    return w.reshape(n, k)
