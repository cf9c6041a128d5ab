"""The per-step index tensors every layer's attention uses, computed once per step in the graph."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exporter.builders.onnx_builder import GraphBuilder
from exporter.builders.spec import DecoderSpec


@dataclass
class StepIndices:
    """Per-step index tensors (computed once, used by every layer). Queries and keys are rotated
    together and viewed as rows [N*(Hq+Hkv), D] (token n's query head j is row n*(Hq+Hkv) + j, its
    key head h row n*(Hq+Hkv) + Hq + h); values as rows [N*Hkv, D]. Attention runs on [Hkv*B] batches
    (batch h*B + b: kv head h of sequence b) with the group's queries as rows, [Hkv*B, G*S, D] against
    [Hkv*B, T, D]; each Gather below pads, regroups and transposes in one step."""

    q_rows: str  # [Hkv*B, G*S]: query rows of each attention batch
    k_update: str  # [Hkv*B, S]: this step's key rows, padded per sequence
    v_update: str  # [Hkv*B, S]: its value rows
    key_rows: str  # [N*Hkv]: this step's key rows, token-major (present.key)
    out_index: str  # [N, Hq, 2]: (h*B + b, g*S + s) of each token's head in the attention output
    write_at: str  # [Hkv*B]: each sequence's first new position, where its update is written
    ctx_shape: str  # [3]: the gathered context's shape [Hkv*B, T, D]
    scatter_at: str | None  # [Hkv*B, S, 2] (row, position) for ScatterND; None with TensorScatter


def step_indices(b: GraphBuilder, spec: DecoderSpec, kv_write: str, input_ids: str, position_ids: str,
                  query_index: str, flat_index: str, query_len: str, total_len: str) -> StepIndices:
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    group, qk_heads = hq // hkv, hq + hkv
    head_kv = np.arange(hkv).reshape(hkv, 1, 1)
    qk_tok = b.op("Mul", [query_index, b.const(qk_heads)])  # [B, S]
    k_update = b.op("Flatten", [b.op("Add", [qk_tok, b.const(head_kv + hq)])], axis=2)
    v_update = b.op("Flatten", [b.op("Add", [b.op("Mul", [query_index, b.const(hkv)]), b.const(head_kv)])], axis=2)
    q_head = b.const(np.arange(hkv).reshape(hkv, 1, 1, 1) * group + np.arange(group).reshape(1, 1, group, 1))
    q_rows = b.op("Flatten", [b.op("Add", [b.op("Unsqueeze", [qk_tok, b.const([0, 2])]), q_head])], axis=2)
    tokens = b.op("Range", [b.const(0), b.op("Squeeze", [b.op("Shape", [input_ids]), b.const([0])]), b.const(1)])
    key_rows = b.op("Reshape", [b.op("Add", [b.op("Unsqueeze", [b.op("Mul", [tokens, b.const(qk_heads)]),
                                                                 b.const([1])]), b.const(np.arange(hkv) + hq)]),
                                b.const([-1])])
    batch = b.op("Gather", [b.op("Shape", [query_index]), b.const(0)], axis=0)
    heads = np.arange(hq)
    row = b.op("Unsqueeze", [b.op("Div", [flat_index, query_len]), b.const([1])])  # [N, 1]: b
    col = b.op("Unsqueeze", [b.op("Mod", [flat_index, query_len]), b.const([1])])  # [N, 1]: s
    out_row = b.op("Add", [row, b.op("Mul", [b.const(heads // group), batch])])  # [N, Hq]: h*B + b
    out_col = b.op("Add", [col, b.op("Mul", [b.const(heads % group), query_len])])  # [N, Hq]: g*S + s
    out_index = b.op("Concat", [b.op("Unsqueeze", [out_row, b.const([2])]),
                                b.op("Unsqueeze", [out_col, b.const([2])])], axis=2)
    # the runtime makes T cover every sequence's first new position + query_len, so the padded
    # update fits; the padding lies past the sequence's tokens, masked
    first_pos = b.op("Gather", [position_ids, b.op("Gather", [query_index, b.const(0)], axis=1)], axis=0)  # [B]
    write_at = b.op("Reshape", [b.op("Expand", [b.op("Unsqueeze", [first_pos, b.const([0])]),
                                                 b.op("Concat", [b.const([hkv]), b.op("Shape", [first_pos])], axis=0)]),
                                b.const([-1])])
    ctx_shape = b.op("Concat", [b.const([-1]), b.op("Unsqueeze", [total_len, b.const([0])]), b.const([d])], axis=0)
    scatter_at = None
    if kv_write == "ScatterND":
        at = b.op("Add", [b.op("Unsqueeze", [write_at, b.const([1])]),
                          b.op("Range", [b.const(0), query_len, b.const(1)])])  # [Hkv*B, S]
        rows = b.op("Expand", [b.op("Unsqueeze", [b.op("Range", [b.const(0), b.op("Mul", [batch, b.const(hkv)]),
                                                                 b.const(1)]), b.const([1])]), b.op("Shape", [at])])
        scatter_at = b.op("Concat", [b.op("Unsqueeze", [rows, b.const([2])]), b.op("Unsqueeze", [at, b.const([2])])],
                          axis=2)
    elif kv_write != "TensorScatter":
        raise ValueError(f"kv_write must be TensorScatter or ScatterND, not {kv_write!r}")
    return StepIndices(q_rows, k_update, v_update, key_rows, out_index, write_at, ctx_shape, scatter_at)
