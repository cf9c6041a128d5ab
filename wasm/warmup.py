"""A tiny decoder in the browser package's own format, for the model worker to run while the real
package downloads.

On a first visit V8 runs onnxruntime-web's WASM unoptimized until its hot functions tier up: the
first ~60 decode steps of the real model ran ~1.3-2.5x slower (a reload gets cached optimized code).
Running this model's steps (same operators, same kernels, random weights) while the network is busy
moves most of that tier-up off the first generation: in Node, the real model's first 96 steps took
13-16% less time after ~0.8 s of it.

Its steps' inputs are written beside it (warmup.json) by the same Python that builds a real step
(runtime/core/step_batch.py), so the model worker builds them from that file and the graph's I/O
spec, never from names of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

from exporter.builders import DecoderSpec, build_decoder
from exporter.quantizers.browser_format import dequantize_at_load
from exporter.quantizers.quantize import quantize_weights
from runtime import contract as C
from runtime.core.step_batch import Chunk, build_step

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, POSITIONS = 2, 128, 2, 1, 64, 256, 256, 256


def warmup_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inv = 1.0 / (10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    angles = np.arange(POSITIONS)[:, None] * inv[None]
    spec = DecoderSpec(architecture="llama", num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                       rms_norm_eps=1e-5, max_positions=POSITIONS, rope_cos=np.cos(angles), rope_sin=np.sin(angles))

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN),
               "model.norm.weight": np.ones(HIDDEN, np.float32)}
    shapes = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
              "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTERMEDIATE)}
    for i in range(LAYERS):
        for name, shape in shapes.items():
            weights[f"model.layers.{i}.{name}.weight"] = rand(*shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = np.ones(HIDDEN, np.float32)
    graph = build_decoder(spec, weights, embed_dtype=np.float16, tied_gemm=True)
    return dequantize_at_load(quantize_weights(graph, "int4"))


BLOCK_SIZE = 16


def warmup_steps(count: int = 48) -> list[dict]:
    """Steps shaped like a real generation's (mostly decodes at growing positions, some short prompt
    chunks): each its graph inputs as [values, dims] and the KV pool's dims."""
    steps = []
    for i in range(count):
        pos, tokens = 8 + i, 4 if i % 4 == 0 else 1
        blocks = -(-(pos + tokens) // BLOCK_SIZE)
        chunk = Chunk(tokens=[3 + t for t in range(tokens)], start=pos, block_table=list(range(blocks)),
                      kv_slots=list(range(pos, pos + tokens)), want_logits=True)
        batch = build_step([chunk], BLOCK_SIZE)
        steps.append({"feeds": batch.feeds(1), "pool_dims": [KV_HEADS, batch.max_blocks, BLOCK_SIZE, HEAD_DIM]})
    return steps


def write_warmup_model(path: Path) -> Path:
    """warmup.onnx, and warmup.json beside it: the graph's I/O spec (as a package manifest's) and its steps."""
    model = warmup_model()
    onnx.save(model, path)
    inputs = [{"name": i.name, "dtype": i.type.tensor_type.elem_type,
               "shape": [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]} for i in model.graph.input]
    spec = {"io": {"inputs": inputs, "roles": C.io_roles(LAYERS)}, "steps": warmup_steps()}
    path.with_suffix(".json").write_text(json.dumps(spec, separators=(",", ":")))
    return path
