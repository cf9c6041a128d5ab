"""Weight-only quantization of the decoder's MatMuls with onnxruntime's MatMulNBits quantizer."""

from __future__ import annotations

import logging

import onnx

QUANTS = ("fp32", "fp16", "int8", "int4")
LM_HEAD_NODE = "lm_head/MatMul"
BITS = {"int8": 8, "int4": 4}
METHODS = ("rtn", "awq")


def quantize_weights(model: onnx.ModelProto, quant: str, block_size: int = 32,
                     accuracy_level: int = 4, head_quant: str = "int8") -> onnx.ModelProto:
    """Block-wise asymmetric RTN; the LM head gets its own bits (convert.head_plan chooses them).

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

    def run(m: onnx.ModelProto, nbits: int, include=None, exclude=None) -> onnx.ModelProto:
        cfg = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=False,
                                           accuracy_level=accuracy_level, bits=nbits)
        q = MatMulNBitsQuantizer(m, bits=nbits, block_size=block_size, is_symmetric=False,
                                 accuracy_level=accuracy_level, nodes_to_include=include,
                                 nodes_to_exclude=exclude, algo_config=cfg)
        q.process()
        return q.model.model

    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantizer rewrites the graph it is given
    model = run(copy, bits, exclude=[LM_HEAD_NODE])
    if any(n.name == LM_HEAD_NODE for n in model.graph.node):
        model = run(model, head_bits, include=[LM_HEAD_NODE])
    return model
