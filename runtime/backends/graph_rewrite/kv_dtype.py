"""A KV pool in int8 or int4: on the attention kernel's inputs (kv_quantized), or read by the graph's own
attention (kv_in_int8_graph, a host without the kernels and the exporter's int8 graph).
"""

from __future__ import annotations

from runtime.backends.graph_rewrite.nodes import DOMAIN, _consumers


def kv_quantized(model, num_layers: int, tails: bool = True, kv_dtype: str = "int8") -> int:
    """Each layer's KV pool inputs (past.{i}.key / .value) that only ruvllm.PagedAttention reads become
    int8 (--kv-dtype int8), or int4 packed two a byte in uint8 [kv_heads, num_blocks, block_size, head_dim /
    2] (int4), and the node takes four more inputs: the fp16 scales of each row's groups [kv_heads,
    num_blocks, block_size, n] per kind (contract.past_key_scale; int8: one per group, kv_pool.quantize_rows;
    int4: a (scale, minimum) pair per group, kv_pool.quantize_rows_int4), which the kernel multiplies back
    in, and the fp16 tails, near-exact copies of the blocks being written, every layer's in one input
    per kind (contract.KV_TAIL_KEY; kv_pool.py; the node's `layer` says which part is its own,
    `tail_blocks` how many blocks up to a query's own it reads from them), and each row's floor
    (contract.KV_EXACT_FROM), unless `tails` is False. Returns how many layers."""
    import onnx

    from runtime import contract as C
    from runtime.backends.kv_pool import TAIL_BLOCKS
    from runtime.core.kv_blocks import kv_scale_widths

    inputs = {i.name: i for i in model.graph.input}
    consumers = _consumers(model.graph.node)
    count = 0
    for layer in range(len(inputs)):
        key, value = inputs.get(C.past_key(layer)), inputs.get(C.past_value(layer))
        if key is None or value is None:
            break
        users = consumers.get(key.name, []) + consumers.get(value.name, [])
        if len(users) != 2 or users[0] is not users[1] or (users[0].domain, users[0].op_type) != (DOMAIN, "PagedAttention"):
            continue
        node = users[0]
        if list(node.input[2:4]) != [key.name, value.name] or len(node.input) != 7:
            continue
        grouping = _groups_of(key)
        if grouping is None:
            continue
        head_dim = grouping[0] * grouping[1]
        widths = kv_scale_widths(head_dim, kv_dtype)
        if tails and not count:
            for name in (C.KV_TAIL_KEY, C.KV_TAIL_VALUE):
                model.graph.input.append(_tail_input(key, name, num_layers))
            model.graph.input.append(onnx.helper.make_tensor_value_info(C.KV_EXACT_FROM, onnx.TensorProto.INT64, ["batch"]))
        for pool, name, width in ((key, C.past_key_scale(layer), widths[0]), (value, C.past_value_scale(layer), widths[1])):
            model.graph.input.append(_scales_input(pool, name, width))
            if kv_dtype == "int4":
                pool.type.tensor_type.elem_type = onnx.TensorProto.UINT8
                pool.type.tensor_type.shape.dim[3].dim_value = head_dim // 2
            else:
                pool.type.tensor_type.elem_type = onnx.TensorProto.INT8
            node.input.append(name)
        if tails:
            node.input.extend([C.KV_TAIL_KEY, C.KV_TAIL_VALUE, C.KV_EXACT_FROM])
            node.attribute.append(onnx.helper.make_attribute("layer", layer))
            node.attribute.append(onnx.helper.make_attribute("tail_blocks", TAIL_BLOCKS))
        count += 1
    return count


