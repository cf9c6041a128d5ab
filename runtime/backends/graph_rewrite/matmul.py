"""Projections onto ruvllm.MatMulQ4 / MatMulQ8, with the block minimums and the epilogues (SwiGLU, the q+k | v
split) folded into the kernel's output.
"""

from __future__ import annotations

import math
from pathlib import Path

from runtime.backends.graph_rewrite.nodes import DOMAIN, OP, _attr, _consumers, _drop


def _all_128(tensor, base_dir: Path | None) -> bool:
    """Whether an initializer's bytes (in the graph, or in its external data under base_dir) are all 128."""
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        data = tensor.raw_data or bytes(tensor.int32_data)
    else:
        info = {e.key: e.value for e in tensor.external_data}
        if base_dir is None:
            return False
        try:
            with open(base_dir / info["location"], "rb") as f:
                f.seek(int(info.get("offset", 0)))
                data = f.read(math.prod(tensor.dims))
        except (OSError, KeyError, ValueError):
            return False
    return bool(data) and data.count(128) == len(data)


def fuse_minimums(model) -> int:
    """Fold each block-minimum term the exporter adds beside a 4-bit projection (exporter/block_matmul.py:
    Gemm(MatMul(x, block_ones), Cast(fp16 minimums), C=MatMulNBits(x))) into its ruvllm.MatMulQ4,
    which then reads the minimums as a fifth input. Terms with fp32 minimums (not exact in fp16) stay
    as they are, beside the kernel. Returns how many were folded."""
    import onnx

    nodes = list(model.graph.node)
    inits = {i.name: i for i in model.graph.initializer}
    consumers = _consumers(nodes)
    producer = {name: node for node in nodes for name in node.output}
    graph_outputs = {o.name for o in model.graph.output}
    removed, count = set(), 0
    for node in nodes:
        if node.op_type != OP or node.domain != DOMAIN:
            continue
        users = consumers.get(node.output[0], [])
        gemm = users[0] if len(users) == 1 and users[0].op_type == "Gemm" and len(users[0].input) == 3 else None
        plain = gemm and not any(a.name in ("transA", "transB") and a.i or a.name in ("alpha", "beta") and a.f != 1
                                 for a in gemm.attribute)
        sums = plain and gemm.input[2] == node.output[0] and producer.get(gemm.input[0])
        cast = plain and producer.get(gemm.input[1])
        mins = cast and cast.op_type == "Cast" and inits.get(cast.input[0])
        if not (sums and sums.op_type == "MatMul" and sums.input[0] == node.input[0] and mins
                and mins.data_type == onnx.TensorProto.FLOAT16 and node.output[0] not in graph_outputs):
            continue
        node.input.append(mins.name)
        next(a for a in node.attribute if a.name == "mins").i = 1
        node.output[0] = gemm.output[0]
        removed.update((id(gemm), id(sums)))
        if consumers.get(cast.output[0]) == [gemm]:
            removed.add(id(cast))
        count += 1
    if removed:
        _drop(model, nodes, removed)
    return count


