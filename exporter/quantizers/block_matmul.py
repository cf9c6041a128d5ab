"""Grids into the graph: MatMulNBits over the grid's own integers, plus the blocks' float minimums.

MatMulNBits computes x . ((q - z) * s). A grid with minimums (llama.cpp's Q4_1, Q4_K: w = d * q + m)
needs x . m per block as well, which is m times the sum of the block's activations: the graph computes
`Gemm(MatMul(x, block_ones), mins, C=MatMulNBits(x))`, two operators beside the projection, the
product 1/block the size of the main one (the native backend folds it into its own kernel, the page's
format into the dequantized weights). The nodes are named after the weight (`{w}/MatMulNBits`,
`{w}/block_sums`, `{w}/add_mins`), which is how the runtime finds them. Minimums that fp16 holds exactly are stored as fp16 (half the bytes),
the others (Q4_K's dmin * m) as fp32.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from exporter.builders.onnx_builder import replace_graph
from exporter.quantizers.grid import Grid, fp16_exact, pack_nbits
from runtime.backends.block_layouts import (
    DOMAIN,
    GRID_KIND,
    GridLayout,
    block_ones,
    grid_fits,
    grid_layout,
    kernel_grid,
    unpack_4bit,
)
from runtime.backends.block_layouts import nbits_names as tensor_names
from runtime.backends.block_layouts import nbits_nodes as grid_nodes

__all__ = ["GridLayout", "apply_grids", "grid_nodes", "grid_tensors", "kernel_layouts", "layout_of", "take_minimum_terms",
           "tensor_names"]


def layout_of(grid: Grid) -> GridLayout:
    n, k = grid.q.shape
    if k % grid.block:
        raise ValueError(f"K={k} is not a whole number of blocks of {grid.block}")
    mins = None if grid.mins is None else "fp16" if fp16_exact(grid.mins) else "fp32"
    return GridLayout(n, k, grid.bits, grid.block, mins)


def grid_tensors(grid: Grid, layout: GridLayout) -> dict[str, np.ndarray]:
    """The initializers' values, by role (tensor_names)."""
    b, s, z = pack_nbits(grid)
    out = {"q": b.astype(np.uint8, copy=False), "scales": s.astype(np.float32, copy=False),
           "zero_points": z.astype(np.uint8, copy=False)}
    if layout.mins:
        m = np.ascontiguousarray(grid.mins.T, np.float32)  # [blocks, N]: the sums' MatMul reads it as it is
        out["mins"] = m.astype(np.float16) if layout.mins == "fp16" else m
        out["block_ones"] = block_ones(layout.k, layout.block)
    return out


def apply_grids(model: onnx.ModelProto, grids: dict[str, Grid], accuracy_level: int = 4) -> onnx.ModelProto:
    """Replace every MatMul whose weight initializer is named in `grids` (stored [K, N], a Grid [N, K])."""
    nodes, added, done = [], [], set()
    for node in model.graph.node:
        grid = grids.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if grid is None:
            nodes.append(node)
            continue
        w = node.input[1]
        try:
            layout = layout_of(grid)
        except ValueError as err:
            raise ValueError(f"{w}: {err}") from None
        if w not in done:
            names = tensor_names(w, layout)
            added += [numpy_helper.from_array(np.ascontiguousarray(v), names[role])
                      for role, v in grid_tensors(grid, layout).items()]
            done.add(w)
        nodes += grid_nodes(w, node.input[0], node.output[0], layout, accuracy_level)
    missing = set(grids) - done
    if missing:
        raise ValueError(f"no MatMul reads {len(missing)} gridded weights, e.g. {sorted(missing)[0]}")
    return replace_graph(model, nodes, [t for t in model.graph.initializer if t.name not in done] + added)


def take_minimum_terms(model: onnx.ModelProto) -> dict[str, tuple[np.ndarray, str]]:
    """Remove every block-minimum term apply_grids added; return, by MatMulNBits node name, its
    minimums ([blocks, N] float32) and the output name the term wrote (the projection's result): for a
    format that folds the minimums into its dequantized weights instead (browser_format)."""
    inits = {t.name: t for t in model.graph.initializer}
    terms, drop_nodes, drop_inits = {}, set(), set()
    for node in model.graph.node:
        if node.op_type != "Gemm" or not node.name.endswith("/add_mins"):
            continue
        w = node.name[:-len("/add_mins")]
        fp16 = inits.get(f"{w}_mins_fp16")
        mins = numpy_helper.to_array(fp16 if fp16 is not None else inits[f"{w}_mins"]).astype(np.float32)
        terms[f"{w}/MatMulNBits"] = (mins, node.output[0])
        drop_nodes.update(f"{w}/{part}" for part in ("block_sums", "add_mins", "mins_fp32"))
        drop_inits.update((f"{w}_mins_fp16", f"{w}_mins", f"{w}/block_ones"))
    if terms:
        replace_graph(model, [n for n in model.graph.node if n.name not in drop_nodes],
                      [t for t in model.graph.initializer if t.name not in drop_inits])
    return terms


def kernel_layouts(model: onnx.ModelProto) -> int:
    """Every 4-bit MatMulNBits the CPU kernel computes the same way (int8 compute, packed zero points, fp32
    scales, no minimum term) as ruvllm.MatMulQ4 over its grid in the kernel's layout (block_layouts.grid_layout):
    a load then maps the weights where it would otherwise pack a copy of them. A host without the kernel gets
    MatMulNBits back at load (block_layouts.portable_graph). In place; returns how many."""
    from onnx import helper

    inits = {t.name: t for t in model.graph.initializer}
    nodes, added, done, dropped = [], [], {}, set()
    for node in model.graph.node:
        layout = kernel_grid(node, inits)  # and not a grid whose minimum term follows (its output .../nbits_out)
        if layout is None or not grid_fits(layout) or node.output[0].endswith("/nbits_out"):
            nodes.append(node)
            continue
        w = node.input[1]
        if w not in done:
            n, k, block = layout.n, layout.k, layout.block
            b, s, z = (numpy_helper.to_array(inits[name]) for name in node.input[1:])
            done[w] = (w[:-3] if w.endswith("_Q4") else w) + "_Q4G"
            added.append(numpy_helper.from_array(grid_layout(unpack_4bit(b, k), s.reshape(n, -1),
                                                             unpack_4bit(z.reshape(n, -1), k // block), block), done[w]))
            dropped.update(node.input[1:])
        nodes.append(helper.make_node("MatMulQ4", [node.input[0], done[w]], list(node.output),
                                      name=node.name.replace("MatMulNBits", "MatMulQ4"), domain=DOMAIN, K=layout.k,
                                      N=layout.n, bits=4, block_size=layout.block, kquant=GRID_KIND))
    if done:
        read = {name for node in nodes for name in node.input}
        replace_graph(model, nodes, [t for t in model.graph.initializer if t.name not in dropped or t.name in read]
                      + added)
        if DOMAIN not in {o.domain for o in model.opset_import}:
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(done)
