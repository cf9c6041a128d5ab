"""The browser weight formats: the package's quantized blocks, stored once for both browser graphs.

onnxruntime-web's WASM MatMulNBits kernel is ~20x slower than native (DESIGN §6), while its fp32
MatMul is fast. So for `--target wasm` each MatMulNBits becomes standard ONNX
DequantizeLinear (blocked, opset 21) -> MatMul over the very same quantized values, stored [N, K]: the
download stays int4/int8-sized, and onnxruntime's constant folding expands the weights (and their
transpose) to fp32 once at session creation (with `session.disable_quant_qdq=1`, which stops it fusing
them back). A tied embedding table is read from the dequantized LM head, so it is not shipped twice.
Blocks with float minimums (a GGUF's Q4_1) get them added to the dequantized weight, folded at load like
the rest, so the page computes with the file's exact weights and runs no extra operator for them.

On WebGPU the weights stay at their bits (keep_blocks_for_webgpu): [N, K] is MatMulNBits' own byte
layout, so that graph's MatMulNBits reads the same bytes from the same file.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from exporter.quantizers.block_matmul import take_minimum_terms
from exporter.quantizers.grid import fp16_exact
from exporter.quantizers.quantize import LM_HEAD_NODE
from runtime.backends.block_layouts import unpack_4bit

# The session option a runtime must set for this format (documented in docs/design/package.md).
SESSION_CONFIG = {"session.disable_quant_qdq": "1"}


def _dims(node: onnx.NodeProto) -> tuple[int, int, int, int]:
    """A MatMulNBits node's K, N, bits and block size."""
    a = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return a["K"], a["N"], a["bits"], a["block_size"]


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
        k, n, bits, block = _dims(node)
        if k % block or (bits == 4 and n % 2):
            raise ValueError(f"{node.name}: K={k}, N={n} do not fit {bits}-bit blocks of {block}")
        x, w_name, s_name, zp_name = node.input[:4]
        blocks = k // block
        elem = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
        # MatMulNBits packs B as [N, K/block, block*bits/8] bytes, low nibble first (zero points
        # [N, K/block] likewise): the same bytes as an ONNX uint4/uint8 tensor [N, K]. Stored so, the
        # WebGPU graph's MatMulNBits (keep_blocks_for_webgpu) reads these very bytes from the shared file.
        w = _unpack(inits[w_name], bits, (n, k))
        zp = _unpack(inits[zp_name], bits, (n, blocks))
        scales = numpy_helper.to_array(inits[s_name]).reshape(n, blocks)
        inits[w_name] = _pack(w_name, w, elem, bits)
        inits[zp_name] = _pack(zp_name, zp, elem, bits)
        inits[s_name] = browser_scales(s_name, scales, exact)
        s32 = f"{s_name}/fp32"
        nodes.append(helper.make_node("Cast", [s_name], [s32], name=f"{node.name}/scales", to=TensorProto.FLOAT))
        deq = f"{w_name}/dequantized"  # [N, K]
        nodes.append(helper.make_node("DequantizeLinear", [w_name, s32, zp_name], [deq], name=f"{node.name}/dq",
                                      axis=1, block_size=block))
        outputs = list(node.output)
        if node.name in terms:  # + each block's minimum, expanded along the block: still folded at load
            # stored [blocks, N] as the WebGPU graph's minimum term reads them, so the file holds them once
            mins, outputs = terms[node.name][0], [terms[node.name][1]]
            m_name = f"{w_name}/mins"
            inits[m_name] = numpy_helper.from_array(np.ascontiguousarray(mins, np.float16 if fp16_exact(mins) else np.float32), m_name)
            m32 = m_name if inits[m_name].data_type == TensorProto.FLOAT else f"{m_name}/fp32"
            if m32 != m_name:
                nodes.append(helper.make_node("Cast", [m_name], [m32], name=f"{node.name}/mins_fp32", to=TensorProto.FLOAT))
            nodes.append(helper.make_node("Transpose", [m32], [f"{m_name}/T"], name=f"{node.name}/mins_T", perm=[1, 0]))
            m32 = f"{m_name}/T"  # [N, blocks]
            shape_name, full_name, axes = f"{m_name}/expand", f"{m_name}/shape", f"{m_name}/axes"
            inits[shape_name] = numpy_helper.from_array(np.array([n, blocks, block], np.int64), shape_name)
            inits[full_name] = numpy_helper.from_array(np.array([n, k], np.int64), full_name)
            inits[axes] = numpy_helper.from_array(np.array([2], np.int64), axes)
            nodes += [helper.make_node("Unsqueeze", [m32, axes], [f"{m_name}/u"], name=f"{node.name}/mins_u"),
                      helper.make_node("Expand", [f"{m_name}/u", shape_name], [f"{m_name}/e"], name=f"{node.name}/mins_e"),
                      helper.make_node("Reshape", [f"{m_name}/e", full_name], [f"{m_name}/w"], name=f"{node.name}/mins_w"),
                      helper.make_node("Add", [deq, f"{m_name}/w"], [f"{deq}+mins"], name=f"{node.name}/add_mins")]
            deq = f"{deq}+mins"
        if node.name.startswith(LM_HEAD_NODE) and tied_embedding:  # the embedding gathers its rows
            head_table = deq
            nodes.append(helper.make_node("Gemm", [x, deq], outputs, name=node.name, transB=1))
        else:  # MatMul's B is [K, N]: the transpose of a constant, folded at load with the rest
            nodes += [helper.make_node("Transpose", [deq], [f"{deq}/T"], name=f"{node.name}/T", perm=[1, 0]),
                      helper.make_node("MatMul", [x, f"{deq}/T"], outputs, name=node.name)]
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


