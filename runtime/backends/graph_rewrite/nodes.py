"""What the passes share: the `ruvllm` domain, who reads a tensor, and dropping the nodes a fusion
leaves behind.
"""

from __future__ import annotations

DOMAIN, OP = "ruvllm", "MatMulQ4"
# the operators a rewrite may use (a host without the kernels: none of them)
ALL_OPS = frozenset(("MatMulQ4", "MatMulQ8", "PagedAttention", "SkipRMSNorm", "LoraDelta", "SampleTopK"))


def _consumers(nodes) -> dict[str, list]:
    """Each tensor name -> the nodes reading it."""
    consumers: dict[str, list] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def _attr(node, name: str, default=None):
    import onnx

    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _drop(model, nodes: list, removed: set[int]) -> None:
    """The graph without the nodes whose id() is in `removed`, and without the value infos and
    initializers (e.g. the minimums' block-sum matrices) that only those nodes used."""
    keep = [node for node in nodes if id(node) not in removed]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    live = {name for node in keep for name in (*node.input, *node.output)}
    kept_info = [v for v in model.graph.value_info if v.name in live]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    for t in [t for t in model.graph.initializer if t.name not in live]:
        model.graph.initializer.remove(t)


def _drop_dead(model) -> None:
    """The graph without the nodes nothing reads from (a fusion's leftovers), in one backward sweep: an ONNX
    graph's nodes are in topological order."""
    nodes = list(model.graph.node)
    live = {o.name for o in model.graph.output}
    dead = set()
    for node in reversed(nodes):
        if any(name in live for name in node.output):
            live.update(node.input)
        else:
            dead.add(id(node))
    if dead:
        _drop(model, nodes, dead)
