"""The browser weight format: quantized storage, fp32 compute.

onnxruntime-web's WASM MatMulNBits kernel is ~20x slower than native (DESIGN §6), while its fp32
MatMul is fast. So for `--target wasm` each MatMulNBits becomes standard ONNX
DequantizeLinear (blocked, opset 21) -> Transpose -> MatMul over the very same packed weights: the
download stays int4/int8-sized, and onnxruntime's constant folding expands the weights to fp32
once at session creation (with `session.disable_quant_qdq=1`, which stops it fusing them back).
A tied embedding table is read from the dequantized LM head, so it is not shipped twice.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from exporter.quantize import LM_HEAD_NODE

# The session option a runtime must set for this format (documented in docs/ARCHITECTURE.md).
SESSION_CONFIG = {"session.disable_quant_qdq": "1"}


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def dequantize_at_load(model: onnx.ModelProto, tied_embedding: str | None = None) -> onnx.ModelProto:
    """Rewrite every MatMulNBits node of `model` in place; return it.

    tied_embedding names the embedding initializer to replace by the dequantized LM head.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    head_table = None  # the dequantized LM head, [vocab, hidden]
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        a = _attrs(node)
        k, n, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
        if k % block or (bits == 4 and (k // block) % 2):
            raise ValueError(f"{node.name}: K={k} is not a whole, even number of {block}-blocks")
        x, w_name, s_name, zp_name = node.input[:4]
        blocks = k // block
        elem = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
        # MatMulNBits packs B as [N, K/block, block*bits/8] bytes, low nibble first: the same bytes
        # as an ONNX uint4/uint8 tensor [N, K]. Zero points likewise, [N, K/block].
        for name, dims in ((w_name, [n, k]), (zp_name, [n, blocks])):
            t = inits[name]
            raw = t.raw_data or numpy_helper.to_array(t).tobytes()
            inits[name] = helper.make_tensor(name, elem, dims, raw, raw=True)
        # fp16 scales: 7 MB less to download for SmolLM2; their rounding is far below int4's own error
        scales = numpy_helper.to_array(inits[s_name]).astype(np.float16).reshape(n, blocks)
        inits[s_name] = numpy_helper.from_array(scales, s_name)
        deq = f"{w_name}/dequantized"  # [N, K]
        nodes.append(helper.make_node("DequantizeLinear", [w_name, s_name, zp_name], [f"{deq}/fp16"],
                                      name=f"{node.name}/dq", axis=1, block_size=block))
        nodes.append(helper.make_node("Cast", [f"{deq}/fp16"], [deq], name=f"{node.name}/cast", to=TensorProto.FLOAT))
        if node.name.startswith(LM_HEAD_NODE) and tied_embedding:
            head_table = deq
            nodes.append(helper.make_node("Gemm", [x, deq], list(node.output), name=node.name, transB=1))
        else:
            wt = f"{w_name}/t"
            nodes.append(helper.make_node("Transpose", [deq], [wt], name=f"{node.name}/t", perm=[1, 0]))
            nodes.append(helper.make_node("MatMul", [x, wt], list(node.output), name=node.name))
    if tied_embedding and head_table is not None:
        for node in nodes:
            if node.op_type == "Gather" and node.input[0] == tied_embedding:
                node.input[0] = head_table  # the Cast of the gathered rows becomes float -> float
    graph.ClearField("node")
    graph.node.extend(nodes)
    kept = [t for name, t in inits.items() if name != tied_embedding or head_table is None]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    return model

