"""Each layer's attention path onto ruvllm.PagedAttention, which reads the KV pool's blocks in place.
"""

from __future__ import annotations

from runtime.backends.graph_rewrite.nodes import DOMAIN, _consumers, _drop_dead


def fusable_head_dim(head_dim: int) -> bool:
    """Head sizes ruvllm.PagedAttention is compiled for."""
    return head_dim % 16 == 0 and (head_dim <= 128 or head_dim == 256)


def fuse_attention(model, num_layers: int, num_heads: int, num_kv_heads: int, windows: list) -> int:
    """Replace each layer's attention path (pool gather, in-place write of this step's K/V, scores, Gemma
    2's soft cap, mask, softmax, weighted values) with one ruvllm.PagedAttention that reads the pool's blocks
    in place, with the layer's sliding window (windows[layer]; None: none); the nodes only that path used
    are dropped. Returns how many layers were fused: all or none (a graph that does not have the exported
    shape, e.g. a ScatterND one, is left as it is)."""
    from onnx import helper, numpy_helper

    from runtime import contract as C

    inits = {i.name: i for i in model.graph.initializer}

    def scalar(node) -> float | None:
        values = [numpy_helper.to_array(inits[n]) for n in node.input if n in inits]
        return float(values[0]) if len(values) == 1 and values[0].size == 1 else None

    def softcap(scores):
        """(the node after scores' soft cap, the cap) for Mul(1 / cap) -> Tanh -> Mul(cap), else (scores, 0)."""
        div = only(scores.output[0], "Mul")
        tanh = div and only(div.output[0], "Tanh")
        mul = tanh and only(tanh.output[0], "Mul")
        cap = mul and scalar(mul)
        if not (cap and scalar(div) and abs(scalar(div) * cap - 1.0) < 1e-6 and len(consumers[scores.output[0]]) == 1):
            return scores, 0.0
        return mul, cap

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    producer = {name: node for node in nodes for name in node.output}

    def only(name: str, op_type: str):
        found = [n for n in consumers.get(name, []) if n.op_type == op_type]
        return found[0] if len(found) == 1 else None

    fused = []
    for layer in range(num_layers):
        paths = []
        for pool in (C.past_key(layer), C.past_value(layer)):
            gather = only(pool, "Gather")
            reshape = gather and only(gather.output[0], "Reshape")
            scatter = reshape and only(reshape.output[0], "TensorScatter")
            update = scatter and producer.get(scatter.input[1])
            if not (update and update.op_type == "Gather"):
                return 0
            paths.append((scatter, update.input[0]))
        (k_ctx, qk), (v_ctx, v) = paths
        scores = only(k_ctx.output[0], "FusedMatMul")
        weighted = only(v_ctx.output[0], "MatMul")
        gather_nd = weighted and only(weighted.output[0], "GatherND")
        out = gather_nd and only(gather_nd.output[0], "Reshape")
        capped, cap = softcap(scores) if scores else (None, 0.0)
        masked = capped and only(capped.output[0], "Add")  # scores + mask, softmax, then the weighted values:
        softmax = masked and only(masked.output[0], "Softmax")  # anything else between is not the kernel's math
        if not (out and softmax and weighted.input[0] == softmax.output[0]):
            return 0
        scale = next((a.f for a in scores.attribute if a.name == "alpha"), 1.0)
        fused.append((out, helper.make_node(
            "PagedAttention", [qk, v, C.past_key(layer), C.past_value(layer), C.BLOCK_TABLES, C.QUERY_INDEX,
                               C.POSITION_IDS], [out.output[0]], domain=DOMAIN, name=f"paged_attention_{layer}",
            num_heads=num_heads, num_kv_heads=num_kv_heads, sliding_window=int(windows[layer] or 0), scale=scale,
            softcap=float(cap))))
    replaced = {id(out): new for out, new in fused}
    nodes = [replaced.get(id(n), n) for n in nodes]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_dead(model)  # what only the old attention paths computed (the masks, the index tensors, the gathers)
    return len(fused)
