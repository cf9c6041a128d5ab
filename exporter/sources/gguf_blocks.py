"""A GGUF file's quantized tensors as grids, carried into the package exactly instead of re-quantized.

A Q4_1 file dequantized to fp32 and quantized again (AWQ or RTN) loses a second time what the file
lost once: SmolLM2's int4 package was 22% worse in perplexity than its own source. Here every block of
the file becomes the same block on MatMulNBits' grid, so the weights the graph computes with are
bit-equal to gguf's own dequantization:

| GGUF type | the file's arithmetic | grid |
|---|---|---|
| Q4_0 | d * (q - 8), blocks of 32 | 4 bits, zero point 8, scale d |
| Q4_1 | d * q + m, blocks of 32 | 4 bits, zero point 0, scale d, minimum m |
| Q4_K | d*sc * q - dmin*m, sub-blocks of 32 (6-bit sc, m) | 4 bits, scale d*sc, minimum -dmin*m (fp32) |
| Q5_0 / Q5_1 | d * (q - 16) / d * q + m, blocks of 32 | 8 bits (5 used), like Q4_0 / Q4_1 |
| Q5_K | like Q4_K with 5-bit q | 8 bits (5 used), like Q4_K |
| Q6_K | d*sc * (q - 32), sub-blocks of 16 (int8 sc) | 8 bits (6 used), zero point 32, scale d*sc |
| Q8_0 | d * q, blocks of 32 (int8 q) | 8 bits, zero point 128, q + 128 |
| Q3_K | d*(sc-32) * ((q&3) - (mask ? 0 : 4)), sub-blocks of 16 | 4 bits (3 used), zero point 4, mask as bit 2 |
| Q2_K | d*sc * q - dmin*m, sub-blocks of 16 (4-bit sc, m) | 4 bits (2 used), like Q4_K |

Every product and sum above is exact in fp32 or is the same single rounding gguf makes, and `read`
checks each grid against the weights transformers loaded (gguf's dequantization) bit for bit, which
also finds the row order transformers gives q/k (llama.cpp stores them permuted for its rotary).
Other types (F16, BF16, F32, the IQ types) are not grids here: the caller quantizes those
tensors with its own recipe and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from exporter.quantizers.grid import Grid, fp16_exact
from runtime.errors import RuvLLMError
from runtime.formats.block_types import BY_NAME

QK = 256  # a K-quant super-block


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # [n, 1]


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """[n, bytes] -> [n, groups * 2 * half]: each group of `half` bytes holds elements 0..half-1 in its
    low nibbles and half..2*half-1 in its high ones (llama.cpp's layout for Q4 and the low bits of Q5)."""
    n = qs.shape[0]
    g = qs.reshape(n, -1, 1, half) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (g & 15).reshape(n, -1)


def _q4_0(b):
    return _nibbles(b[:, 2:], 16), _f16(b, 0), 8, None, 32, 4


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b, 0), 0, _f16(b, 2), 32, 4


def _q5_high(qh: np.ndarray) -> np.ndarray:
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & 1).astype(np.uint8) << 4


def _q5_0(b):
    return _nibbles(b[:, 6:], 16) | _q5_high(b[:, 2:6]), _f16(b, 0), 16, None, 32, 8


def _q5_1(b):
    return _nibbles(b[:, 8:], 16) | _q5_high(b[:, 4:8]), _f16(b, 0), 0, _f16(b, 2), 32, 8


def _k_scales(b):
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * m.astype(np.float32))


def _q4_k(b):
    scale, mins = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scale, 0, mins, 32, 4


def _q5_k(b):
    scale, mins = _k_scales(b)
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _nibbles(b[:, 48:], 32) | ((qh & 1) << 4).reshape(n, -1), scale, 0, mins, 32, 8


