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
from runtime.backends.block_layouts import DOMAIN, GRID_KIND, OWN, grid_fits, grid_layout, own_layout


@dataclass
class OwnBits:
    """A projection kept at a GGUF's own bits for ruvllm.MatMulQ4 (runtime.backends.block_layouts): runs
    of its parts by type, each (GGUF type, the run's parts stacked by rows: q and the type's scales, as
    block_layouts.own_layout takes them). More than one run: one operator each, their outputs concatenated."""

    runs: list[tuple[str, tuple]]
    kquant = True  # (for gguf_blocks.describe)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self.runs)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(a[0].shape[0] for _, a in self.runs), self.runs[0][1][0].shape[1]

    def gather(self, b: GraphBuilder, name: str):
        """A function of token ids -> their rows, dequantized by ruvllm.GatherQ from this table's layout
        (one run: an embedding table)."""
        (kind, arrays), = self.runs
        n, k = self.shape
        blob = b.named_weight(f"{name}_{kind.replace('_', '')}", lambda: own_layout(kind, *arrays))
        return lambda ids: b.op("GatherQ", [blob, ids], domain=DOMAIN, N=n, K=k, kquant=OWN[kind].kind)

    @classmethod
    def of(cls, parts: list[tuple[str, tuple]]) -> OwnBits:
        runs: list[tuple[str, list[tuple]]] = []
        for kind, arrays in parts:
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(arrays)
            else:
                runs.append((kind, [arrays]))
        return cls([(kind, tuple(np.concatenate(x) for x in zip(*group))) for kind, group in runs])


@dataclass(frozen=True)
class OwnBitsLayout:
    k: int
    kinds: tuple[str, ...]
    rows: tuple[int, ...]
    kquant: bool = True

    @property
    def bits(self) -> int:
        return max(OWN[kind].bits for kind in self.kinds)

    @property
    def block(self) -> int:
        return min(OWN[kind].block for kind in self.kinds)




class ProjectionGrids:
    def __init__(self, make: Callable[[str], Grid | OwnBits | None], kernel_layout: bool = False) -> None:
        """make(graph weight name) -> its Grid (or OwnBits), or None for a float projection. kernel_layout: an
        int4 grid the CPU kernel reads is written in its layout (block_layouts.grid_layout), so that a load
        maps it; a host without the kernel gets MatMulNBits at load."""
        self._make = make
        self.kernel_layout = kernel_layout
        self.layouts: dict[str, GridLayout | OwnBitsLayout | None] = {}  # each name's, once made (a second graph's)

    def matmul(self, b: GraphBuilder, w: str, x: str, out: str | None = None) -> str | None:
        """y = x . W on W's grid, or None when W has no grid (the caller builds a float MatMul)."""
        if b.store is not None and w in self.layouts:
            layout, grid = self.layouts[w], None  # the store has its tensors
        else:
            grid = self._make(w)
            if isinstance(grid, OwnBits):
                layout = OwnBitsLayout(grid.runs[0][1][0].shape[1], tuple(k for k, _ in grid.runs),
                                       tuple(a[0].shape[0] for _, a in grid.runs))
            else:
                layout = None if grid is None else layout_of(grid)
            self.layouts[w] = layout
        if layout is None:
            return None
        y = out or f"{w}/out"
        if isinstance(layout, OwnBitsLayout):  # the kernel's own op: a host without it gets MatMulNBits at load
            outs = []
            for i, (kind, rows) in enumerate(zip(layout.kinds, layout.rows)):
                t = OWN[kind]
                name = f"{w}_{kind.replace('_', '')}" if len(layout.kinds) == 1 else f"{w}_part{i}_{kind.replace('_', '')}"
                blob = b.named_weight(name, lambda i=i, kind=kind: own_layout(kind, *grid.runs[i][1]))
                part_out = y if len(layout.kinds) == 1 else f"{name}/out"
                b.op(t.op, [x, blob], name=f"{name}/{t.op}", out=part_out, domain=DOMAIN, K=layout.k, N=rows,
                     bits=t.bits, block_size=t.block, kquant=t.kind)
                outs.append(part_out)
            if len(outs) > 1:
                b.op("Concat", outs, axis=-1, out=y)
            return y
        if self.kernel_layout and grid_fits(layout):
            blob = b.named_weight(f"{w}_Q4G", lambda: grid_layout(grid.q, grid.scale, grid.zero, grid.block))
            b.op("MatMulQ4", [x, blob], name=f"{w}/MatMulQ4", out=y, domain=DOMAIN, K=layout.k, N=layout.n, bits=4,
                 block_size=layout.block, kquant=GRID_KIND)
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
