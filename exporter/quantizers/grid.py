"""A projection's weights on a block grid, and how MatMulNBits stores it.

GPTQ produces grids; a GGUF file already is one (exporter/sources/gguf_blocks.py). Both reach the graph as
MatMulNBits integers, scales and zero points. A grid may also carry a float minimum per block, as
llama.cpp's Q4_1 and K-quants do (w = d * q + m): MatMulNBits has no such input, so the graph adds
m * (the block's sum of the activations) beside it (exporter/quantizers/block_matmul.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Grid:
    """w = (q - zero) * scale (+ mins), blocks of `block` along the input dimension."""

    q: np.ndarray  # uint8 [out, in]
    scale: np.ndarray  # float32 [out, blocks]
    zero: np.ndarray  # uint8 [out, blocks]
    block: int
    bits: int
    mins: np.ndarray | None = None  # float32 [out, blocks], added to every weight of its block

    def dequantize(self) -> np.ndarray:
        out_f, in_f = self.q.shape
        pad = -in_f % self.block
        q = np.pad(self.q, ((0, 0), (0, pad))).reshape(out_f, -1, self.block).astype(np.float32)
        w = (q - self.zero[..., None].astype(np.float32)) * self.scale[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(out_f, -1)[:, :in_f]

    def rows(self, start: int, stop: int) -> Grid:
        """Output rows [start, stop) (views, nothing copied): a 7B's gate_up dequantized whole is 1.4 GB of
        float32 temporaries."""
        mins = None if self.mins is None else self.mins[start:stop]
        return Grid(self.q[start:stop], self.scale[start:stop], self.zero[start:stop], self.block, self.bits, mins)

    def with_block(self, block: int) -> Grid:
        """The same weights in smaller blocks (each block's scale, zero point and minimum repeated): exact."""
        if block == self.block:
            return self
        if self.block % block or self.q.shape[1] % self.block:
            raise ValueError(f"cannot split blocks of {self.block} into blocks of {block}")
        r = self.block // block
        rep = lambda a: None if a is None else np.repeat(a, r, axis=1)  # noqa: E731
        return Grid(self.q, rep(self.scale), rep(self.zero), block, self.bits, rep(self.mins))

    def as_minimums(self) -> Grid:
        """The same weights with zero points 0 and the offset in the minimums, q * s + (m - z * s): how a
        Q4_0 part (zero point 8) joins Q4_1 parts in one fused weight. Checked exact, as it is whenever
        (q - z) * s is exact in fp32 (a GGUF's fp16 scales times small integers)."""
        if self.mins is not None and not self.zero.any():
            return self
        mins = (self.mins if self.mins is not None else 0) - self.zero.astype(np.float32) * self.scale
        out = Grid(self.q, self.scale, np.zeros_like(self.zero), self.block, self.bits, mins.astype(np.float32))
        if not np.array_equal(out.dequantize(), self.dequantize()):
            raise ValueError("these blocks' zero points cannot move into minimums exactly")
        return out

    def with_bits(self, bits: int) -> Grid:
        """The same integers in a wider format: exact."""
        if bits < self.bits:
            raise ValueError(f"cannot narrow {self.bits}-bit integers to {bits} bits")
        return Grid(self.q, self.scale, self.zero, self.block, bits, self.mins)


def fp16_exact(a: np.ndarray) -> bool:
    """Whether fp16 holds every value of `a` exactly (a GGUF's fp16 scales and minimums do)."""
    return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def stack_rows(grids: list[Grid]) -> Grid:
    """Grids of projections sharing an input, stacked along the output (a fused q/k/v or gate/up
    weight) in the finest block and widest format among them, so that nothing is rounded again."""
    if len(grids) == 1:
        return grids[0]
    block, bits = min(g.block for g in grids), max(g.bits for g in grids)
    parts = [g.with_block(block).with_bits(bits) for g in grids]
    if any(p.mins is not None for p in parts):
        parts = [p.as_minimums() for p in parts]
    mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts], 0)
    return Grid(np.concatenate([p.q for p in parts], 0), np.concatenate([p.scale for p in parts], 0),
                np.concatenate([p.zero for p in parts], 0), block, bits, mins)


def pack_nbits(grid: Grid) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' B [N, blocks, block*bits/8], scales [N, blocks] and zero points ([N, ceil(blocks/2)]
    for 4 bits, low nibble first; [N, blocks] for 8)."""
    out_f, in_f = grid.q.shape
    pad = -in_f % grid.block
    q = (np.pad(grid.q, ((0, 0), (0, pad))) if pad else grid.q).reshape(out_f, -1, grid.block)
    if grid.bits == 8:
        return q, grid.scale, grid.zero.copy()
    if grid.bits != 4:
        raise ValueError(f"MatMulNBits packing is implemented for 4 and 8 bits, not {grid.bits}")
    from runtime.backends.block_layouts import pack_4bit

    b, z = pack_4bit(grid.q, grid.zero, grid.block)
    return b, grid.scale, z


def rtn_grid(w: np.ndarray, bits: int, block: int) -> Grid:
    """Round to nearest on an asymmetric grid, blocks of `block` along the input: the range of each block
    with 0 in it, 2^bits - 1 steps (onnxruntime's MatMulNBits quantizer's arithmetic)."""
    out_f, in_f = w.shape
    if in_f % block:
        raise ValueError(f"{in_f} inputs are not a whole number of blocks of {block}")
    top = 2 ** bits - 1
    blocks = w.reshape(out_f, -1, block).astype(np.float32)
    lo = np.minimum(blocks.min(-1), 0.0)
    hi = np.maximum(blocks.max(-1), 0.0)
    scale = (hi - lo) / top
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, top)
    q = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, top)
    return Grid(q.reshape(out_f, in_f).astype(np.uint8), scale, zero.astype(np.uint8), block, bits)