def fuse_epilogues(model) -> tuple[int, int]:
    """Fold what follows a projection into the kernel's output: the MLP's gate/up projection followed by
    Split, Sigmoid and two Muls becomes one ruvllm.MatMulQ4SwiGLU writing silu(gate) * up; the attention's
    q/k/v projection followed by Unsqueeze and Split becomes one ruvllm.MatMulQ4Split writing the q+k and
    v parts as two tensors. Each removed operator was a pass over the projection's output (and a
    dispatch, which is most of their cost at one decode row). Returns how many of each were folded."""
    import onnx
    from onnx import numpy_helper

    nodes = list(model.graph.node)
    inits = {i.name: i for i in model.graph.initializer}
    consumers = _consumers(nodes)
    graph_outputs = {o.name for o in model.graph.output}

    def only(name: str, op_type: str):
        users = consumers.get(name, [])
        ok = len(users) == 1 and users[0].op_type == op_type and users[0].domain in ("", "ai.onnx")
        return users[0] if ok and name not in graph_outputs else None

    attr = _attr

    def const(node, i: int) -> list[int] | None:
        init = inits.get(node.input[i]) if len(node.input) > i else None
        return [int(v) for v in numpy_helper.to_array(init).reshape(-1)] if init is not None else None

    removed, swiglu, qkv = set(), 0, 0
    for node in nodes:
        if node.op_type != OP or node.domain != DOMAIN:
            continue
        n = next(a.i for a in node.attribute if a.name == "N")
        split = only(node.output[0], "Split")
        if split and attr(split, "axis") in (1, -1) and const(split, 1) == [n // 2, n // 2] and n % 32 == 0:
            tail = _swiglu_tail(consumers, only, *split.output)
            if tail:
                node.op_type = "MatMulQ4SwiGLU"
                node.output[0] = tail[-1].output[0]
                removed.update(id(x) for x in (split, *tail))
                swiglu += 1
            continue
        unsqueeze = only(node.output[0], "Unsqueeze")  # [tokens, 1, n], split along n into q+k and v
        split = unsqueeze and const(unsqueeze, 1) == [1] and only(unsqueeze.output[0], "Split")
        parts = split and len(split.output) == 2 and attr(split, "axis") in (2, -1) and const(split, 1)
        v_users = consumers.get(split.output[1], []) if parts else []
        if (parts and sum(parts) == n and parts[0] % 16 == 0 and parts[1] > 0 and v_users
                and all(u.op_type == "Reshape" for u in v_users) and split.output[1] not in graph_outputs):
            node.op_type = "MatMulQ4Split"
            node.attribute.append(onnx.helper.make_attribute("split", parts[0]))
            node.output.append(split.output[1])  # v: [tokens, n_v] where it was [tokens, 1, n_v]: only reshaped
            unsqueeze.output[0] = split.output[0]  # q+k: the Unsqueeze now gives RotaryEmbedding its 3-D input
            removed.add(id(split))
            qkv += 1
    if removed:
        _drop(model, nodes, removed)
    return swiglu, qkv


def _swiglu_tail(consumers: dict, only, gate: str, up: str) -> tuple | None:
    """(Sigmoid, Mul, Mul) computing silu(gate) * up from the tensors gate and up, when nothing else reads
    them or what is between; `only(name, op_type)` is the caller's single-consumer test."""
    users = consumers.get(gate, [])
    sig = next((u for u in users if u.op_type == "Sigmoid"), None)
    silu = sig and only(sig.output[0], "Mul")
    prod = silu and only(silu.output[0], "Mul")
    if (len(users) == 2 and silu in users and set(silu.input) == {gate, sig.output[0]} and prod
            and set(prod.input) == {silu.output[0], up} and consumers.get(up) == [prod]):
        return sig, silu, prod
    return None


def fuse_matmuls(model, ops: frozenset[str], base_dir: Path | None) -> tuple[int, int]:
    """Every MatMulNBits the kernel computes the same way becomes ruvllm.MatMulQ4 or MatMulQ8 (when in `ops`):
    only 4-bit nodes with int8 compute (accuracy_level 4), packed uint8 zero points and fp32 scales, all
    initializers, qualify; the rest (fp32-compute test packages, fp16 scales) keep MLAS's kernel. 8-bit nodes
    of that kind whose zero points are all 128 (a GGUF's Q8_0: the integers minus 128 fit a signed byte
    whatever they are) become MatMulQ8; `base_dir` is where the graph's external data lives, to read those
    zero points. Returns (MatMulQ4, MatMulQ8) in the graph after, the exporter's own included."""
    import onnx

    from runtime.backends.block_layouts import kernel_grid

    inits = {i.name: i for i in model.graph.initializer}
    # the exporter's own MatMulQ4 (a GGUF's Q4_K at its own bits): already on the kernel, counted as fused
    count = sum(1 for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP)
    q8 = sum(1 for n in model.graph.node if n.domain == DOMAIN and n.op_type == "MatMulQ8")
    for node in model.graph.node:
        layout = kernel_grid(node, inits)
        op = None if layout is None else {4: "MatMulQ4", 8: "MatMulQ8"}.get(layout.bits)
        if op not in ops:
            continue
        if op == "MatMulQ8":
            if _all_128(inits[node.input[3]], base_dir):
                node.op_type, node.domain = op, DOMAIN
                q8 += 1
            continue
        node.op_type, node.domain = OP, DOMAIN
        node.attribute.append(onnx.helper.make_attribute("mins", 0))
        count += 1
    return count, q8
