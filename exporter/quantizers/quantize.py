"""Weight-only quantization of the decoder's MatMuls with onnxruntime's MatMulNBits quantizer."""

from __future__ import annotations

import logging

import onnx

from exporter.builders.onnx_builder import replace_graph

QUANTS = ("fp32", "fp16", "int8", "int4", "w8a8")
LM_HEAD_NODE = "lm_head/MatMul"
MLP_WEIGHTS = (".gate_up_proj", ".down_proj")  # initializer names of the MLP's projections (exporter/builders)
BITS = {"int8": 8, "int4": 4}
# w8a8 weights in [-63, 63] (7 bits, "reduce_range"): MLAS's u8 x s8 GEMM on CPUs without AVX-512 VNNI
# sums pairs of products in int16 (vpmaddubsw), and activations stored as uint8 around 128 times weights
# up to 127 overflow it (2 * 255 * 127 > 32767); with 63 they cannot. Measured on the tiny test model on an
# AVX2 host: KL to fp32 0.0114 with 127, under the test's 0.01 bound with 63.
W8A8_WEIGHT_MAX = 63
METHODS = ("rtn", "awq", "gptq", "awq+gptq", "hqq", "smoothquant")


def w8a8_matmuls(model: onnx.ModelProto, skip: set[str]) -> onnx.ModelProto:
    """Rewrite every MatMul with a constant weight (but those in `skip`) into int8 x int8: the weight
    per output channel (symmetric), the activations per row (absmax, as uint8 around 128) so that a
    row's result never depends on the other rows of the batch, then MLAS's u8s8 QGEMM (MatMulInteger).
    At 16 rows that GEMM is ~1.5x MatMulNBits' int4 kernel; at one row it reads twice int4's bytes."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weights = {i.name: i for i in model.graph.initializer}
    nodes, drop, added = [], set(), []
    for node in model.graph.node:
        w = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or node.name in skip:
            nodes.append(node)
            continue
        p, x, y = f"{node.input[1]}/w8a8/", node.input[0], node.output[0]
        if w.name not in drop:  # a weight two MatMuls share is quantized once
            wf = numpy_helper.to_array(w).astype(np.float32)  # [K, N]
            scale = np.maximum(np.abs(wf).max(axis=0), 1e-12) / W8A8_WEIGHT_MAX
            q = np.clip(np.round(wf / scale), -W8A8_WEIGHT_MAX, W8A8_WEIGHT_MAX).astype(np.int8)
            added += [numpy_helper.from_array(q, p + "weight"), numpy_helper.from_array(scale.astype(np.float32), p + "scale")]
            drop.add(w.name)
        nodes += [helper.make_node("Abs", [x], [p + "abs"]),
                  helper.make_node("ReduceMax", [p + "abs", "w8a8/axis"], [p + "max"], keepdims=1),
                  helper.make_node("Max", [p + "max", "w8a8/tiny"], [p + "range"]),
                  helper.make_node("Div", [p + "range", "w8a8/127"], [p + "row_scale"]),
                  helper.make_node("Div", [x, p + "row_scale"], [p + "scaled"]),
                  helper.make_node("QuantizeLinear", [p + "scaled", "w8a8/one", "w8a8/zero"], [p + "xq"]),
                  helper.make_node("MatMulInteger", [p + "xq", p + "weight", "w8a8/zero"], [p + "acc"]),
                  helper.make_node("Cast", [p + "acc"], [p + "accf"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [p + "accf", p + "row_scale"], [p + "rows"]),
                  helper.make_node("Mul", [p + "rows", p + "scale"], [y], name=node.name)]
    if not drop:
        return model
    added += [numpy_helper.from_array(np.array([-1], np.int64), "w8a8/axis"),
              numpy_helper.from_array(np.array(1e-6, np.float32), "w8a8/tiny"),
              numpy_helper.from_array(np.array(127, np.float32), "w8a8/127"),
              numpy_helper.from_array(np.array(1, np.float32), "w8a8/one"),
              numpy_helper.from_array(np.array(128, np.uint8), "w8a8/zero")]
    return replace_graph(model, nodes, [t for t in model.graph.initializer if t.name not in drop] + added)


def mlp_nodes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1].endswith(MLP_WEIGHTS)]


def quantize_weights(model: onnx.ModelProto, quant: str, block_size: int = 32,
                     accuracy_level: int = 4, head_quant: str = "int8",
                     mlp_block_size: int | None = None, grids: dict | None = None,
                     skip: frozenset[str] = frozenset()) -> onnx.ModelProto:
    """Block-wise asymmetric RTN; the LM head gets its own bits (convert.head_plan chooses them),
    the MLP's projections their own block size if given (convert.weight_plan says why). `grids`
    (gptq.Grid by graph weight name) replace RTN's integers, scales and zero points where given.
    MatMuls named in `skip` stay as they are (a GGUF's own blocks take their place, block_matmul.py).

    accuracy_level=4 lets the CPU kernel compute in int8, the fast path on x86 and ARM.
    """
    if quant in ("fp32", "fp16"):
        return model
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    bits, head_bits = BITS.get(quant, 8), BITS[head_quant]

    def run(m: onnx.ModelProto, nbits: int, only: set[str], block: int = block_size) -> onnx.ModelProto:
        """Quantize the MatMuls named in `only`. (The quantizer's nodes_to_include adds nodes to the
        MatMuls it quantizes anyway, so the others are excluded by name.)"""
        others = [n.name for n in m.graph.node if n.op_type == "MatMul" and n.name not in only]
        cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=False,
                                           accuracy_level=accuracy_level, bits=nbits)
        q = MatMulNBitsQuantizer(m, bits=nbits, block_size=block, is_symmetric=False,
                                 accuracy_level=accuracy_level, nodes_to_exclude=others, algo_config=cfg)
        q.process()
        return q.model.model

    matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul"} - skip
    mlp = set(mlp_nodes(model)) if mlp_block_size and mlp_block_size != block_size else set()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantizer rewrites the graph it is given
    model = copy
    if quant == "w8a8":  # every projection but the head; the head is MatMulNBits below
        model = w8a8_matmuls(model, skip={LM_HEAD_NODE})
        matmuls &= {LM_HEAD_NODE}
    if mlp:
        model = run(model, bits, mlp, block=mlp_block_size)
    if matmuls - mlp - {LM_HEAD_NODE}:
        model = run(model, bits, matmuls - mlp - {LM_HEAD_NODE})
    if LM_HEAD_NODE in matmuls:
        model = run(model, head_bits, {LM_HEAD_NODE})
    return with_grids(model, grids) if grids else model


def with_grids(model: onnx.ModelProto, grids: dict) -> onnx.ModelProto:
    """Put each Grid's packed integers, scales and zero points in place of the MatMulNBits
    initializers quantized from the same weight (named `<weight>_Q<bits>`, `_scales`, `_zero_points`)."""
    from onnx import numpy_helper

    from exporter.quantizers.grid import pack_nbits

    inits = {t.name: t for t in model.graph.initializer}
    done = set()
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        name = node.input[1].rsplit("_Q", 1)[0]
        grid = grids.get(name)
        if grid is None:
            continue
        if (grid.bits, grid.block, grid.q.shape) != (attrs["bits"], attrs["block_size"], (attrs["N"], attrs["K"])):
            raise ValueError(f"{name}: grid {grid.bits} bits / block {grid.block} / {grid.q.shape} does not match "
                             f"its MatMulNBits ({attrs['bits']} / {attrs['block_size']} / N={attrs['N']}, K={attrs['K']})")
        for tensor_name, value in zip(node.input[1:4], pack_nbits(grid)):
            old = inits[tensor_name]
            if tuple(old.dims) != value.shape:
                raise ValueError(f"{tensor_name}: packed {value.shape}, MatMulNBits has {tuple(old.dims)}")
            dtype = onnx.helper.tensor_dtype_to_np_dtype(old.data_type)
            old.CopyFrom(numpy_helper.from_array(value.astype(dtype), tensor_name))
        done.add(name)
    missing = set(grids) - done
    if missing:
        raise ValueError(f"no MatMulNBits for {len(missing)} quantized weights, e.g. {sorted(missing)[0]}")
    return model
