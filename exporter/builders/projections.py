"""Projections that reach the graph on their grids as it is built, not as float weights swapped later.

A streamed export (a GGUF read tensor by tensor) never has a model's float weights: each projection's
grid (the file's own blocks, or RTN of the one tensor) is made when the builder reaches it, packed
into the package's data file, and dropped. The base and LoRA graphs share every weight by name
(WeightStore.named), so a grid is made once whatever the number of graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from exporter.builders.onnx_builder import GraphBuilder
from exporter.quantizers.block_matmul import GridLayout, grid_nodes, grid_tensors, layout_of, tensor_names
from exporter.quantizers.grid import Grid
from runtime.backends.block_layouts import DOMAIN, kquant_layout


@dataclass
class KQuant:
    """A projection kept as a GGUF's Q4_K at its own bits, for ruvllm.MatMulQ4's k-quant layout: q, d,
    dmin, sc, m (runtime.backends.block_layouts.kquant_layout), the parts' rows stacked."""

    parts: tuple

    @classmethod
    def stacked(cls, parts: list[tuple]) -> KQuant:
        return cls(tuple(np.concatenate([p[i] for p in parts]) for i in range(5)))


@dataclass(frozen=True)
class KQuantLayout:
    n: int
    k: int
    bits: int = 4
    block: int = 32
    mins: str = "Q4_K's 6-bit"
    kquant: bool = True


class ProjectionGrids:
    def __init__(self, make: Callable[[str], Grid | KQuant | None]) -> None:
        """make(graph weight name) -> its Grid (or KQuant), or None for a float projection."""
        self._make = make
        self.layouts: dict[str, GridLayout | KQuantLayout | None] = {}  # each name's, once made (a second graph's)

    def matmul(self, b: GraphBuilder, w: str, x: str, out: str | None = None) -> str | None:
        """y = x . W on W's grid, or None when W has no grid (the caller builds a float MatMul)."""
        if b.store is not None and w in self.layouts:
            layout, grid = self.layouts[w], None  # the store has its tensors
        else:
            grid = self._make(w)
            if isinstance(grid, KQuant):
                layout = KQuantLayout(*grid.parts[0].shape)
            else:
                layout = None if grid is None else layout_of(grid)
            self.layouts[w] = layout
        if layout is None:
            return None
        y = out or f"{w}/out"
        if isinstance(layout, KQuantLayout):  # the kernel's own op: a host without it gets MatMulNBits at load
            blob = b.named_weight(f"{w}_Q4K", lambda: kquant_layout(*grid.parts))
            b.op("MatMulQ4", [x, blob], name=f"{w}/MatMulQ4", out=y, domain=DOMAIN, K=layout.k, N=layout.n, bits=4,
                 block_size=32, kquant=1)
            return y
        values = None

        def value(role: str):
            nonlocal values
            if values is None:
                values = grid_tensors(grid, layout)
            return values[role]

        for role, name in tensor_names(w, layout).items():
            b.named_weight(name, lambda role=role: value(role))
        b.nodes += grid_nodes(w, x, y, layout)
        return y
