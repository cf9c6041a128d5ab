"""In-graph logits processing: penalties, logit bias, a grammar's mask and temperature per row, then
log-softmax and top-K.

The runtime gets back only each row's K best candidates with their log-probabilities normalized over
the whole vocabulary (runtime/core/sampling.py chooses among them), never a [rows, vocab] tensor.
"""

from __future__ import annotations

import numpy as np

from exporter.builders.onnx_builder import FLOAT, INT64, GraphBuilder
from runtime import contract as C


def process_logits(b: GraphBuilder, logits: str, step: dict[str, str], vocab_size: int) -> None:
    """Adds C.TOPK_LOGPROBS and C.TOPK_IDS from the raw `logits` and the step's sampling inputs."""
    col = b.const([1])
    sparse_ids, sparse_counts = step[C.SPARSE_IDS], step[C.SPARSE_COUNTS]
    picked = b.op("GatherElements", [logits, sparse_ids], axis=1)  # [R, P]
    zero = b.const(0.0, np.float32)
    rep = b.op("Unsqueeze", [step[C.REPETITION_PENALTY], col])
    penalized = b.op("Where", [b.op("Greater", [picked, zero]), b.op("Div", [picked, rep]), b.op("Mul", [picked, rep])])
    picked = b.op("Where", [b.op("Greater", [step[C.SPARSE_SEEN], zero]), penalized, picked])
    generated = b.op("Cast", [b.op("Greater", [sparse_counts, zero])], to=FLOAT)
    picked = b.op("Sub", [picked, b.op("Mul", [b.op("Unsqueeze", [step[C.PRESENCE_PENALTY], col]), generated])])
    picked = b.op("Sub", [picked, b.op("Mul", [b.op("Unsqueeze", [step[C.FREQUENCY_PENALTY], col]), sparse_counts])])
    picked = b.op("Add", [picked, step[C.SPARSE_BIAS]])
    processed = b.op("ScatterElements", [logits, sparse_ids, picked], axis=1)
    processed = b.op("Add", [processed, logits_mask(b, vocab_size)])
    processed = b.op("Div", [processed, b.op("Unsqueeze", [step[C.TEMPERATURE], col])])
    logprobs = b.op("LogSoftmax", [processed], axis=1)
    b.op("TopK", [logprobs, step[C.TOP_K]], axis=1, largest=1, sorted=1, out=[C.TOPK_LOGPROBS, C.TOPK_IDS])
    b.output(C.TOPK_LOGPROBS, FLOAT, ["num_logits", "top_k"])
    b.output(C.TOPK_IDS, INT64, ["num_logits", "top_k"])


def logits_mask(b: GraphBuilder, vocab: int) -> str:
    """C.LOGITS_MASK: [1, vocab] zeros from a step without constrained rows, [num_logits, vocab] with them."""
    return b.input(C.LOGITS_MASK, FLOAT, ["mask_rows", vocab])