def _groups_of(pool) -> tuple[int, int] | None:
    """(scales per row, numbers per scale) of a pool input [kv_heads, blocks, block_size, head_dim] (None:
    head_dim not fixed)."""
    from runtime.core.kv_blocks import kv_group

    dims = list(pool.type.tensor_type.shape.dim)
    d = dims[3].dim_value if len(dims) == 4 else 0
    return (d // kv_group(d), kv_group(d)) if d > 0 else None


def _scales_input(pool, name: str, groups: int):
    """The graph input of a pool's fp16 group scales, [kv_heads, blocks, block_size, groups]."""
    from onnx import TensorProto, helper

    scales = helper.make_tensor_value_info(name, TensorProto.FLOAT16, None)
    for d in list(pool.type.tensor_type.shape.dim)[:3]:
        scales.type.tensor_type.shape.dim.add().CopyFrom(d)
    scales.type.tensor_type.shape.dim.add().dim_value = groups
    return scales


def _tail_input(pool, name: str, num_layers: int):
    """The graph input of the fp16 tails of every layer, [blocks, layers, kv_heads, block_size, head_dim],
    from a layer's pool input [kv_heads, blocks, block_size, head_dim]."""
    from onnx import TensorProto, helper

    tail = helper.make_tensor_value_info(name, TensorProto.FLOAT16, None)
    heads, blocks, size, dim = list(pool.type.tensor_type.shape.dim)
    shape = tail.type.tensor_type.shape
    shape.dim.add().CopyFrom(blocks)
    shape.dim.add().dim_value = num_layers
    for d in (heads, size, dim):
        shape.dim.add().CopyFrom(d)
    return tail


def kv_in_int8_graph(model) -> int:
    """The graph's own attention path on an int8 pool (where ruvllm.PagedAttention does not run): each
    layer's pool inputs become int8 with their groups' fp16 scales, the blocks a step gathers are cast to
    float and multiplied by their groups' scales, and this step's rows written into the gathered context
    are rounded as the pool will store them (kv_pool.quantize_rows, op for op: max |x| / 127 through fp16,
    x / s rounded to nearest even and kept within 127, times s), so that the numbers are those the
    kernel's path reads. Returns how many layers."""
    from onnx import TensorProto, helper

    from runtime import contract as C

    nodes = list(model.graph.node)
    inputs = {i.name: i for i in model.graph.input}
    consumers = _consumers(nodes)
    before: dict[int, list] = {}  # id(node) -> nodes to insert before it
    after: dict[int, list] = {}
    consts = []

    def const(name: str, value, dtype=TensorProto.FLOAT, dims=()):
        consts.append(helper.make_tensor(name, dtype, list(dims), [value] if not dims else value))
        return name

    count = 0
    for layer in range(len(inputs)):
        kinds = [(inputs.get(C.past_key(layer)), C.past_key_scale(layer)),
                 (inputs.get(C.past_value(layer)), C.past_value_scale(layer))]
        if any(pool is None for pool, _ in kinds):
            break
        plans = []
        for pool, scale_name in kinds:
            users = consumers.get(pool.name, [])
            gathers = [u for u in users if u.op_type == "Gather" and u.input[0] == pool.name]
            if len(gathers) != 1 or any(u.op_type != "Shape" for u in users if u is not gathers[0]):
                break
            gather = gathers[0]
            reshape = consumers.get(gather.output[0], [])
            scatter = len(reshape) == 1 and reshape[0].op_type == "Reshape" and consumers.get(reshape[0].output[0], [])
            if not scatter or len(scatter) != 1 or scatter[0].op_type not in ("TensorScatter", "ScatterND"):
                break
            plans.append((pool, scale_name, gather, scatter[0]))
        grouping = _groups_of(kinds[0][0])
        if len(plans) != 2 or grouping is None:
            continue
        groups, size = grouping
        i64 = TensorProto.INT64
        for pool, scale_name, gather, scatter in plans:
            out, tag = gather.output[0], f"{pool.name}.int8"
            gather.output[0] = f"{tag}.rows"
            model.graph.input.append(_scales_input(pool, scale_name, groups))
            pool.type.tensor_type.elem_type = TensorProto.INT8
            # [Hkv, B, MB, bs, D] int8 -> float, times each group's scale (a blocked DequantizeLinear computes the
            # same products but took twice as long natively, and no less in onnxruntime-web's WASM)
            after[id(gather)] = [
                helper.make_node("Cast", [f"{tag}.rows"], [f"{tag}.float"], to=TensorProto.FLOAT),
                helper.make_node("Reshape", [f"{tag}.float", const(f"{tag}.grouped", [0, 0, 0, 0, groups, size], i64, [6])],
                                 [f"{tag}.groups"]),
                helper.make_node("Gather", [scale_name, gather.input[1]], [f"{tag}.scales16"], axis=1),
                helper.make_node("Cast", [f"{tag}.scales16"], [f"{tag}.scales"], to=TensorProto.FLOAT),
                helper.make_node("Unsqueeze", [f"{tag}.scales", const(f"{tag}.last", [-1], i64, [1])], [f"{tag}.scales1"]),
                helper.make_node("Mul", [f"{tag}.groups", f"{tag}.scales1"], [f"{tag}.scaled"]),
                helper.make_node("Reshape", [f"{tag}.scaled", const(f"{tag}.rowwise", [0, 0, 0, 0, groups * size], i64, [5])],
                                 [out]),
            ]
            slot = 1 if scatter.op_type == "TensorScatter" else 2
            update, r = scatter.input[slot], f"{tag}.step"
            before[id(scatter)] = [  # this step's rows, rounded by groups as the pool will hold them
                helper.make_node("Shape", [update], [f"{r}.shape"]),
                helper.make_node("Reshape", [update, const(f"{r}.grouped", [-1, size], i64, [2])], [f"{r}.groups"]),
                helper.make_node("Abs", [f"{r}.groups"], [f"{r}.abs"]),
                helper.make_node("ReduceMax", [f"{r}.abs", const(f"{r}.axis", [-1], i64, [1])], [f"{r}.max"], keepdims=1),
                helper.make_node("Div", [f"{r}.max", const(f"{r}.127", 127.0)], [f"{r}.s32"]),
                helper.make_node("Cast", [f"{r}.s32"], [f"{r}.s16"], to=TensorProto.FLOAT16),
                helper.make_node("Cast", [f"{r}.s16"], [f"{r}.s"], to=TensorProto.FLOAT),
                helper.make_node("Greater", [f"{r}.s", const(f"{r}.zero", 0.0)], [f"{r}.pos"]),
                helper.make_node("Where", [f"{r}.pos", f"{r}.s", const(f"{r}.one", 1.0)], [f"{r}.safe"]),
                helper.make_node("Div", [f"{r}.groups", f"{r}.safe"], [f"{r}.steps"]),
                helper.make_node("Round", [f"{r}.steps"], [f"{r}.q"]),
                helper.make_node("Clip", [f"{r}.q", const(f"{r}.lo", -127.0), const(f"{r}.hi", 127.0)], [f"{r}.qc"]),
                helper.make_node("Mul", [f"{r}.qc", f"{r}.s"], [f"{r}.deq"]),
                helper.make_node("Reshape", [f"{r}.deq", f"{r}.shape"], [f"{r}.rounded"]),
            ]
            scatter.input[slot] = f"{r}.rounded"
        count += 1
    if count:
        ordered = []
        for node in nodes:
            ordered += before.get(id(node), []) + [node] + after.get(id(node), [])
        del model.graph.node[:]
        model.graph.node.extend(ordered)
        model.graph.initializer.extend(consts)
    return count
