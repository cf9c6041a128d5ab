"""Weight layouts the exporter writes for RuvLLM's CPU kernels, and their portable form (native only: numpy).

A GGUF's Q4_K reaches the package at its own bits in the layout ruvllm.MatMulQ4 computes on (its
k-quant mode, runtime/backends/kernels/matmul_q4.h), so that a package is about the size of its GGUF
and nothing is unpacked to 8 bits or fp32 scales: per tile of 16 output columns, the 4-bit weights
interleaved as the kernel reads them, per block of 32 each column's 6-bit scale and minimum as bytes,
per super-block of 256 its fp16 d and dmin (4.625 bits a weight; the file's 4.5). A host without the
kernels (no AVX2, RUVLLM_CPU_KERNELS=0, another execution provider) gets the same weights as a
MatMulNBits grid and its block-minimum term, unpacked at load (`portable_graph`).

The MatMulNBits side (`GridLayout`, `nbits_names`, `nbits_nodes`, `pack_4bit`) is shared with the
exporter's block_matmul.py, which writes it for the types the kernels do not read at their own bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MS_DOMAIN, DOMAIN = "com.microsoft", "ruvllm"
TILE, BLOCK, SUPER = 16, 32, 256


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


# ---- Q4_K at its own bits, for ruvllm.MatMulQ4 (kquant=1) ----

def kquant_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16 + n * k // 64


def kquant_layout(q: np.ndarray, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The kernel's blob from a Q4_K matrix's parts: q uint8 [N, K] (0..15), d and dmin fp16 [N, K/256],
    sc and m uint8 [N, K/32] (0..63); w = d * sc * q - dmin * m per block of 32."""
    n, k = q.shape
    if n % TILE or k % SUPER:
        raise ValueError(f"a k-quant layout needs N a multiple of {TILE} and K of {SUPER} (got {n} x {k})")
    t, nblk, nsup = n // TILE, k // BLOCK, k // SUPER
    # k = 32 b + 8 g + 4 h + i: byte 4j + i of group g = q(k with h=0) | q(k with h=1) << 4
    qq = q.reshape(t, TILE, nblk, 4, 2, 4)
    nib = (qq[..., 0, :] | (qq[..., 1, :] << 4)).astype(np.uint8)  # [t, j, b, g, i]
    weights = nib.transpose(0, 2, 3, 1, 4).reshape(-1)  # [t, b, g, j, i]
    per_tile = lambda a: a.reshape(t, TILE, -1).transpose(0, 2, 1)  # noqa: E731  [t, blocks, j]
    scales = np.stack([per_tile(sc), per_tile(m)], axis=2).astype(np.uint8).reshape(-1)  # [t, b, 2, j]
    supers = np.stack([per_tile(d.astype(np.float16)), per_tile(dmin.astype(np.float16))], axis=2)  # [t, s, 2, j]
    assert supers.shape == (t, nsup, 2, TILE)
    return np.concatenate([weights, scales, supers.reshape(-1).view(np.uint8)])


def kquant_parts(blob: np.ndarray, n: int, k: int):
    """kquant_layout's inverse: (q, d, dmin, sc, m)."""
    t, nblk, nsup = n // TILE, k // BLOCK, k // SUPER
    a, b = n * k // 2, n * k // 2 + n * k // 16
    nib = blob[:a].reshape(t, nblk, 4, TILE, 4)  # [t, b, g, j, i]
    q = np.stack([nib & 15, nib >> 4], axis=3)  # [t, b, g, h, j, i]
    q = q.transpose(0, 4, 1, 2, 3, 5).reshape(n, k)  # [t, j, b, g, h, i]
    scales = blob[a:b].reshape(t, nblk, 2, TILE)
    sc, m = (scales[:, :, i, :].transpose(0, 2, 1).reshape(n, nblk) for i in range(2))
    supers = blob[b:].view(np.float16).reshape(t, nsup, 2, TILE)
    d, dmin = (supers[:, :, i, :].transpose(0, 2, 1).reshape(n, nsup) for i in range(2))
    return q, d, dmin, sc, m


