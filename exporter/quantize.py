"""Weight-only quantization of the decoder's MatMuls with onnxruntime's MatMulNBits quantizer."""

from __future__ import annotations

import logging

import onnx

QUANTS = ("fp32", "fp16", "int8", "int4")
LM_HEAD_NODE = "lm_head/MatMul"
MLP_WEIGHTS = (".gate_up_proj", ".down_proj")  # initializer names of the MLP's projections (decoder_graph)
BITS = {"int8": 8, "int4": 4}
METHODS = ("rtn", "awq")


def mlp_nodes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1].endswith(MLP_WEIGHTS)]


def quantize_weights(model: onnx.ModelProto, quant: str, block_size: int = 32,
                     accuracy_level: int = 4, head_quant: str = "int8",
                     mlp_block_size: int | None = None) -> onnx.ModelProto:
    """Block-wise asymmetric RTN; the LM head gets its own bits (convert.head_plan chooses them),
    the MLP's projections their own block size if given (convert.weight_plan says why).

    accuracy_level=4 lets the CPU kernel compute in int8, the fast path on x86 and ARM.
    """
    if quant in ("fp32", "fp16"):
        return model
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    bits, head_bits = BITS[quant], BITS[head_quant]

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

    matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul"}
    mlp = set(mlp_nodes(model)) if mlp_block_size and mlp_block_size != block_size else set()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantizer rewrites the graph it is given
    model = copy
    if mlp:
        model = run(model, bits, mlp, block=mlp_block_size)
    model = run(model, bits, matmuls - mlp - {LM_HEAD_NODE})
    if LM_HEAD_NODE in matmuls:
        model = run(model, head_bits, {LM_HEAD_NODE})
    return model