def _q6_k(b):
    n = b.shape[0]
    ql = (b[:, :128].reshape(n, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ql.reshape(n, -1, 32) | (qh.reshape(n, -1, 32) << 4)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q.reshape(n, -1), _f16(b, 208) * sc, 32, None, 16, 8


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """[n, 64] -> [n, 256]: Q2_K's and Q3_K's low 2 bits (each 32 bytes hold 4 runs of 32 at shifts 0, 2, 4, 6)."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, -1)


def _q2_k_parts(b):
    """q (0..3), d, dmin, sc and m (4 bits each, per 16): w = d * sc * q - dmin * m."""
    return _two_bits(b[:, 16:80]), _f16(b, 80), _f16(b, 82), b[:, :16] & 15, b[:, :16] >> 4


def _q2_k(b):
    q, d, dmin, sc, m = _q2_k_parts(b)
    return q, d * sc.astype(np.float32), 0, -(dmin * m.astype(np.float32)), 16, 4


def _q3_k_parts(b):
    """q (0..7: the low 2 bits, and the high mask as bit 2), d, and the 6-bit scales less 32 (int8, per 16):
    w = d * sc * (q - 4), gguf's d * sc * ((q & 3) - (mask ? 0 : 4))."""
    n = b.shape[0]
    high = (b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _two_bits(b[:, 32:96]) | (high.reshape(n, -1) << 2)
    low = (b[:, 96:104].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16) & 15
    top = (b[:, 104:108].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16) & 3
    return q, _f16(b, 108), ((low | (top << 4)).astype(np.int16) - 32).astype(np.int8)


def _q3_k(b):
    q, d, sc = _q3_k_parts(b)
    return q, d * sc.astype(np.float32), 4, None, 16, 4


def _q8_0(b):
    q = (b[:, 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, _f16(b, 0), 128, None, 32, 8


def q4_k_parts(data: np.ndarray, rows: int, cols: int):
    """A Q4_K tensor's own parts, nothing computed: q uint8 [rows, cols], d and dmin fp16 [rows, cols/256],
    the 6-bit scales and minimums uint8 [rows, cols/32] (w = d * sc * q - dmin * m per block of 32)."""
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, 144)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    f16 = lambda at: b[:, at:at + 2].copy().view(np.float16).reshape(rows, -1)  # noqa: E731
    return (_nibbles(b[:, 16:], 32).reshape(rows, cols), f16(0), f16(2),
            sc.astype(np.uint8).reshape(rows, -1), m.astype(np.uint8).reshape(rows, -1))


def q6_k_parts(data: np.ndarray, rows: int, cols: int):
    """A Q6_K tensor's own parts: q uint8 [rows, cols] (0..63), d fp16 [rows, cols/256], the int8 scales
    [rows, cols/16] (w = d * sc * (q - 32) per block of 16)."""
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, 210)
    q, _, _, _, _, _ = _q6_k(b)
    return (q.reshape(rows, cols).astype(np.uint8), b[:, 208:210].copy().view(np.float16).reshape(rows, -1),
            b[:, 192:208].copy().view(np.int8).reshape(rows, -1))


def q5_k_parts(data: np.ndarray, rows: int, cols: int):
    """A Q5_K tensor's own parts: as q4_k_parts, with q's fifth bit (0..31)."""
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, 176)
    n = b.shape[0]
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:], 32) | ((qh & 1) << 4).reshape(n, -1)
    f16 = lambda at: b[:, at:at + 2].copy().view(np.float16).reshape(rows, -1)  # noqa: E731
    return (q.reshape(rows, cols).astype(np.uint8), f16(0), f16(2), sc.astype(np.uint8).reshape(rows, -1),
            m.astype(np.uint8).reshape(rows, -1))


def k_parts(type_name: str, data: np.ndarray, rows: int, cols: int):
    """A Q2_K or Q3_K tensor's own parts (_q2_k_parts, _q3_k_parts), shaped per row."""
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, BY_NAME[type_name].nbytes)
    parts = (_q2_k_parts if type_name == "Q2_K" else _q3_k_parts)(b)
    shaped = [parts[0].reshape(rows, cols).astype(np.uint8)]
    for a in parts[1:]:
        shaped.append(a.astype(np.float16) if a.dtype == np.float32 else a)  # d, dmin: fp16 in the file
    return tuple(x.reshape(rows, -1) for x in shaped)


def own_parts(type_name: str, data: np.ndarray, rows: int, cols: int) -> tuple:
    """A tensor's own parts, as runtime.backends.block_layouts.own_layout takes them: q [rows, cols] and the
    type's scales (Q4_K, Q5_K, Q2_K: d, dmin, sc, m; Q6_K, Q3_K: d, sc; Q4_0, Q5_0: d; Q4_1, Q5_1: d, m),
    nothing computed."""
    if type_name in ("Q2_K", "Q3_K"):
        return k_parts(type_name, data, rows, cols)
    if type_name == "Q4_K":
        return q4_k_parts(data, rows, cols)
    if type_name == "Q5_K":
        return q5_k_parts(data, rows, cols)
    if type_name == "Q6_K":
        return q6_k_parts(data, rows, cols)
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, BY_NAME[type_name].nbytes)
    q, d, _, mins, _, _ = DECODERS[type_name](blocks)  # d and m: fp16 in the file, widened exactly
    half = lambda a: a.astype(np.float16).reshape(rows, -1)  # noqa: E731
    return (q.reshape(rows, cols).astype(np.uint8), half(d)) + (() if mins is None else (half(mins),))


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q5_K": _q5_k,
            "Q6_K": _q6_k, "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k}


def decode(data: np.ndarray, type_name: str, rows: int, cols: int) -> Grid:
    """One GGUF tensor's raw blocks ([rows, bytes] as GGUFReader gives them) as a Grid [rows, cols]."""
    block_bytes = BY_NAME[type_name].nbytes
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    q, scale, zero, mins, sub, bits = DECODERS[type_name](blocks)
    nsub = cols // sub
    scale = np.ascontiguousarray(scale.reshape(rows, nsub), np.float32)
    return Grid(q.reshape(rows, cols).astype(np.uint8), scale, np.full((rows, nsub), zero, np.uint8), sub, bits,
                None if mins is None else np.ascontiguousarray(mins.reshape(rows, nsub), np.float32))


@dataclass
class GgufWeights:
    grids: dict[str, Grid]  # by Hugging Face weight name, rows in transformers' order
    types: dict[str, str]  # every matrix weight's GGUF type, by Hugging Face name (grid or not)