def browser_scales(name: str, scales: np.ndarray, exact: bool) -> onnx.TensorProto:
    """A projection's block scales [N, blocks] as both browser graphs store them: fp16 (7 MB less to download
    for SmolLM2; their rounding is far below int4's own error), or fp32 where `exact` asks to keep a GGUF's
    weights bit-equal and fp16 would round them. Each graph casts them back to fp32 before use."""
    s_type = np.float32 if exact and not fp16_exact(scales) else np.float16
    return numpy_helper.from_array(np.ascontiguousarray(scales, s_type), name)


def keep_blocks_for_webgpu(model: onnx.ModelProto, tied_embedding: str | None = None,
                           exact: bool = False) -> onnx.ModelProto:
    """The WebGPU graph: every MatMulNBits stays one (onnxruntime's WebGPU kernel unpacks the blocks in its
    shader; accuracy_level 0, so fp32 activations and sums: Gemma 3 overflows fp16), so the GPU holds the package's 4- or 8-bit weights, never an fp32 copy.
    It reads the same bytes as the WASM graph (dequantize_at_load): B and zero points are already so, the
    scales are stored as browser_scales does, so the shared file holds each tensor once. A tied embedding
    gathers its rows from the LM head's blocks (com.microsoft.GatherBlockQuantized), as the WASM graph
    gathers them from the dequantized head: the two graphs compute with the same weights. In place."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    head = None  # (B, fp32 scales, zero points, bits, block) of a tied head without a minimum term
    has_mins = {n.name[:-len("/add_mins")] + "/MatMulNBits" for n in graph.node if n.name.endswith("/add_mins")}
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        k, n, bits, block = _dims(node)
        s_name = node.input[2]
        scales = numpy_helper.to_array(inits[s_name]).astype(np.float32).reshape(n, k // block)
        inits[s_name] = browser_scales(s_name, scales, exact)
        if inits[s_name].data_type != TensorProto.FLOAT:
            s32 = f"{s_name}/fp32"
            nodes.append(helper.make_node("Cast", [s_name], [s32], name=f"{node.name}/scales", to=TensorProto.FLOAT))
            node.input[2] = s32
        for attr in node.attribute:  # accuracy_level 4 quantizes the activations to int8 (the DP4A kernel)
            if attr.name == "accuracy_level":
                attr.i = 0
        tied_head = node.name.startswith(LM_HEAD_NODE) and tied_embedding
        if tied_head and len(node.input) > 3 and node.name not in has_mins:
            # GatherBlockQuantized reads a [vocab, hidden * bits / 8] byte table; the WebGPU MatMulNBits reads
            # B by its bytes, so the one tensor serves both (the same bytes as MatMulNBits' [N, blocks, blob])
            w = inits[node.input[1]]
            del w.dims[:]
            w.dims.extend([n, k * bits // 8])
            head = (node.input[1], node.input[2], node.input[3], bits, block)
        nodes.append(node)
    if head is not None:
        b_name, s32, zp_name, bits, block = head
        for i, node in enumerate(nodes):
            if node.op_type == "Gather" and node.input[0] == tied_embedding:
                nodes[i] = helper.make_node("GatherBlockQuantized", [b_name, node.input[1], s32, zp_name],
                                            list(node.output), name=node.name, domain="com.microsoft",
                                            gather_axis=0, quantize_axis=1, block_size=block, bits=bits)
        used = {i for node in nodes for i in node.input}
        inits = {name: t for name, t in inits.items() if name in used}
    # An fp16 table left (an untied embedding): a GPU without shader-f16 (SwiftShader's) has no fp16 Gather, so
    # the table is cast first, which onnxruntime folds once at load: an fp32 table of fp16 values, no int4 in it
    for node in list(nodes):
        table = inits.get(node.input[0]) if node.op_type == "Gather" else None
        if table is not None and table.data_type == TensorProto.FLOAT16:
            wide = f"{node.input[0]}/fp32"
            nodes.insert(nodes.index(node), helper.make_node("Cast", [node.input[0]], [wide], name=f"{node.name}/widen",
                                                             to=TensorProto.FLOAT))
            node.input[0] = wide
    graph.ClearField("node")
    graph.node.extend(nodes)
    graph.ClearField("initializer")
    graph.initializer.extend(inits.values())
    return model


def _unpack(t: onnx.TensorProto, bits: int, shape: tuple[int, int]) -> np.ndarray:
    raw = np.frombuffer(t.raw_data or numpy_helper.to_array(t).tobytes(), np.uint8)
    rows, cols = shape  # MatMulNBits pads each row of 4-bit zero points to whole bytes (an odd block count)
    return raw.reshape(shape) if bits == 8 else unpack_4bit(raw.reshape(rows, -1), cols)


def _pack(name: str, values: np.ndarray, elem: int, bits: int) -> onnx.TensorProto:
    flat = np.ascontiguousarray(values).reshape(-1)
    raw = flat if bits == 8 else (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    return helper.make_tensor(name, elem, list(values.shape), raw.tobytes(), raw=True)
