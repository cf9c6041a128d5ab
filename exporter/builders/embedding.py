"""Embedding rows gathered from a quantized table, dequantized exactly as the table's grid defines them."""

from __future__ import annotations

import numpy as np

from exporter.builders.onnx_builder import FLOAT, GraphBuilder


def grid_rows(b: GraphBuilder, name: str, grid):
    """A function of token ids (any shape) -> their rows of a gridded table, [*ids.shape, hidden], computed
    as grid.Grid.dequantize does: (q - zero) * scale (+ mins), in fp32."""
    rows, cols = grid.q.shape
    nblk = cols // grid.block
    q = b.weight(f"{name}.q", np.ascontiguousarray(grid.q, np.uint8))
    scale = b.weight(f"{name}.scales", np.ascontiguousarray(grid.scale, np.float32))
    uniform = bool(np.all(grid.zero == grid.zero.flat[0]))
    zero = None if uniform else b.weight(f"{name}.zero_points", np.ascontiguousarray(grid.zero, np.uint8))
    mins = None if grid.mins is None else b.weight(f"{name}.mins", np.ascontiguousarray(grid.mins, np.float32))

    def gather(ids: str) -> str:
        flat = b.op("Reshape", [ids, b.const([-1])])
        picked = lambda t: b.op("Unsqueeze", [b.op("Gather", [t, flat], axis=0), b.const([2])])  # noqa: E731
        v = b.op("Reshape", [b.op("Cast", [b.op("Gather", [q, flat], axis=0)], to=FLOAT), b.const([-1, nblk, grid.block])])
        z = b.const(float(grid.zero.flat[0]), np.float32) if uniform else b.op("Cast", [picked(zero)], to=FLOAT)
        v = b.op("Mul", [b.op("Sub", [v, z]), picked(scale)])
        if mins is not None:
            v = b.op("Add", [v, picked(mins)])
        shape = b.op("Concat", [b.op("Shape", [ids]), b.const([cols])], axis=0)
        return b.op("Reshape", [v, shape])
    return gather
