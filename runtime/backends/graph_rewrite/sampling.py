"""The step's sampling tail onto ruvllm.SampleTopK.
"""

from __future__ import annotations

from runtime.backends.graph_rewrite.nodes import DOMAIN, _attr, _consumers, _drop_dead


def fuse_sampling(model) -> int:
    """The step's sampling tail (exporter/builders: the sparse penalties' ScatterElements over the logits, Add
    of structured output's mask where the graph has one, Div by the temperature, LogSoftmax, TopK) becomes one
    ruvllm.SampleTopK, which keeps a row in one buffer instead of five passes over [rows, vocab]. The small
    operators computing the sparse values stay. Returns how many (0 or 1)."""
    import onnx

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    producer = {name: node for node in nodes for name in node.output}
    graph_outputs = {o.name for o in model.graph.output}

    def feeding(node, i: int, op_type: str):
        """The node producing node.input[i] if it is an op_type that nothing else reads from."""
        src = producer.get(node.input[i]) if len(node.input) > i else None
        if src is None or src.op_type != op_type or src.domain not in ("", "ai.onnx"):
            return None
        private = consumers.get(src.output[0]) == [node] and src.output[0] not in graph_outputs
        return src if private else None

    count = 0
    for i, topk in enumerate(nodes):
        if (topk.op_type != "TopK" or topk.domain not in ("", "ai.onnx") or _attr(topk, "axis", -1) not in (-1, 1)
                or _attr(topk, "largest", 1) != 1 or _attr(topk, "sorted", 1) != 1):
            continue
        lsm = feeding(topk, 0, "LogSoftmax")
        div = lsm and _attr(lsm, "axis", -1) in (-1, 1) and feeding(lsm, 0, "Div")
        temperature = div and feeding(div, 1, "Unsqueeze")
        add = div and feeding(div, 0, "Add")
        mask = None
        if add:
            scatter, mask = feeding(add, 0, "ScatterElements"), add.input[1]
        else:
            scatter = div and feeding(div, 0, "ScatterElements")
        if not (temperature and scatter and _attr(scatter, "axis", 0) in (-1, 1)
                and _attr(scatter, "reduction", b"none") in (b"none", "none")):
            continue
        inputs = [*scatter.input[:3], temperature.input[0], topk.input[1]] + ([mask] if mask else [])
        fused = onnx.helper.make_node("SampleTopK", inputs, list(topk.output), name=topk.name, domain=DOMAIN)
        model.graph.node[i].CopyFrom(fused)
        count += 1
    if count:
        _drop_dead(model)
    return count
