"""Builds the paged-KV decoder graph for the Llama family straight from the weights.

One step runs a batch of sequences whose new tokens are flattened to `num_tokens`; projections and
MLPs work on the flat tokens (no padding waste), attention on a padded [batch, query_len] view.
Past K/V is read only through block tables, so blocks can be shared between sequences; the graph
returns this step's K/V and the runtime writes it into its blocks. See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exporter.onnx_builder import FLOAT, INT64, MS_DOMAIN, GraphBuilder
from runtime import contract as C


@dataclass
class DecoderSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    rope_cos: np.ndarray  # [max_positions, head_dim // 2]
    rope_sin: np.ndarray
    sliding_window: int | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False


# the graph's projection weights (`layers.{i}.{name}`) and the Hugging Face projections stacked in each
FUSED_PROJECTIONS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                     "down_proj": ("mlp.down_proj",)}


@dataclass
class LoraSlots:
    """Shape of the LoRA inputs of the LoRA graph variant."""

    targets: tuple[str, ...] = C.LORA_TARGETS


def _proj_features(spec: DecoderSpec) -> dict[str, tuple[int, int]]:
    h, d = spec.hidden_size, spec.head_dim
    return {
        "q_proj": (h, spec.num_heads * d), "k_proj": (h, spec.num_kv_heads * d),
        "v_proj": (h, spec.num_kv_heads * d), "o_proj": (spec.num_heads * d, h),
        "gate_proj": (h, spec.intermediate_size), "up_proj": (h, spec.intermediate_size),
        "down_proj": (spec.intermediate_size, h),
    }


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


def _step_indices(b: GraphBuilder, spec: DecoderSpec, kv_write: str, input_ids: str, position_ids: str,
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


def build_decoder(spec: DecoderSpec, weights: dict[str, np.ndarray], lora: LoraSlots | None = None,
                  weight_dtype: type = np.float32, embed_dtype: type = np.float32, tied_gemm: bool = False,
                  kv_write: str = "TensorScatter", head_rescore: int = 0, lora_scales=None, embed_grid=None):
    """Return an onnx.ModelProto. `weights` uses Hugging Face names, float32, [out, in] layout.

    kv_write: how this step's K/V enter the gathered context. "TensorScatter" writes in place (CPU and
    WASM); "ScatterND" copies the context but has a WebGPU kernel in onnxruntime-web, which
    TensorScatter lacks (it would run on the CPU there, with the context copied off the GPU and back).

    weight_dtype=np.float16 stores matmul weights as fp16 behind a Cast (ORT folds it at load);
    embed_dtype=np.float16 stores the embedding table as fp16 and casts only the gathered rows.
    tied_gemm=True reads the LM head from the embedding table (Gemm transB) instead of a copy.
    head_rescore=K (tied embeddings only) makes the LM head a coarse pass: its K best tokens are scored
    again against their rows of the embedding table, so a cheap (int4) head picks the candidates while
    the logits that decide sampling carry the table's precision.
    lora_scales (an awq.LoraScales) undoes, on the LoRA path only, the AWQ scales folded into the weights.
    embed_grid (a grid.Grid of the embedding table, e.g. a GGUF's Q8_0) stores the table as its integers
    and scales and dequantizes only the gathered rows, exactly as the grid defines them (embedding and
    head rescoring alike).
    """
    b = GraphBuilder(f"ruvllm_{spec.architecture}_decoder")
    nl, hq, hkv, d = spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim
    group = hq // hkv

    def matmul_weight(name: str, w_out_in: np.ndarray) -> str:
        wt = np.ascontiguousarray(w_out_in.T)
        if weight_dtype == np.float32:
            return b.weight(name, wt.astype(np.float32))
        stored = b.weight(name, wt.astype(weight_dtype))
        return b.op("Cast", [stored], to=FLOAT, name=f"{name}/cast")

    # ---- inputs ----
    dtypes = {C.INT64: INT64, C.FLOAT32: FLOAT}
    step = {name: b.input(name, dtypes[dtype], list(dims)) for name, dtype, dims in C.STEP_INPUTS}
    input_ids, position_ids, query_index = step[C.INPUT_IDS], step[C.POSITION_IDS], step[C.QUERY_INDEX]
    flat_index, block_tables, logits_index = step[C.FLAT_INDEX], step[C.BLOCK_TABLES], step[C.LOGITS_INDEX]
    temperature, rep_pen = step[C.TEMPERATURE], step[C.REPETITION_PENALTY]
    pres_pen, freq_pen = step[C.PRESENCE_PENALTY], step[C.FREQUENCY_PENALTY]
    sparse_ids, sparse_seen = step[C.SPARSE_IDS], step[C.SPARSE_SEEN]
    sparse_counts, sparse_bias, top_k = step[C.SPARSE_COUNTS], step[C.SPARSE_BIAS], step[C.TOP_K]
    pool_shape = [hkv, "num_blocks", "block_size", d]
    past = [(b.input(C.past_key(i), FLOAT, pool_shape), b.input(C.past_value(i), FLOAT, pool_shape))
            for i in range(nl)]
    features = _proj_features(spec)
    lora_in = {}
    lora_w = None
    if lora is not None:
        lora_weights = b.input(C.LORA_WEIGHTS, FLOAT, ["num_tokens", "num_adapters"])
        for t in lora.targets:
            fin, fout = features[t]
            lora_in[t] = (b.input(C.lora_a(t), FLOAT, [nl, "num_adapters", fin, "rank"]),
                          b.input(C.lora_b(t), FLOAT, [nl, "num_adapters", "rank", fout]))
        # [num_adapters, num_tokens, 1]: per-token mixing weight of each adapter
        lora_w = b.op("Unsqueeze", [b.op("Transpose", [lora_weights], perm=[1, 0]), b.const([2])])

    unscaled: dict[tuple[int, str], str] = {}  # (layer, input) -> the input times its AWQ scale

    def lora_input(layer: int, target: str, x: str) -> str:
        s = lora_scales.inputs.get((layer, target)) if lora_scales else None
        if s is None:
            return x
        if (layer, x) not in unscaled:  # q/k/v (gate/up) share their input and its scale
            unscaled[layer, x] = b.op("Mul", [x, b.weight(f"layers.{layer}.{target}.lora_input_scale",
                                                          s.astype(np.float32))])
        return unscaled[layer, x]

    def lora_delta(layer: int, target: str, x: str) -> str | None:
        if target not in lora_in:
            return None
        a_all, b_all = lora_in[target]
        a_l = b.op("Gather", [a_all, b.const(layer)], axis=0)  # [A, in, r]
        b_l = b.op("Gather", [b_all, b.const(layer)], axis=0)  # [A, r, out]
        xb = b.op("MatMul", [b.op("MatMul", [lora_input(layer, target, x), a_l]), b_l])  # [A, N, out]
        delta = b.op("ReduceSum", [b.op("Mul", [xb, lora_w]), b.const([0])], keepdims=0)  # [N, out]
        s_out = lora_scales.outputs.get((layer, target)) if lora_scales else None
        if s_out is not None:  # the base output was divided by the next group's scale: so is the delta
            delta = b.op("Mul", [delta, b.weight(f"layers.{layer}.{target}.lora_output_scale",
                                                 (1.0 / s_out).astype(np.float32))])
        return delta

    def with_lora(layer: int, target: str, x: str, y: str) -> str:
        delta = lora_delta(layer, target, x)
        return y if delta is None else b.op("Add", [y, delta])

    # ---- per-step shared values ----
    query_len = b.op("Gather", [b.op("Shape", [query_index]), b.const(1)], axis=0)  # scalar
    max_blocks = b.op("Gather", [b.op("Shape", [block_tables]), b.const(1)], axis=0)
    block_size = b.op("Gather", [b.op("Shape", [past[0][0]]), b.const(2)], axis=0)
    total_len = b.op("Mul", [max_blocks, block_size])
    key_pos = b.op("Range", [b.const(0), total_len, b.const(1)])  # [T]
    q_pos = b.op("Gather", [position_ids, query_index], axis=0)  # [B, S]
    q_pos3 = b.op("Unsqueeze", [q_pos, b.const([2])])  # [B, S, 1]
    allowed = b.op("LessOrEqual", [key_pos, q_pos3])  # [B, S, T]
    if spec.sliding_window:
        lower = b.op("Sub", [q_pos3, b.const(spec.sliding_window)])
        allowed = b.op("And", [allowed, b.op("Greater", [key_pos, lower])])
    neg = b.const(np.finfo(np.float32).min, np.float32)
    mask = b.op("Where", [allowed, b.const(0.0, np.float32), neg])  # [B, S, T]
    # attention runs on [Hkv*B] batches (row h*B + b: kv head h of sequence b) with the group's queries
    # as rows: [Hkv*B, G*S, D] against [Hkv*B, T, D]
    mask = b.op("Tile", [mask, b.const([hkv, group, 1])])  # [Hkv*B, G*S, T]
    idx = _step_indices(b, spec, kv_write, input_ids, position_ids, query_index, flat_index, query_len, total_len)
    # the residual stream is [N, hidden], so every MatMul is one GEMM with M = N. RotaryEmbedding gets
    # [N, 1, heads*D]: flat tokens as its batch, since it reads the second dimension as a sequence
    # length that its cos/sin cache must cover
    pos_2d = b.op("Unsqueeze", [position_ids, b.const([1])])  # [N, 1]
    cos_cache = b.weight("rope.cos", spec.rope_cos.astype(np.float32))
    sin_cache = b.weight("rope.sin", spec.rope_sin.astype(np.float32))

    def rotary(x: str, num_heads: int) -> str:  # x: [N, 1, heads * D]
        return b.op("RotaryEmbedding", [x, pos_2d, cos_cache, sin_cache], domain=MS_DOMAIN, interleaved=0,
                    num_heads=num_heads)

    # ---- embeddings: the residual stream is [N, hidden] ----
    embed = weights["model.embed_tokens.weight"]
    if embed_grid is not None:
        embed_name = None
        embed_rows = _grid_rows(b, "model.embed_tokens", embed_grid)
    elif embed_dtype == np.float32:
        embed_name = b.weight("model.embed_tokens.weight", embed.astype(np.float32))
        embed_rows = lambda ids: b.op("Gather", [embed_name, ids], axis=0)  # noqa: E731
    else:  # fp16 table, cast only the gathered rows
        embed_name = b.weight("model.embed_tokens.weight", embed.astype(np.float16))
        embed_rows = lambda ids: b.op("Cast", [b.op("Gather", [embed_name, ids], axis=0)], to=FLOAT)  # noqa: E731
    x = embed_rows(input_ids)

    residual = x
    hidden = b.op("SimplifiedLayerNormalization",
                  [x, b.weight("layers.0.input_layernorm", weights["model.layers.0.input_layernorm.weight"])],
                  axis=-1, epsilon=spec.rms_norm_eps, stash_type=1)

    presents: tuple[list[str], list[str]] = ([], [])
    for i in range(nl):
        p = f"model.layers.{i}."
        # -- attention --
        wqkv = np.concatenate([weights[f"{p}{n}.weight"] for n in FUSED_PROJECTIONS["qkv_proj"]], 0)
        qkv = b.op("MatMul", [hidden, matmul_weight(f"layers.{i}.qkv_proj", wqkv)])
        if spec.attention_bias:
            bias = np.concatenate([weights[p + f"self_attn.{n}.bias"] for n in ("q_proj", "k_proj", "v_proj")])
            qkv = b.op("Add", [qkv, b.weight(f"layers.{i}.qkv_bias", bias.astype(np.float32))])
        if lora is None:  # [N, 1, *] for RotaryEmbedding: one Unsqueeze, one split into q+k and v
            qk, v = b.op("Split", [b.op("Unsqueeze", [qkv, b.const([1])]), b.const([(hq + hkv) * d, hkv * d])],
                         n_out=2, axis=2)
        else:
            q, k, v = b.op("Split", [qkv, b.const([hq * d, hkv * d, hkv * d])], n_out=3, axis=1)
            q, k, v = (with_lora(i, f"{t}_proj", hidden, x) for t, x in (("q", q), ("k", k), ("v", v)))
            qk = b.op("Unsqueeze", [b.op("Concat", [q, k], axis=1), b.const([1])])
        qk = b.op("Reshape", [rotary(qk, hq + hkv), b.const([-1, d])])  # [N*(Hq+Hkv), D]
        v = b.op("Reshape", [v, b.const([-1, d])])  # [N*Hkv, D]
        presents[0].append(b.op("Gather", [qk, idx.key_rows], axis=0))
        presents[1].append(v)
        ctx = []
        for pool, rows_of, index in ((past[i][0], qk, idx.k_update), (past[i][1], v, idx.v_update)):
            gathered = b.op("Gather", [pool, block_tables], axis=1)  # [Hkv, B, MB, bs, D]
            rows = b.annotate(b.op("Reshape", [gathered, idx.ctx_shape]), FLOAT, ["kv_rows", "kv_len", d])
            update = b.op("Gather", [rows_of, index], axis=0)  # [Hkv*B, S, D]
            if idx.scatter_at:
                ctx.append(b.op("ScatterND", [rows, idx.scatter_at, update]))
                continue
            # same symbolic shape in and out: onnxruntime then writes into the gathered copy in place
            ctx.append(b.annotate(b.op("TensorScatter", [rows, update, idx.write_at], axis=1),
                                  FLOAT, ["kv_rows", "kv_len", d]))
        qp = b.op("Gather", [qk, idx.q_rows], axis=0)  # [Hkv*B, G*S, D]
        scores = b.op("FusedMatMul", [qp, ctx[0]], domain=MS_DOMAIN, transB=1, alpha=float(1.0 / np.sqrt(d)))
        probs = b.op("Softmax", [b.op("Add", [scores, mask])], axis=-1)  # [Hkv*B, G*S, T]
        attn = b.op("MatMul", [probs, ctx[1]])  # [Hkv*B, G*S, D]
        attn = b.op("Reshape", [b.op("GatherND", [attn, idx.out_index]), b.const([-1, hq * d])])  # [N, Hq*D]
        o = b.op("MatMul", [attn, matmul_weight(f"layers.{i}.o_proj", weights[p + "self_attn.o_proj.weight"])])
        o = with_lora(i, "o_proj", attn, o)
        post_ln = b.weight(f"layers.{i}.post_attention_layernorm", weights[p + "post_attention_layernorm.weight"])
        hidden, _, _, residual = b.op("SkipSimplifiedLayerNormalization", [o, residual, post_ln], n_out=4,
                                      domain=MS_DOMAIN, epsilon=spec.rms_norm_eps)
        # -- MLP --
        wgu = np.concatenate([weights[f"{p}{n}.weight"] for n in FUSED_PROJECTIONS["gate_up_proj"]], 0)
        gu = b.op("MatMul", [hidden, matmul_weight(f"layers.{i}.gate_up_proj", wgu)])
        gate, up = b.op("Split", [gu, b.const([spec.intermediate_size] * 2)], n_out=2, axis=1)
        gate = with_lora(i, "gate_proj", hidden, gate)
        up = with_lora(i, "up_proj", hidden, up)
        act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
        down = b.op("MatMul", [act, matmul_weight(f"layers.{i}.down_proj", weights[p + "mlp.down_proj.weight"])])
        down = with_lora(i, "down_proj", act, down)
        if i + 1 < nl:
            ln_name, ln = f"layers.{i + 1}.input_layernorm", weights[f"model.layers.{i + 1}.input_layernorm.weight"]
        else:
            ln_name, ln = "model.norm", weights["model.norm.weight"]
        hidden, _, _, residual = b.op("SkipSimplifiedLayerNormalization", [down, residual, b.weight(ln_name, ln)],
                                      n_out=4, domain=MS_DOMAIN, epsilon=spec.rms_norm_eps)

    # this step's K/V of every layer in one tensor each: the runtime writes them into its blocks at once
    for kind, name in ((0, C.PRESENT_KEY), (1, C.PRESENT_VALUE)):
        stacked = b.op("Concat", presents[kind], axis=0)  # [L*N*Hkv, D]
        b.op("Reshape", [stacked, b.const([nl, -1, hkv, d])], out=name)
        b.output(name, FLOAT, [nl, "num_tokens", hkv, d])

    # ---- logits only where wanted, then in-graph processing and top-K ----
    last = b.op("Gather", [hidden, logits_index], axis=0)  # [R, H]
    if tied_gemm and spec.tie_word_embeddings and embed_name and embed_dtype == np.float32:
        b.op("Gemm", [last, embed_name], transB=1, out=C.LOGITS)
    elif head_rescore:
        if not spec.tie_word_embeddings:
            raise ValueError("head_rescore needs tied embeddings: the exact rows come from the embedding table")
        coarse = b.op("MatMul", [last, matmul_weight("lm_head", embed)], name="lm_head/MatMul")
        _, cand = b.op("TopK", [coarse, b.const([head_rescore])], n_out=2, axis=1, largest=1, sorted=0)
        rows = embed_rows(cand)  # [R, K, H]
        exact = b.op("MatMul", [rows, b.op("Unsqueeze", [last, b.const([2])])])  # [R, K, 1]
        b.op("ScatterElements", [coarse, cand, b.op("Squeeze", [exact, b.const([2])])], axis=1, out=C.LOGITS)
    else:
        head = weights.get("lm_head.weight", embed) if not spec.tie_word_embeddings else embed
        b.op("MatMul", [last, matmul_weight("lm_head", head)], name="lm_head/MatMul", out=C.LOGITS)
    b.output(C.LOGITS, FLOAT, ["num_logits", spec.vocab_size])
    logits = C.LOGITS

    col = b.const([1])
    picked = b.op("GatherElements", [logits, sparse_ids], axis=1)  # [R, P]
    zero = b.const(0.0, np.float32)
    rep = b.op("Unsqueeze", [rep_pen, col])
    penalized = b.op("Where", [b.op("Greater", [picked, zero]), b.op("Div", [picked, rep]), b.op("Mul", [picked, rep])])
    picked = b.op("Where", [b.op("Greater", [sparse_seen, zero]), penalized, picked])
    generated = b.op("Cast", [b.op("Greater", [sparse_counts, zero])], to=FLOAT)
    picked = b.op("Sub", [picked, b.op("Mul", [b.op("Unsqueeze", [pres_pen, col]), generated])])
    picked = b.op("Sub", [picked, b.op("Mul", [b.op("Unsqueeze", [freq_pen, col]), sparse_counts])])
    picked = b.op("Add", [picked, sparse_bias])
    processed = b.op("ScatterElements", [logits, sparse_ids, picked], axis=1)
    processed = b.op("Div", [processed, b.op("Unsqueeze", [temperature, col])])
    logprobs = b.op("LogSoftmax", [processed], axis=1)
    b.op("TopK", [logprobs, top_k], axis=1, largest=1, sorted=1, out=[C.TOPK_LOGPROBS, C.TOPK_IDS])
    b.output(C.TOPK_LOGPROBS, FLOAT, ["num_logits", "top_k"])
    b.output(C.TOPK_IDS, INT64, ["num_logits", "top_k"])
    return b.model()



def _grid_rows(b: GraphBuilder, name: str, grid):
    """A function of token ids (any shape) -> their rows of a gridded table, [*ids.shape, hidden], computed
    as grid.Grid.dequantize does: (q - zero) * scale (+ mins), in fp32."""
    rows, cols = grid.q.shape
    nblk = cols // grid.block
    q = b.weight(f"{name}.q", np.ascontiguousarray(grid.q, np.uint8))
    scale = b.weight(f"{name}.scales", np.ascontiguousarray(grid.scale, np.float32))
    uniform = bool(np.all(grid.zero == grid.zero.flat[0]))
    zero = None if uniform else b.weight(f"{name}.zero_points", np.ascontiguousarray(grid.zero, np.uint8))
    mins = None if grid.mins is None else b.weight(f"{name}.mins", np.ascontiguousarray(grid.mins, np.float32))

    def gather(ids: str) -> str:
        flat = b.op("Reshape", [ids, b.const([-1])])
        picked = lambda t: b.op("Unsqueeze", [b.op("Gather", [t, flat], axis=0), b.const([2])])  # noqa: E731
        v = b.op("Reshape", [b.op("Cast", [b.op("Gather", [q, flat], axis=0)], to=FLOAT), b.const([-1, nblk, grid.block])])
        z = b.const(float(grid.zero.flat[0]), np.float32) if uniform else b.op("Cast", [picked(zero)], to=FLOAT)
        v = b.op("Mul", [b.op("Sub", [v, z]), picked(scale)])
        if mins is not None:
            v = b.op("Add", [v, picked(mins)])
        shape = b.op("Concat", [b.op("Shape", [ids]), b.const([cols])], axis=0)
        return b.op("Reshape", [v, shape])
    return gather
