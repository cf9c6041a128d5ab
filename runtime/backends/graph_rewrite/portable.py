"""The graph with the exporter's kernel-layout operators made portable, for a host without the kernels (no
AVX2, RUVLLM_CPU_KERNELS=0, another execution provider): the same weights as MatMulNBits (and a Q4_K's
minimum term) and standard gathers, unpacked at load.
"""

from __future__ import annotations

import numpy as np

from runtime.backends.block_layouts import (
    BY_KIND,
    DOMAIN,
    OWN,
    block_ones,
    nbits_names,
    nbits_nodes,
    node_grid,
    node_layout,
    own_grid,
    pack_4bit,
)

# where an initializer that the session is handed in memory says its data lives: no file of that name is read
IN_MEMORY = "ruvllm-in-memory"


def portable_graph(model, base_dir, weights: dict[str, np.ndarray] | None = None) -> int:
    """Rewrite, in place, every ruvllm.MatMulQ4/Q8 the exporter wrote in a kernel's layout (a GGUF's own
    types, an int4 grid) into MatMulNBits (and a Q4_K's minimum term), and every ruvllm.GatherQ into standard gathers, over the same
    weights (read from the external data under base_dir). Returns how many.

    The new weights are embedded in the graph, or, given `weights`, put there by name and declared as external
    data that names no file (IN_MEMORY), for the session to take in memory (add_external_initializers): a
    model's worth of weights cannot pass protobuf's 2 GB, and need not be serialized and parsed again. A name
    already in `weights` (the other graph of the same package) is taken as it is, not converted twice."""
    inits = {t.name: t for t in model.graph.initializer}
    store = {} if weights is None else weights
    nodes, added, done, count = [], [], set(), 0
    for node in model.graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if node.domain == DOMAIN and node.op_type == "GatherQ":
            table = node.input[0]
            prefix = f"{table}/portable"
            nodes += gather_nodes(node, attrs, prefix)
            if table not in done:
                names = gather_names(attrs, prefix)
                if any(name not in store for name in names):
                    store.update(gather_tables(_read(inits[table], base_dir), attrs, prefix))
                added += names
                done.add(table)
            count += 1
            continue
        if node.domain != DOMAIN or not node.op_type.startswith("MatMulQ") or not attrs.get("kquant"):
            nodes.append(node)
            continue
        if node.op_type not in ("MatMulQ4", "MatMulQ8"):
            raise ValueError(f"{node.name}: a k-quant {node.op_type} has no portable form here (rewritten before the "
                             "kernels were chosen?)")
        w, layout = node.input[1], node_layout(attrs)
        if w not in done:
            names = nbits_names(w, layout)
            if any(name not in store for name in names.values()):
                store.update({names[role]: a for role, a in nbits_arrays(attrs, _read(inits[w], base_dir)).items()})
            added += names.values()
            done.add(w)
        nodes += nbits_nodes(w, node.input[0], node.output[0], layout)
        count += 1
    if count:
        kept = [t for t in model.graph.initializer if t.name not in done]
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        model.graph.ClearField("initializer")
        model.graph.initializer.extend(kept + [_initializer(name, store[name], weights is None) for name in added])
    return count


def nbits_arrays(attrs: dict, blob: np.ndarray) -> dict[str, np.ndarray]:
    """A kernel-layout weight's MatMulNBits initializers by nbits_names' role: packed q, scales, zero points,
    and for minimums the minimums [blocks, N] and the block sums' ones."""
    q, scale, zero, mins, block, bits = node_grid(attrs, blob)
    n, k = q.shape
    zero = np.zeros(scale.shape, np.uint8) if zero is None else zero
    b, z = pack_4bit(q, zero, block) if bits == 4 else (q.reshape(n, -1, block), zero)
    values = {"q": b, "scales": scale, "zero_points": z}
    if mins is not None:
        values.update(mins=mins.T, block_ones=block_ones(k, block))
    return {role: np.ascontiguousarray(v) for role, v in values.items()}