def read(path: str, weights: dict[str, np.ndarray], num_layers: int) -> GgufWeights:
    """The file's quantized matrices as grids, each checked bit for bit against `weights` (what
    transformers loaded, by Hugging Face name, [out, in] float32)."""
    import gguf

    from exporter.sources.gguf_mapped import MappedGGUF

    reader = MappedGGUF(path)
    arch_name = reader.architecture
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise RuvLLMError(f"{path}: GGUF architecture {arch_name!r} is unknown to the gguf package")
    names = gguf.get_tensor_name_map(arch, num_layers)
    tensors = {t.name: t for t in reader.tensors}
    grids, types = {}, {}
    for hf_name, w in weights.items():
        if w.ndim != 2 or not hf_name.endswith(".weight"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
        t = tensors.get(gguf_name or "")
        if t is None:
            continue
        types[hf_name] = t.tensor_type.name
        if t.tensor_type.name not in DECODERS:
            continue
        grid = decode(t.data, t.tensor_type.name, *w.shape)
        grids[hf_name] = _in_order_of(grid, w, hf_name, gguf_name)
    return GgufWeights(grids, types)


def _in_order_of(grid: Grid, want: np.ndarray, hf_name: str, gguf_name: str) -> Grid:
    """The grid with its rows in `want`'s order, which must be its dequantization bit for bit."""
    have = grid.dequantize()
    if have.shape != want.shape:
        raise RuvLLMError(f"{gguf_name}: {have.shape} in the file, {want.shape} in transformers' {hf_name}")
    want = np.ascontiguousarray(want, np.float32)
    if not np.array_equal(have.view(np.uint32), want.view(np.uint32)):
        where: dict[bytes, list[int]] = {}
        for i, row in enumerate(have):
            where.setdefault(row.tobytes(), []).append(i)
        order = []
        for row in want:
            found = where.get(row.tobytes())
            if not found:
                raise RuvLLMError(f"{gguf_name}: transformers' {hf_name} is not the file's dequantization "
                                  f"(no row of the file matches it bit for bit)")
            order.append(found.pop())
        idx = np.array(order)
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        grid = Grid(grid.q[idx], grid.scale[idx], grid.zero[idx], grid.block, grid.bits, pick(grid.mins))
    return grid


@dataclass
class GraphGrids:
    """What the decoder graph carries from the file."""

    projections: dict[str, Grid]  # by the graph's weight name (exporter.builders.FUSED_PROJECTIONS, "lm_head")
    embedding: Grid | None  # the embedding table, gathered and dequantized by row in the graph
    requantized: list[str]  # Hugging Face names of matrices not carried over (types without a grid here)


def graph_grids(gw: GgufWeights, num_layers: int, bits: int, tied: bool, exact_head: bool) -> GraphGrids:
    """The file's grids under the graph's names, fused as the graph fuses them, widened to `bits` where
    they are narrower (int8 packages). exact_head: the LM head is the file's own (else the caller
    quantizes a coarse head and rescores its best candidates from the exact table).

    An int8 package does not carry narrower grids with minimums (Q4_1, Q4_K, Q5_1, Q5_K): on an 8-bit
    grid their minimum term meets int8 activations in onnxruntime's kernel, which cost SmolLM2's Q4_1
    file +1.52% perplexity (KL 0.019), where RTN int8 of the same exact weights costs +0.39% (KL 0.0046),
    and is faster (docs/PERFORMANCE.md). They are re-quantized, listed as such in the manifest."""
    from exporter.builders import FUSED_PROJECTIONS
    from exporter.quantizers.grid import stack_rows

    widen = lambda g: g.with_bits(max(g.bits, bits))  # noqa: E731
    carried = {n: g for n, g in gw.grids.items() if not (bits == 8 and g.bits < 8 and g.mins is not None)}
    gw = replace(gw, grids=carried)
    out: dict[str, Grid] = {}
    requantized = sorted(name for name in gw.types if name not in gw.grids)
    for i in range(num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if all(n in gw.grids for n in names):
                out[f"layers.{i}.{fused}"] = widen(stack_rows([gw.grids[n] for n in names]))
            else:  # carried whole or not at all: a fused weight has one layout
                requantized += [n for n in names if n in gw.grids]
    embedding = gw.grids.get("model.embed_tokens.weight")
    head = embedding if tied else gw.grids.get("lm_head.weight")
    if head is not None and exact_head:
        out["lm_head"] = widen(head)
    return GraphGrids(out, embedding, sorted(set(requantized)))


def describe(grid) -> str:
    """A Grid's layout in words (or a block_matmul.GridLayout's: the grid as the graph stores it)."""
    if getattr(grid, "kquant", False):
        return " + ".join(dict.fromkeys(grid.kinds)) + " at the file's own bits"
    if isinstance(grid, Grid):
        kind = None if grid.mins is None else "fp16" if fp16_exact(grid.mins) else "fp32"
    else:
        kind = grid.mins
    mins = f", {kind} minimums" if kind else ""
    return f"{grid.bits}-bit, blocks of {grid.block}{mins}"