def kquant_grid(blob: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same weights as a grid: (q [N, K], scales fp32 [N, K/32], minimums fp32 [N, K/32]) with
    w = scale * q + minimum, each the one fp32 product gguf computes."""
    q, d, dmin, sc, m = kquant_parts(blob, n, k)
    rep = lambda a: np.repeat(a.astype(np.float32), SUPER // BLOCK, axis=1)  # noqa: E731
    return q, rep(d) * sc.astype(np.float32), -(rep(dmin) * m.astype(np.float32))


# ---- Q6_K at its own bits, for ruvllm.MatMulQ4 (kquant=2) ----

def q6k_bytes(n: int, k: int) -> int:
    return n * k * 3 // 4 + n * k // 16 + n * k // 128


def q6k_layout(q: np.ndarray, d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """The kernel's blob from a Q6_K matrix's parts: q uint8 [N, K] (0..63), d fp16 [N, K/256], sc int8
    [N, K/16]; w = d * sc * (q - 32) per block of 16. Per tile and block of 16: two groups of 8 k, their
    64-byte nibble lines (as the 4-bit layout), then their 32-byte lines of high bits: byte p holds the two
    high bits of low-nibble lanes p and p + 32, then of high-nibble lanes p and p + 32 (lane 4j + i:
    column j, k = 8g + i, or 8g + 4 + i in the high nibbles). Lines stay aligned: a block is 192 bytes."""
    n, k = q.shape
    if n % TILE or k % SUPER:
        raise ValueError(f"a six-bit layout needs N a multiple of {TILE} and K of {SUPER} (got {n} x {k})")
    t, nblk = n // TILE, k // 16
    qq = q.reshape(t, TILE, nblk, 2, 2, 4)  # [t, j, b, g, h, i]
    lanes = qq.transpose(0, 2, 3, 4, 1, 5).reshape(t, nblk, 2, 2, 64)  # [t, b, g, h, lane 4j+i]
    nib = (lanes[:, :, :, 0] & 15) | ((lanes[:, :, :, 1] & 15) << 4)  # [t, b, g, 64]
    hi = lanes >> 4  # two bits
    high = (hi[:, :, :, 0, :32] | (hi[:, :, :, 0, 32:] << 2) | (hi[:, :, :, 1, :32] << 4)
            | (hi[:, :, :, 1, 32:] << 6))  # [t, b, g, 32]
    weights = np.concatenate([nib.reshape(t, nblk, -1), high.reshape(t, nblk, -1)], axis=2).astype(np.uint8).reshape(-1)
    per_tile = lambda a: a.reshape(t, TILE, -1).transpose(0, 2, 1)  # noqa: E731  [t, blocks, j]
    scales = per_tile(sc.astype(np.int8)).reshape(-1).view(np.uint8)
    supers = per_tile(d.astype(np.float16)).reshape(-1).view(np.uint8)
    return np.concatenate([weights, scales, supers])


def q6k_parts(blob: np.ndarray, n: int, k: int):
    """q6k_layout's inverse: (q, d, sc)."""
    t, nblk, nsup = n // TILE, k // 16, k // SUPER
    a, b = n * k * 3 // 4, n * k * 3 // 4 + n * k // 16
    blocks = blob[:a].reshape(t, nblk, 192)
    nib, high = blocks[..., :128].reshape(t, nblk, 2, 64), blocks[..., 128:].reshape(t, nblk, 2, 32)
    lo = np.concatenate([high & 3, (high >> 2) & 3], axis=-1)  # [t, b, g, 64]
    hi = np.concatenate([(high >> 4) & 3, high >> 6], axis=-1)
    lanes = np.stack([(nib & 15) | (lo << 4), (nib >> 4) | (hi << 4)], axis=3)  # [t, b, g, h, 64]
    q = lanes.reshape(t, nblk, 2, 2, TILE, 4).transpose(0, 4, 1, 2, 3, 5).reshape(n, k)
    sc = blob[a:b].view(np.int8).reshape(t, nblk, TILE).transpose(0, 2, 1).reshape(n, nblk)
    d = blob[b:].view(np.float16).reshape(t, nsup, TILE).transpose(0, 2, 1).reshape(n, nsup)
    return q.astype(np.uint8), d, sc


def q6k_grid(blob: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The same weights as an 8-bit grid in blocks of 16 with zero points 32: (q [N, K], scales fp32 [N, K/16])."""
    q, d, sc = q6k_parts(blob, n, k)
    return q, np.repeat(d.astype(np.float32), SUPER // 16, axis=1) * sc.astype(np.float32)


# ---- the graph with exporter-written kernel ops made portable ----

def portable_graph(model, base_dir) -> int:
    """Rewrite, in place, every ruvllm.MatMulQ4 the exporter wrote in a GGUF's own layout (Q4_K, Q6_K) into
    MatMulNBits (and a Q4_K's minimum term), and every ruvllm.GatherQ into standard gathers, over the same
    weights (read from the external data under base_dir). Returns how many."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    nodes, added, done, count = [], [], set(), 0
    for node in model.graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if node.domain == DOMAIN and node.op_type == "GatherQ":
            table = node.input[0]
            nodes += gather_nodes(node, attrs, f"{table}/portable")
            if table not in done:
                added += gather_tables(_read(inits[table], base_dir), attrs, f"{table}/portable")
                done.add(table)
            count += 1
            continue
        if node.domain != DOMAIN or not node.op_type.startswith("MatMulQ4") or not attrs.get("kquant"):
            nodes.append(node)
            continue
        if node.op_type != "MatMulQ4":
            raise ValueError(f"{node.name}: a k-quant {node.op_type} has no portable form here (rewritten before the "
                             "kernels were chosen?)")
        n, k, w = attrs["N"], attrs["K"], node.input[1]
        six = attrs["kquant"] == 2
        layout = GridLayout(n, k, 8, 16, None) if six else GridLayout(n, k, 4, BLOCK, "fp32")
        if w not in done:
            blob, names = _read(inits[w], base_dir), nbits_names(w, layout)
            if six:  # an 8-bit grid in blocks of 16, zero points 32
                q, scale = q6k_grid(blob, n, k)
                values = {"q": q.reshape(n, -1, 16), "scales": scale, "zero_points": np.full(scale.shape, 32, np.uint8)}
            else:
                q, scale, mins = kquant_grid(blob, n, k)
                b, z = pack_4bit(q, np.zeros_like(scale, dtype=np.uint8), BLOCK)
                values = {"q": b, "scales": scale, "zero_points": z, "mins": np.ascontiguousarray(mins.T),
                          "block_ones": block_ones(k, BLOCK)}
            added += [numpy_helper.from_array(np.ascontiguousarray(v), names[role]) for role, v in values.items()]
            done.add(w)
        nodes += nbits_nodes(w, node.input[0], node.output[0], layout)
        count += 1
    if count:
        kept = [t for t in model.graph.initializer if t.name not in done]
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        model.graph.ClearField("initializer")
        model.graph.initializer.extend(kept + added)
    return count


def gather_tables(blob: np.ndarray, attrs: dict, prefix: str) -> list:
    """GatherQ's table as plain initializers: q [N, K] uint8, scales (and a Q4_K's minimums) [N, blocks] fp32."""
    from onnx import numpy_helper

    n, k = attrs["N"], attrs["K"]
    if attrs["kquant"] == 2:
        q, scale = q6k_grid(blob, n, k)
        arrays = {"q": q, "scales": scale}
    else:
        q, scale, mins = kquant_grid(blob, n, k)
        arrays = {"q": q, "scales": scale, "mins": mins}
    return [numpy_helper.from_array(np.ascontiguousarray(v), f"{prefix}.{role}") for role, v in arrays.items()]


def gather_nodes(node, attrs: dict, prefix: str) -> list:
    """GatherQ in standard operators on gather_tables' initializers: the rows' integers, minus 32 for Q6_K,
    times their block's scale (plus a Q4_K's minimum), as gguf computes them."""
    from onnx import TensorProto, helper, numpy_helper

    six = attrs["kquant"] == 2
    block = 16 if six else BLOCK
    ids, out, p = node.input[1], node.output[0], f"{node.name or prefix}/"
    consts = {"flat": np.array([-1], np.int64), "blocks": np.array([-1, attrs["K"] // block, block], np.int64),
              "axis2": np.array([2], np.int64), "k": np.array([attrs["K"]], np.int64), "32": np.array(32, np.float32)}
    nodes = [helper.make_node("Constant", [], [p + name], value=numpy_helper.from_array(v)) for name, v in consts.items()]
    nodes += [helper.make_node("Reshape", [ids, p + "flat"], [p + "ids"]),
              helper.make_node("Gather", [f"{prefix}.q", p + "ids"], [p + "q8"], axis=0),
              helper.make_node("Cast", [p + "q8"], [p + "qf"], to=TensorProto.FLOAT),
              helper.make_node("Reshape", [p + "qf", p + "blocks"], [p + "qb"])]
    q = p + "qb"
    if six:
        nodes.append(helper.make_node("Sub", [q, p + "32"], [p + "centred"]))
        q = p + "centred"
    for role in ("scales", "mins") if not six else ("scales",):
        nodes += [helper.make_node("Gather", [f"{prefix}.{role}", p + "ids"], [p + role], axis=0),
                  helper.make_node("Unsqueeze", [p + role, p + "axis2"], [p + role + "3"])]
    nodes.append(helper.make_node("Mul", [q, p + "scales3"], [p + "scaled"]))
    rows = p + "scaled"
    if not six:
        nodes.append(helper.make_node("Add", [rows, p + "mins3"], [p + "rows"]))
        rows = p + "rows"
    nodes += [helper.make_node("Shape", [ids], [p + "ids_shape"]),
              helper.make_node("Concat", [p + "ids_shape", p + "k"], [p + "shape"], axis=0),
              helper.make_node("Reshape", [rows, p + "shape"], [out])]
    return nodes


def _read(tensor, base_dir) -> np.ndarray:
    """An initializer's bytes as uint8, from the graph or its external data file."""
    from onnx import TensorProto

    if tensor.data_location != TensorProto.EXTERNAL:
        return np.frombuffer(tensor.raw_data, np.uint8)
    info = {e.key: e.value for e in tensor.external_data}
    offset, length = int(info.get("offset", 0)), int(info["length"])
    return np.fromfile(f"{base_dir}/{info['location']}", np.uint8, count=length, offset=offset)
