"""Builds the paged-KV decoder graph straight from the weights: the parts every family shares.

One step runs a batch of sequences whose new tokens are flattened to `num_tokens`; projections and
MLPs work on the flat tokens (no padding waste), attention on a padded [batch, query_len] view.
Past K/V is read only through block tables, so blocks can be shared between sequences; the graph
returns this step's K/V and the runtime writes it into its blocks. What a family does differently is
in its DecoderSpec (read off its row of traits: family_config.py). See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exporter.builders.embedding import grid_rows
from exporter.builders.logits import process_logits
from exporter.builders.lora_path import LoraPath
from exporter.builders.onnx_builder import FLOAT, INT64, MS_DOMAIN, GraphBuilder
from exporter.builders.spec import FUSED_PROJECTIONS, DecoderSpec, LoraSlots
from exporter.builders.step_indices import StepIndices, step_indices
from runtime import contract as C


@dataclass
class BuildOptions:
    """How the graph stores and computes what the weights give it (see DecoderBuilder)."""

    lora: LoraSlots | None = None
    weight_dtype: type = np.float32
    embed_dtype: type = np.float32
    tied_gemm: bool = False
    kv_write: str = "TensorScatter"
    head_rescore: int = 0
    lora_scales: object = None
    embed_grid: object = None
    grids: object = None  # a projections.ProjectionGrids: projections on their grids as they are built
    store: object = None  # a writers.external_data.WeightStore: weights to the data file as they are made


class DecoderBuilder:
    """One graph per instance: `build()` returns the onnx.ModelProto.

    `weights` uses Hugging Face names, float32, [out, in] layout. Options (BuildOptions):
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
    grids (a ProjectionGrids) puts a projection that has a grid on it as MatMulNBits at once; `weights`
    may then be a lazy mapping, read one tensor at a time. store: see GraphBuilder.
    """

    def __init__(self, spec: DecoderSpec, weights: dict[str, np.ndarray], options: BuildOptions | None = None) -> None:
        self.spec, self.weights = spec, weights
        self.opts = options or BuildOptions()
        self.b = GraphBuilder(f"ruvllm_{spec.architecture}_decoder", self.opts.store)

    def build(self):
        b, spec = self.b, self.spec
        self.step_inputs()
        self.lora = LoraPath(b, spec, self.opts.lora, self.opts.lora_scales)
        self.step_values()
        x = self.embed_rows(self.step[C.INPUT_IDS])
        hidden, residual = self.first_norm(x), x
        self.presents: tuple[list[str], list[str]] = ([], [])
        for i in range(spec.num_layers):
            hidden, residual = self.layer(i, hidden, residual)
        self.kv_outputs()
        if self.lora.enabled:
            b.op("Identity", [hidden], out=C.HIDDEN_STATES)
            b.output(C.HIDDEN_STATES, FLOAT, ["num_tokens", spec.hidden_size])
        process_logits(b, self.lm_head(hidden), self.step, spec.vocab_size)
        return b.model()

    def step_inputs(self) -> None:
        b, spec = self.b, self.spec
        dtypes = {C.INT64: INT64, C.FLOAT32: FLOAT}
        self.step = {name: b.input(name, dtypes[dtype], list(dims)) for name, dtype, dims in C.STEP_INPUTS}
        pool_shape = [spec.num_kv_heads, "num_blocks", "block_size", spec.head_dim]
        self.past = [(b.input(C.past_key(i), FLOAT, pool_shape), b.input(C.past_value(i), FLOAT, pool_shape))
                     for i in range(spec.num_layers)]

    def matmul_weight(self, name: str, w_out_in) -> str:
        """The [in, out] weight of a float MatMul, from its [out, in] array (or a function making it)."""
        b, dtype = self.b, self.opts.weight_dtype
        make = w_out_in if callable(w_out_in) else lambda: w_out_in
        stored = b.named_weight(name, lambda: np.ascontiguousarray(make().T).astype(dtype))
        if dtype == np.float32:
            return stored
        return b.op("Cast", [stored], to=FLOAT, name=f"{name}/cast")

    def project(self, name: str, x: str, w_out_in, node_name: str | None = None, out: str | None = None) -> str:
        """x . W for the graph weight `name`: on its grid when it has one (opts.grids), else a float MatMul
        of `w_out_in` ([out, in], or a function making it: not called when the grid is used)."""
        if self.opts.grids is not None:
            y = self.opts.grids.matmul(self.b, name, x, out)
            if y is not None:
                return y
        return self.b.op("MatMul", [x, self.matmul_weight(name, w_out_in)], name=node_name, out=out)

    def step_values(self) -> None:
        """What every layer shares: the causal (and sliding-window) mask, the index tensors, the rotary tables."""
        b, spec, step = self.b, self.spec, self.step
        hkv, group = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
        query_index, position_ids = step[C.QUERY_INDEX], step[C.POSITION_IDS]
        query_len = b.op("Gather", [b.op("Shape", [query_index]), b.const(1)], axis=0)  # scalar
        max_blocks = b.op("Gather", [b.op("Shape", [step[C.BLOCK_TABLES]]), b.const(1)], axis=0)
        block_size = b.op("Gather", [b.op("Shape", [self.past[0][0]]), b.const(2)], axis=0)
        total_len = b.op("Mul", [max_blocks, block_size])
        key_pos = b.op("Range", [b.const(0), total_len, b.const(1)])  # [T]
        q_pos = b.op("Gather", [position_ids, query_index], axis=0)  # [B, S]
        q_pos3 = b.op("Unsqueeze", [q_pos, b.const([2])])  # [B, S, 1]
        causal = b.op("LessOrEqual", [key_pos, q_pos3])  # [B, S, T]
        neg = b.const(np.finfo(np.float32).min, np.float32)

        def mask_for(window: int | None) -> str:
            allowed = causal
            if window:
                lower = b.op("Sub", [q_pos3, b.const(window)])
                allowed = b.op("And", [allowed, b.op("Greater", [key_pos, lower])])
            mask = b.op("Where", [allowed, b.const(0.0, np.float32), neg])  # [B, S, T]
            # attention runs on [Hkv*B] batches (row h*B + b: kv head h of sequence b) with the group's queries
            # as rows: [Hkv*B, G*S, D] against [Hkv*B, T, D]
            return b.op("Tile", [mask, b.const([hkv, group, 1])])  # [Hkv*B, G*S, T]

        windows = spec.layer_windows or (spec.sliding_window,) * spec.num_layers
        masks = {w: mask_for(w) for w in dict.fromkeys(windows)}
        self.masks = [masks[w] for w in windows]
        self.idx: StepIndices = step_indices(b, spec, self.opts.kv_write, step[C.INPUT_IDS], position_ids,
                                             query_index, step[C.FLAT_INDEX], query_len, total_len)
        # the residual stream is [N, hidden], so every MatMul is one GEMM with M = N. RotaryEmbedding gets
        # [N, 1, heads*D]: flat tokens as its batch, since it reads the second dimension as a sequence
        # length that its cos/sin cache must cover
        self.pos_2d = b.op("Unsqueeze", [position_ids, b.const([1])])  # [N, 1]
        caches = {False: (b.weight("rope.cos", spec.rope_cos.astype(np.float32)),
                          b.weight("rope.sin", spec.rope_sin.astype(np.float32)))}
        if spec.layer_rope_local and any(spec.layer_rope_local):  # Gemma 3: the sliding layers' own base
            caches[True] = (b.weight("rope_local.cos", spec.rope_local_cos.astype(np.float32)),
                            b.weight("rope_local.sin", spec.rope_local_sin.astype(np.float32)))
        local = spec.layer_rope_local or (False,) * spec.num_layers
        self.rope_caches = [caches[flag] for flag in local]

    def rotary(self, x: str, num_heads: int, layer: int) -> str:  # x: [N, 1, heads * D]
        cos, sin = self.rope_caches[layer]
        return self.b.op("RotaryEmbedding", [x, self.pos_2d, cos, sin], domain=MS_DOMAIN, interleaved=0,
                         num_heads=num_heads)

    def embed_rows(self, ids: str) -> str:
        """The residual stream's first value [N, hidden]; sets self.gather_rows for the head's rescoring."""
        b, dtype = self.b, self.opts.embed_dtype
        table = lambda: self.weights["model.embed_tokens.weight"].astype(dtype)  # noqa: E731
        self.embed_name = None
        if getattr(self.opts.embed_grid, "kquant", False):  # at the file's own bits (projections.OwnBits)
            self.gather_rows = self.opts.embed_grid.gather(b, "model.embed_tokens")
        elif self.opts.embed_grid is not None:
            self.gather_rows = grid_rows(b, "model.embed_tokens", self.opts.embed_grid)
        elif dtype == np.float32:
            self.embed_name = name = b.named_weight("model.embed_tokens.weight", table)
            self.gather_rows = lambda t: b.op("Gather", [name, t], axis=0)
        else:  # fp16 table, cast only the gathered rows
            self.embed_name = name = b.named_weight("model.embed_tokens.weight", table)
            self.gather_rows = lambda t: b.op("Cast", [b.op("Gather", [name, t], axis=0)], to=FLOAT)
        if self.spec.embed_scale != 1.0:  # the residual stream's only (the head reads the table as it is)
            return b.op("Mul", [self.gather_rows(ids), b.const(np.float32(self.spec.embed_scale), np.float32)])
        return self.gather_rows(ids)

    def first_norm(self, x: str) -> str:
        w = self.weights["model.layers.0.input_layernorm.weight"]
        return self.norm(x, self.b.weight("layers.0.input_layernorm", w))

    def norm(self, x: str, weight: str) -> str:
        return self.b.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=self.spec.rms_norm_eps,
                         stash_type=1)

    def softcap(self, x: str, cap: float) -> str:
        """cap * tanh(x / cap): Gemma 2's soft limit on attention scores and logits."""
        b = self.b
        return b.op("Mul", [b.op("Tanh", [b.op("Mul", [x, b.const(np.float32(1.0 / cap), np.float32)])]),
                            b.const(np.float32(cap), np.float32)])

    def layer(self, i: int, hidden: str, residual: str) -> tuple[str, str]:
        b, spec, w = self.b, self.spec, self.weights
        p = f"model.layers.{i}."
        o = self.attention(i, hidden)
        post_ln = b.weight(f"layers.{i}.post_attention_layernorm", w[p + "post_attention_layernorm.weight"])
        if spec.sandwich_norms:  # Gemma 2: each block's output normed before the residual add
            o = self.norm(o, post_ln)
            post_ln = b.weight(f"layers.{i}.pre_feedforward_layernorm", w[p + "pre_feedforward_layernorm.weight"])
        hidden, _, _, residual = b.op("SkipSimplifiedLayerNormalization", [o, residual, post_ln], n_out=4,
                                      domain=MS_DOMAIN, epsilon=spec.rms_norm_eps)
        down = self.mlp(i, hidden)
        if spec.sandwich_norms:
            down = self.norm(down, b.weight(f"layers.{i}.post_feedforward_layernorm",
                                            w[p + "post_feedforward_layernorm.weight"]))
        if i + 1 < spec.num_layers:
            ln_name, ln = f"layers.{i + 1}.input_layernorm", w[f"model.layers.{i + 1}.input_layernorm.weight"]
        else:
            ln_name, ln = "model.norm", w["model.norm.weight"]
        hidden, _, _, residual = b.op("SkipSimplifiedLayerNormalization", [down, residual, b.weight(ln_name, ln)],
                                      n_out=4, domain=MS_DOMAIN, epsilon=spec.rms_norm_eps)
        return hidden, residual

    def attention(self, i: int, hidden: str) -> str:
        """Layer i's attention over its paged KV, output projection included: [N, hidden]."""
        b, spec, w, idx, lora = self.b, self.spec, self.weights, self.idx, self.lora
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        p = f"model.layers.{i}."
        wqkv = lambda: np.concatenate([w[f"{p}{n}.weight"] for n in FUSED_PROJECTIONS["qkv_proj"]], 0)  # noqa: E731
        qkv = self.project(f"layers.{i}.qkv_proj", hidden, wqkv)
        if spec.attention_bias:
            bias = np.concatenate([w[p + f"self_attn.{n}.bias"] for n in ("q_proj", "k_proj", "v_proj")])
            qkv = b.op("Add", [qkv, b.weight(f"layers.{i}.qkv_bias", bias.astype(np.float32))])
        if not lora.enabled:  # [N, 1, *] for RotaryEmbedding: one Unsqueeze, one split into q+k and v
            qk, v = b.op("Split", [b.op("Unsqueeze", [qkv, b.const([1])]), b.const([(hq + hkv) * d, hkv * d])],
                         n_out=2, axis=2)
        else:
            q, k, v = b.op("Split", [qkv, b.const([hq * d, hkv * d, hkv * d])], n_out=3, axis=1)
            q, k, v = (lora.apply(i, f"{t}_proj", hidden, x) for t, x in (("q", q), ("k", k), ("v", v)))
            qk = b.op("Unsqueeze", [b.op("Concat", [q, k], axis=1), b.const([1])])
        if spec.qk_norm:
            qk = self.head_norms(i, qk)
        qk = b.op("Reshape", [self.rotary(qk, hq + hkv, i), b.const([-1, d])])  # [N*(Hq+Hkv), D]
        v = b.op("Reshape", [v, b.const([-1, d])])  # [N*Hkv, D]
        self.presents[0].append(b.op("Gather", [qk, idx.key_rows], axis=0))
        self.presents[1].append(v)
        ctx = []
        for pool, rows_of, index in ((self.past[i][0], qk, idx.k_update), (self.past[i][1], v, idx.v_update)):
            gathered = b.op("Gather", [pool, self.step[C.BLOCK_TABLES]], axis=1)  # [Hkv, B, MB, bs, D]
            rows = b.annotate(b.op("Reshape", [gathered, idx.ctx_shape]), FLOAT, ["kv_rows", "kv_len", d])
            update = b.op("Gather", [rows_of, index], axis=0)  # [Hkv*B, S, D]
            if idx.scatter_at:
                ctx.append(b.op("ScatterND", [rows, idx.scatter_at, update]))
                continue
            # same symbolic shape in and out: onnxruntime then writes into the gathered copy in place
            ctx.append(b.annotate(b.op("TensorScatter", [rows, update, idx.write_at], axis=1),
                                  FLOAT, ["kv_rows", "kv_len", d]))
        qp = b.op("Gather", [qk, idx.q_rows], axis=0)  # [Hkv*B, G*S, D]
        scale = spec.attn_scale or float(1.0 / np.sqrt(d))
        scores = b.op("FusedMatMul", [qp, ctx[0]], domain=MS_DOMAIN, transB=1, alpha=scale)
        if spec.attn_softcap:
            scores = self.softcap(scores, spec.attn_softcap)
        probs = b.op("Softmax", [b.op("Add", [scores, self.masks[i]])], axis=-1)  # [Hkv*B, G*S, T]
        attn = b.op("MatMul", [probs, ctx[1]])  # [Hkv*B, G*S, D]
        attn = b.op("Reshape", [b.op("GatherND", [attn, idx.out_index]), b.const([-1, hq * d])])  # [N, Hq*D]
        o = self.project(f"layers.{i}.o_proj", attn, lambda: w[p + "self_attn.o_proj.weight"])
        return lora.apply(i, "o_proj", attn, o)

    def head_norms(self, i: int, qk: str) -> str:
        """Qwen3's q_norm and k_norm: each head of qk [N, 1, (Hq+Hkv)*D] RMS-normed over its D numbers, then
        scaled by its kind's weights (one SimplifiedLayerNormalization over all heads, one Mul by the
        weights laid out per head)."""
        b, spec, w = self.b, self.spec, self.weights
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        p = f"model.layers.{i}.self_attn."
        scale = np.concatenate([np.tile(w[p + "q_norm.weight"], (hq, 1)), np.tile(w[p + "k_norm.weight"], (hkv, 1))])
        heads = b.op("Reshape", [qk, b.const([-1, hq + hkv, d])])
        normed = b.op("SimplifiedLayerNormalization", [heads, b.weight(f"layers.{i}.qk_norm.ones", np.ones(d, np.float32))],
                      axis=-1, epsilon=spec.rms_norm_eps, stash_type=1)
        normed = b.op("Mul", [normed, b.weight(f"layers.{i}.qk_norm", scale.astype(np.float32))])
        return b.op("Reshape", [normed, b.const([-1, 1, (hq + hkv) * d])])

    def mlp(self, i: int, hidden: str) -> str:
        """Layer i's gated MLP: down(act(gate(x)) * up(x)), gate and up as one fused projection."""
        b, w, lora = self.b, self.weights, self.lora
        p = f"model.layers.{i}."
        wgu = lambda: np.concatenate([w[f"{p}{n}.weight"] for n in FUSED_PROJECTIONS["gate_up_proj"]], 0)  # noqa: E731
        gu = self.project(f"layers.{i}.gate_up_proj", hidden, wgu)
        gate, up = b.op("Split", [gu, b.const([self.spec.intermediate_size] * 2)], n_out=2, axis=1)
        gate = lora.apply(i, "gate_proj", hidden, gate)
        up = lora.apply(i, "up_proj", hidden, up)
        act = b.op("Mul", [self.activation(gate), up])
        down = self.project(f"layers.{i}.down_proj", act, lambda: w[p + "mlp.down_proj.weight"])
        return lora.apply(i, "down_proj", act, down)

    def activation(self, gate: str) -> str:
        """The gate's activation. SiLU is Sigmoid and Mul (the pattern runtime/backends/graph_rewrite/ folds
        into the kernel); GELU is spelled out in standard operators (onnxruntime fuses it where it can)."""
        b, act = self.b, self.spec.activation
        if act == "silu":
            return b.op("Mul", [gate, b.op("Sigmoid", [gate])])
        half = b.op("Mul", [gate, b.const(0.5, np.float32)])
        if act == "gelu":  # x/2 (1 + erf(x / sqrt 2))
            inner = b.op("Erf", [b.op("Mul", [gate, b.const(float(1 / np.sqrt(2)), np.float32)])])
        else:  # tanh approximation: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            cube = b.op("Mul", [b.op("Mul", [gate, gate]), gate])
            poly = b.op("Add", [gate, b.op("Mul", [cube, b.const(0.044715, np.float32)])])
            inner = b.op("Tanh", [b.op("Mul", [poly, b.const(float(np.sqrt(2 / np.pi)), np.float32)])])
        return b.op("Mul", [half, b.op("Add", [inner, b.const(1.0, np.float32)])])

    def kv_outputs(self) -> None:
        """This step's K/V of every layer in one tensor each: the runtime writes them into its blocks at once."""
        b, spec = self.b, self.spec
        for kind, name in ((0, C.PRESENT_KEY), (1, C.PRESENT_VALUE)):
            stacked = b.op("Concat", self.presents[kind], axis=0)  # [L*N*Hkv, D]
            b.op("Reshape", [stacked, b.const([spec.num_layers, -1, spec.num_kv_heads, spec.head_dim])], out=name)
            b.output(name, FLOAT, [spec.num_layers, "num_tokens", spec.num_kv_heads, spec.head_dim])

    def lm_head(self, hidden: str) -> str:
        """Raw logits of the rows logits_index picks (C.LOGITS)."""
        b, spec, opts = self.b, self.spec, self.opts
        embed = lambda: self.weights["model.embed_tokens.weight"]  # noqa: E731
        last = b.op("Gather", [hidden, self.step[C.LOGITS_INDEX]], axis=0)  # [R, H]
        raw = "logits_before_softcap" if spec.final_softcap else C.LOGITS
        if opts.tied_gemm and spec.tie_word_embeddings and self.embed_name and opts.embed_dtype == np.float32:
            b.op("Gemm", [last, self.embed_name], transB=1, out=raw)
        elif opts.head_rescore:
            if not spec.tie_word_embeddings:
                raise ValueError("head_rescore needs tied embeddings: the exact rows come from the embedding table")
            coarse = self.project("lm_head", last, embed, node_name="lm_head/MatMul")
            _, cand = b.op("TopK", [coarse, b.const([opts.head_rescore])], n_out=2, axis=1, largest=1, sorted=0)
            rows = self.gather_rows(cand)  # [R, K, H]
            exact = b.op("MatMul", [rows, b.op("Unsqueeze", [last, b.const([2])])])  # [R, K, 1]
            b.op("ScatterElements", [coarse, cand, b.op("Squeeze", [exact, b.const([2])])], axis=1, out=raw)
        else:
            untied = not spec.tie_word_embeddings and "lm_head.weight" in self.weights
            head = (lambda: self.weights["lm_head.weight"]) if untied else embed
            self.project("lm_head", last, head, node_name="lm_head/MatMul", out=raw)
        if spec.final_softcap:
            b.op("Identity", [self.softcap(raw, spec.final_softcap)], out=C.LOGITS)
        b.output(C.LOGITS, FLOAT, ["num_logits", spec.vocab_size])
        return C.LOGITS
