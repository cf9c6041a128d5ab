"""Projections that reach the graph on their grids as it is built, not as float weights swapped later.

A streamed export (a GGUF read tensor by tensor) never has a model's float weights: each projection's
grid (the file's own blocks, or RTN of the one tensor) is made when the builder reaches it, packed
into the package's data file, and dropped. The base and LoRA graphs share every weight by name
(WeightStore.named), so a grid is made once whatever the number of graphs.
"""

from __future__ import annotations

from collections.abc import Callable

from exporter.builders.onnx_builder import GraphBuilder
from exporter.quantizers.block_matmul import GridLayout, grid_nodes, grid_tensors, layout_of, tensor_names
from exporter.quantizers.grid import Grid


class ProjectionGrids:
    def __init__(self, make: Callable[[str], Grid | None]) -> None:
        """make(graph weight name) -> its Grid, or None for a float projection."""
        self._make = make
        self.layouts: dict[str, GridLayout | None] = {}  # each name's, once made (what a second graph needs)

    def matmul(self, b: GraphBuilder, w: str, x: str, out: str | None = None) -> str | None:
        """y = x . W on W's grid, or None when W has no grid (the caller builds a float MatMul)."""
        if b.store is not None and w in self.layouts:
            layout, grid = self.layouts[w], None  # the store has its tensors
        else:
            grid = self._make(w)
            layout = self.layouts[w] = None if grid is None else layout_of(grid)
        if layout is None:
            return None
        values = None

        def value(role: str):
            nonlocal values
            if values is None:
                values = grid_tensors(grid, layout)
            return values[role]

        for role, name in tensor_names(w, layout).items():
            b.named_weight(name, lambda role=role: value(role))
        y = out or f"{w}/out"
        b.nodes += grid_nodes(w, x, y, layout)
        return y