def _initializer(name: str, array: np.ndarray, embed: bool):
    """The graph's entry for a weight: its bytes, or (in memory) its type and shape and an external location
    that no file has."""
    from onnx import TensorProto, helper, numpy_helper

    if embed:
        return numpy_helper.from_array(array, name)
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape,
                    data_location=TensorProto.EXTERNAL)
    for key, value in (("location", IN_MEMORY), ("offset", "0"), ("length", str(array.nbytes))):
        t.external_data.add(key=key, value=value)
    return t


def in_memory_names(model) -> set[str]:
    """The graph's initializers declared IN_MEMORY."""
    return {t.name for t in model.graph.initializer
            if any(e.key == "location" and e.value == IN_MEMORY for e in t.external_data)}


def embed_in_memory(model, weights: dict[str, np.ndarray], names: set[str]) -> None:
    """Turn the graph's IN_MEMORY entries `names` (in_memory_names) back into embedded weights (a small rewrite,
    worth caching whole)."""
    from onnx import numpy_helper

    for t in model.graph.initializer:
        if t.name in names:
            t.CopyFrom(numpy_helper.from_array(weights[t.name], t.name))


def gather_names(attrs: dict, prefix: str) -> list[str]:
    """gather_tables' initializer names."""
    return [f"{prefix}.{role}" for role in ("q", "scales", "mins")[:3 if OWN[BY_KIND[attrs["kquant"]]].mins else 2]]


def gather_tables(blob: np.ndarray, attrs: dict, prefix: str) -> dict[str, np.ndarray]:
    """GatherQ's table as plain initializers (gather_names): q [N, K] uint8, scales (and minimums) [N, blocks] fp32."""
    q, scale, _, mins = own_grid(BY_KIND[attrs["kquant"]], blob, attrs["N"], attrs["K"])
    return dict(zip(gather_names(attrs, prefix), (np.ascontiguousarray(v) for v in (q, scale, mins))))


def gather_nodes(node, attrs: dict, prefix: str) -> list:
    """GatherQ in standard operators on gather_tables' initializers: the rows' integers, minus the type's
    zero point, times their block's scale (or times it plus their block's minimum), as gguf computes them."""
    from onnx import TensorProto, helper, numpy_helper

    t = OWN[BY_KIND[attrs["kquant"]]]
    minimums = t.scales in ("kquant", "kquant4", "halfmin")
    ids, out, p = node.input[1], node.output[0], f"{node.name or prefix}/"
    consts = {"flat": np.array([-1], np.int64), "blocks": np.array([-1, attrs["K"] // t.block, t.block], np.int64),
              "axis2": np.array([2], np.int64), "k": np.array([attrs["K"]], np.int64),
              "zero": np.array(t.zero, np.float32)}
    nodes = [helper.make_node("Constant", [], [p + name], value=numpy_helper.from_array(v)) for name, v in consts.items()]
    nodes += [helper.make_node("Reshape", [ids, p + "flat"], [p + "ids"]),
              helper.make_node("Gather", [f"{prefix}.q", p + "ids"], [p + "q8"], axis=0),
              helper.make_node("Cast", [p + "q8"], [p + "qf"], to=TensorProto.FLOAT),
              helper.make_node("Reshape", [p + "qf", p + "blocks"], [p + "qb"])]
    q = p + "qb"
    if not minimums:
        nodes.append(helper.make_node("Sub", [q, p + "zero"], [p + "centred"]))
        q = p + "centred"
    for role in ("scales", "mins") if minimums else ("scales",):
        nodes += [helper.make_node("Gather", [f"{prefix}.{role}", p + "ids"], [p + role], axis=0),
                  helper.make_node("Unsqueeze", [p + role, p + "axis2"], [p + role + "3"])]
    nodes.append(helper.make_node("Mul", [q, p + "scales3"], [p + "scaled"]))
    rows = p + "scaled"
    if minimums:
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
