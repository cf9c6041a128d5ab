"""The LoRA graph's deltas onto ruvllm.LoraDelta (and LoraSwiGLU, LoraSplit where a projection's targets
share an input), and its adapter inputs in fp16 where only those kernels read them.
"""

from __future__ import annotations

from runtime.backends.graph_rewrite.matmul import _swiglu_tail
from runtime.backends.graph_rewrite.nodes import DOMAIN, _attr, _consumers, _drop, _drop_dead


def fuse_lora(model) -> int:
    """Each LoRA target's delta in the LoRA graph, Add(y, MatMul(Mul(Gemm(x, A^T, transB), w), B)) with A^T
    and B graph inputs (exporter/builders/lora_path.py), becomes one ruvllm.LoraDelta(y, x, A^T, B, w), which
    computes only the adapter columns each token's w selects; a constant Mul on the delta (an AWQ output
    scale) becomes its sixth input. Returns how many."""
    from onnx import helper

    from runtime import contract as C

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    inputs = {i.name for i in model.graph.input}
    inits = {i.name for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    sets = _weight_sets(model, nodes)

    def only(name: str, op_type: str):
        users = consumers.get(name, [])
        ok = len(users) == 1 and users[0].op_type == op_type and name not in graph_outputs
        return users[0] if ok else None

    removed, count = set(), 0
    for gemm in nodes:
        if gemm.op_type != "Gemm" or len(gemm.input) != 2 or gemm.input[1] not in inputs:
            continue
        if [(a.name, a.i) for a in gemm.attribute] != [("transB", 1)]:
            continue
        mul = only(gemm.output[0], "Mul")
        weights = mul and next((n for n in mul.input if n != gemm.output[0]), None)
        module = 0 if weights == C.LORA_WEIGHTS else sets.get(weights)  # a format-2 graph's one w
        matmul = module is not None and only(mul.output[0], "MatMul")
        delta = matmul and matmul.input[1] in inputs and matmul.output[0]
        scale = delta and only(delta, "Mul")  # an AWQ package's output scale (lora_path.LoraPath.apply)
        scale_init = scale and next((n for n in scale.input if n != delta and n in inits), None)
        if scale_init:
            delta = scale.output[0]
        add = delta and only(delta, "Add")
        if not add:
            continue
        base = next(n for n in add.input if n != delta)
        add.op_type, add.domain = "LoraDelta", DOMAIN
        del add.input[:]
        add.input.extend([base, gemm.input[0], gemm.input[1], matmul.input[1], C.LORA_WEIGHTS]
                         + ([scale_init] if scale_init else []))
        del add.attribute[:]
        add.attribute.extend([helper.make_attribute("scaled", int(bool(scale_init))),
                              helper.make_attribute("module", module)])
        add.name = add.name or f"lora_delta_{count}"
        removed.update((id(gemm), id(mul), id(matmul)) + ((id(scale),) if scale_init else ()))
        count += 1
    if removed:
        _drop(model, nodes, removed)
        _drop_dead(model)  # the targets' weight-set gathers
    return count


def _weight_sets(model, nodes) -> dict[str, int]:
    """The LoRA graph's per-target weights (exporter/builders/lora_path.LoraPath.mix): each Gather of
    w's sets at min(module, sets - 1), by its output -> the target's module index."""
    from onnx import numpy_helper

    from runtime import contract as C

    inits = {i.name: i for i in model.graph.initializer}
    made = {o: n for n in nodes for o in n.output}
    out = {}
    for g in nodes:
        if g.op_type != "Gather" or [(a.name, a.i) for a in g.attribute] != [("axis", 1)]:
            continue
        reshape, index = made.get(g.input[0]), made.get(g.input[1])
        if reshape is None or reshape.op_type != "Reshape" or reshape.input[0] != C.LORA_WEIGHTS:
            continue
        if index is None or index.op_type != "Min":
            continue
        module = next((inits[n] for n in index.input if n in inits), None)
        if module is not None and not module.dims:
            out[g.output[0]] = int(numpy_helper.to_array(module))
    return out


def adapters_in_half(model) -> int:
    """Declare as fp16 each adapter input (lora.*.A / .B) that only ruvllm.LoraDelta, LoraSwiGLU and
    LoraSplit read, which take either type: the deltas then read half the bytes per step. The native backend asks for it
    where the base weights are quantized, so that fp16's rounding of the adapters (~5e-4 relative) sits
    far below the base's own; an fp32 package keeps them fp32. Returns how many inputs."""
    import onnx

    from runtime import contract as C

    names = C.adapter_inputs(len(model.graph.input))  # more layers than the graph has
    consumers = _consumers(model.graph.node)
    count = 0
    for inp in model.graph.input:
        if inp.name not in names:
            continue
        users = consumers.get(inp.name, [])
        if users and all(n.domain == DOMAIN and n.op_type in ("LoraDelta", "LoraSwiGLU", "LoraSplit") for n in users):
            inp.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
            count += 1
    return count


def _lora_splits(model, parts: int):
    """The LoRA graph's Splits of one projection's output into `parts` targets along its last axis, each
    part read only by an unscaled LoraDelta, all of one input and one w. Returns the node list, an `only`
    (the single plain consumer of a tensor, else None) and (split, sizes, deltas) per match."""
    import onnx
    from onnx import numpy_helper

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    inits = {i.name: i for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}

    def only(name: str, op_type: str, domain: str = ""):
        users = consumers.get(name, [])
        ok = len(users) == 1 and users[0].op_type == op_type and users[0].domain in ((domain,) if domain else ("", "ai.onnx"))
        return users[0] if ok and name not in graph_outputs else None

    def unscaled_delta(name: str):
        d = only(name, "LoraDelta", DOMAIN)
        return d if d is not None and d.input[0] == name and len(d.input) == 5 else None

    found = []
    for split in nodes:
        if split.op_type != "Split" or len(split.output) != parts or len(split.input) != 2 or split.input[1] not in inits:
            continue
        sizes = [int(v) for v in numpy_helper.to_array(inits[split.input[1]]).reshape(-1)]
        axis = next((onnx.helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0)
        deltas = [unscaled_delta(o) for o in split.output]
        if axis not in (1, -1) or len(sizes) != parts or not all(deltas):
            continue
        # consecutive weight sets (the kernel gives target t set module + t), or a one-set graph's (all 0)
        modules = [_attr(d, "module", 0) for d in deltas]
        in_order = modules in (list(range(modules[0], modules[0] + parts)), [0] * parts)
        if len({(d.input[1], d.input[4]) for d in deltas}) == 1 and in_order:
            found.append((split, sizes, deltas))
    return nodes, consumers, only, found


def fuse_lora_swiglu(model) -> int:
    """In the LoRA graph the MLP's Split of the gate/up output, its two LoraDelta targets, Sigmoid and two
    Muls become one ruvllm.LoraSwiGLU(y, x, A_g^T, B_g, A_u^T, B_u, w) writing silu(gate) * up: the
    epilogue MatMulQ4SwiGLU folds in the base graph, which the deltas keep out of the projection here.
    Unscaled targets only (an AWQ package's scaled up_proj keeps the separate operators). Returns how many."""
    import onnx

    nodes, consumers, only, found = _lora_splits(model, 2)
    removed, count = set(), 0
    for split, halves, (gate, up) in found:
        tail = halves[0] == halves[1] and _swiglu_tail(consumers, only, gate.output[0], up.output[0])
        if not tail:
            continue
        sig, silu, prod = tail
        fused = onnx.helper.make_node("LoraSwiGLU", [split.input[0], gate.input[1], gate.input[2], gate.input[3],
                                                     up.input[2], up.input[3], gate.input[4]], [prod.output[0]],
                                      name=f"lora_swiglu_{count}", domain=DOMAIN, scaled=0,
                                      module=_attr(gate, "module", 0))
        prod.CopyFrom(fused)
        removed.update(id(x) for x in (split, gate, up, sig, silu))
        count += 1
    if removed:
        _drop(model, nodes, removed)
    return count


def fuse_lora_split(model) -> int:
    """In the LoRA graph the attention's Split of the fused q/k/v output into three, their three LoraDelta
    targets and the Concat of q and k become one ruvllm.LoraSplit(y, x, A_q^T, B_q, A_k^T, B_k, A_v^T, B_v,
    w) writing (q+k, v), as MatMulQ4Split does in the base graph. Unscaled targets only. Returns how many."""
    import onnx

    nodes, _, only, found = _lora_splits(model, 3)
    removed, count = set(), 0
    for split, sizes, (q, k, v) in found:
        concat = only(q.output[0], "Concat")
        if concat is None or list(concat.input) != [q.output[0], k.output[0]] or only(k.output[0], "Concat") is not concat:
            continue
        if next((onnx.helper.get_attribute_value(a) for a in concat.attribute if a.name == "axis"), None) not in (1, -1):
            continue
        fused = onnx.helper.make_node("LoraSplit", [split.input[0], q.input[1], q.input[2], q.input[3], k.input[2],
                                                    k.input[3], v.input[2], v.input[3], q.input[4]],
                                      [concat.output[0], v.output[0]], name=f"lora_split_{count}", domain=DOMAIN,
                                      scaled=0, split=sizes[0] + sizes[1], module=_attr(q, "module", 0))
        concat.CopyFrom(fused)
        removed.update(id(x) for x in (split, q, k, v))
        count += 1
    if removed:
        _drop(model, nodes, removed)
    return count
