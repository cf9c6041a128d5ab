"""The browser weight format: quantized storage, fp32 compute.

onnxruntime-web's WASM MatMulNBits kernel is ~20x slower than native (DESIGN §6), while its fp32
MatMul is fast. So for `--target wasm` each MatMulNBits becomes standard ONNX
DequantizeLinear (blocked, opset 21) -> MatMul over the very same quantized values, stored [K, N]: the
download stays int4/int8-sized, and onnxruntime's constant folding expands the weights to fp32
once at session creation (with `session.disable_quant_qdq=1`, which stops it fusing them back).
A tied embedding table is read from the dequantized LM head, so it is not shipped twice. Blocks with
float minimums (a GGUF's Q4_1) get them added to the dequantized weight, folded at load like the rest,
so the page computes with the file's exact weights and runs no extra operator for them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from exporter.quantizers.block_matmul import take_minimum_terms
from exporter.quantizers.grid import fp16_exact
from exporter.quantizers.quantize import LM_HEAD_NODE
from runtime.backends.block_layouts import unpack_4bit

# The session option a runtime must set for this format (documented in docs/ARCHITECTURE.md).
SESSION_CONFIG = {"session.disable_quant_qdq": "1"}


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def dequantize_at_load(model: onnx.ModelProto, tied_embedding: str | None = None,
                       exact: bool = False) -> onnx.ModelProto:
    """Rewrite every MatMulNBits node of `model` in place; return it.

    tied_embedding names the embedding initializer to replace by the dequantized LM head.
    exact: keep scales in fp32 where fp16 would round them (a GGUF's weights stay bit-equal).
    """
    terms = take_minimum_terms(model)
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
        if k % block or (bits == 4 and n % 2):
            raise ValueError(f"{node.name}: K={k}, N={n} do not fit {bits}-bit blocks of {block}")
        x, w_name, s_name, zp_name = node.input[:4]
        blocks = k // block
        elem = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
        # MatMulNBits packs B as [N, K/block, block*bits/8] bytes, low nibble first (zero points
        # [N, K/block] likewise): the same bytes as an ONNX uint4/uint8 tensor [N, K]
        w = _unpack(inits[w_name], bits, (n, k))
        zp = _unpack(inits[zp_name], bits, (n, blocks))
        scales = numpy_helper.to_array(inits[s_name]).reshape(n, blocks)
        tied_head = node.name.startswith(LM_HEAD_NODE) and tied_embedding
        if not tied_head:  # store [K, N], blocked along K: the dequantized weight is MatMul's B as it is
            w, zp, scales = w.T, zp.T, scales.T
        inits[w_name] = _pack(w_name, w, elem, bits)
        inits[zp_name] = _pack(zp_name, zp, elem, bits)
        # fp16 scales (7 MB less to download for SmolLM2; their rounding is far below int4's own error),
        # cast back to fp32 before DequantizeLinear so the big tensor is expanded straight to fp32
        s_type = np.float32 if exact and not fp16_exact(scales) else np.float16
        inits[s_name] = numpy_helper.from_array(np.ascontiguousarray(scales, s_type), s_name)
        s32 = f"{s_name}/fp32"
        nodes.append(helper.make_node("Cast", [s_name], [s32], name=f"{node.name}/scales", to=TensorProto.FLOAT))
        deq = f"{w_name}/dequantized"
        nodes.append(helper.make_node("DequantizeLinear", [w_name, s32, zp_name], [deq], name=f"{node.name}/dq",
                                      axis=1 if tied_head else 0, block_size=block))
        outputs = list(node.output)
        if node.name in terms:  # + each block's minimum, expanded along the block: still folded at load
            mins, outputs = terms[node.name][0], [terms[node.name][1]]
            if tied_head:
                mins = mins.T  # [N, blocks]
            m_name = f"{w_name}/mins"
            inits[m_name] = numpy_helper.from_array(np.ascontiguousarray(mins, np.float16 if fp16_exact(mins) else np.float32), m_name)
            m32 = m_name if inits[m_name].data_type == TensorProto.FLOAT else f"{m_name}/fp32"
            if m32 != m_name:
                nodes.append(helper.make_node("Cast", [m_name], [m32], name=f"{node.name}/mins_fp32", to=TensorProto.FLOAT))
            axis = 2 if tied_head else 1  # the block's position within the weight's blocked dimension
            full = [n, blocks, block] if tied_head else [blocks, block, n]
            shape_name, full_name = f"{m_name}/expand", f"{m_name}/shape"
            inits[shape_name] = numpy_helper.from_array(np.array(full, np.int64), shape_name)
            inits[full_name] = numpy_helper.from_array(np.array([n, k] if tied_head else [k, n], np.int64), full_name)
            axes = f"{m_name}/axes"
            inits[axes] = numpy_helper.from_array(np.array([axis], np.int64), axes)
            nodes += [helper.make_node("Unsqueeze", [m32, axes], [f"{m_name}/u"], name=f"{node.name}/mins_u"),
                      helper.make_node("Expand", [f"{m_name}/u", shape_name], [f"{m_name}/e"], name=f"{node.name}/mins_e"),
                      helper.make_node("Reshape", [f"{m_name}/e", full_name], [f"{m_name}/w"], name=f"{node.name}/mins_w"),
                      helper.make_node("Add", [deq, f"{m_name}/w"], [f"{deq}+mins"], name=f"{node.name}/add_mins")]
            deq = f"{deq}+mins"
        if tied_head:  # [vocab, hidden]: the logits read it transposed, the embedding gathers its rows
            head_table = deq
            nodes.append(helper.make_node("Gemm", [x, deq], outputs, name=node.name, transB=1))
        else:
            nodes.append(helper.make_node("MatMul", [x, deq], outputs, name=node.name))
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


def _unpack(t: onnx.TensorProto, bits: int, shape: tuple[int, int]) -> np.ndarray:
    raw = np.frombuffer(t.raw_data or numpy_helper.to_array(t).tobytes(), np.uint8)
    rows, cols = shape  # MatMulNBits pads each row of 4-bit zero points to whole bytes (an odd block count)
    return raw.reshape(shape) if bits == 8 else unpack_4bit(raw.reshape(rows, -1), cols)


def _pack(name: str, values: np.ndarray, elem: int, bits: int) -> onnx.TensorProto:
    flat = np.ascontiguousarray(values).reshape(-1)
    raw = flat if bits == 8 else (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    return helper.make_tensor(name, elem, list(values.shape), raw.tobytes(), raw=True)
