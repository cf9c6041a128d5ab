"""Residual add + RMS norm onto ruvllm.SkipRMSNorm.
"""

from __future__ import annotations

from runtime.backends.graph_rewrite.nodes import DOMAIN, _consumers


def fuse_norms(model) -> int:
    """Each SkipSimplifiedLayerNormalization without bias whose mean and inverse deviation no one reads
    becomes ruvllm.SkipRMSNorm (outputs: the normed rows and the residual sum), ~10x faster than
    onnxruntime's at 576 wide. Returns how many."""
    import onnx

    consumers = _consumers(model.graph.node)
    graph_outputs = {o.name for o in model.graph.output}
    count = 0
    for i, node in enumerate(model.graph.node):
        if node.op_type != "SkipSimplifiedLayerNormalization" or node.domain != "com.microsoft" or len(node.input) != 3:
            continue
        outs = list(node.output) + [""] * (4 - len(node.output))
        if any(name and (name in consumers or name in graph_outputs) for name in outs[1:3]):
            continue
        eps = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"), 1e-5)
        fused = onnx.helper.make_node("SkipRMSNorm", list(node.input), [outs[0], outs[3] or f"{outs[0]}.sum"],
                                      name=node.name, domain=DOMAIN, epsilon=float(eps))
        model.graph.node[i].CopyFrom(fused)
        count += 1
    return count
