"""The package manifest: what the runtime reads before it loads anything (runtime/package.py checks it)."""

from __future__ import annotations

import time
from pathlib import Path

from exporter import __version__
from exporter.options import (
    BROWSER_TARGETS,
    GRAPH_FILE,
    KV8_GRAPH_FILE,
    LORA_GRAPH_FILE,
    WEBGPU_GRAPH_FILE,
    WEBGPU_LORA_GRAPH_FILE,
    ConvertOptions,
    kv_write_op,
)
from exporter.quantizers.browser_format import SESSION_CONFIG
from exporter.quantizers.gptq import ACT_ORDER, DAMP
from exporter.sources import gguf_blocks
from exporter.sources.locate import source_fingerprint
from runtime import contract as C


def manifest(source, spec, opts: ConvertOptions, tok_meta: dict, gen_cfg: dict, graphs: dict, started: float,
              gptq_calibration: str | None = None, carried=None) -> dict:
    eos = set()
    for value in (gen_cfg.get("eos_token_id"), tok_meta.get("eos_token_id")):
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(v for v in value if isinstance(v, int))
    first = graphs[GRAPH_FILE]
    io = {
        "inputs": [{"name": i.name, "dtype": i.type.tensor_type.elem_type,
                    "shape": [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]}
                   for i in first.graph.input],
        "outputs": [o.name for o in first.graph.output],
        "roles": C.io_roles(spec.num_layers),
    }
    quant = {"fp32": {"weights": "fp32", "embeddings": "fp32", "lm_head": "tied" if spec.tie_word_embeddings else "fp32"},
             "fp16": {"weights": "fp16", "embeddings": "fp16", "lm_head": "fp16"},
             "int8": {"weights": "int8", "embeddings": "fp16", "lm_head": opts.head_quant},
             "int4": {"weights": "int4", "embeddings": "fp16", "lm_head": opts.head_quant},
             "w8a8": {"weights": "int8", "activations": "int8", "embeddings": "fp16", "lm_head": opts.head_quant},
             }[opts.quant]
    if opts.quant in ("int8", "int4", "w8a8"):
        quant.update(method=opts.method, block_size=opts.block_size, symmetric=False, accuracy_level=4,
                     op="com.microsoft.MatMulNBits")
        if opts.quant == "int4" and opts.target == "cpu":  # exporter/quantizers/block_matmul.kernel_layouts
            quant["op"] = "ruvllm.MatMulQ4 where its kernel reads the grid (in the kernel's layout), else com.microsoft.MatMulNBits"
        if opts.quant == "w8a8":  # block_size, symmetric, accuracy_level and op are the head's
            quant["projections"] = {"op": "MatMulInteger", "weights": "int8, symmetric, per output channel",
                                    "activations": "uint8 around 128, symmetric, per row (dynamic)"}
        if opts.mlp_block_size:
            quant["mlp_block_size"] = opts.mlp_block_size
        if carried is not None:
            quant.update(block_size=min((g.block for g in carried.projections.values()), default=32),
                         gguf=carried_summary(carried, opts))
            if carried.embedding is not None:
                quant["embeddings"] = f"the file's blocks ({gguf_blocks.describe(carried.embedding)})"
            if "lm_head" in carried.projections:
                quant["lm_head"] = f"the file's blocks ({gguf_blocks.describe(carried.projections['lm_head'])})"
        if opts.method not in ("rtn", "gguf"):
            quant["calibration"] = opts.calibration and Path(opts.calibration).name or "python-stdlib-docs"
        if "gptq" in opts.method:
            quant["gptq"] = {"act_order": ACT_ORDER, "damp": DAMP, "calibration": gptq_calibration}
        if opts.head_rescore:
            quant["lm_head_rescore"] = {"top": opts.head_rescore, "from": f"the {quant['embeddings']} embedding table"}
        if opts.target == "webgpu":  # browser_format.keep_blocks_for_webgpu
            quant.update(op="MatMulNBits", compute="fp32", dequantized="in the shader")
        elif opts.target in BROWSER_TARGETS:
            quant.update(op="DequantizeLinear+MatMul", compute="fp32", dequantized="at session creation",
                         session_config=dict(SESSION_CONFIG))
            if WEBGPU_GRAPH_FILE in graphs:  # the GPU's graph keeps the blocks (browser_format)
                quant["webgpu"] = {"op": "MatMulNBits", "compute": "fp32", "dequantized": "in the shader"}
            if spec.tie_word_embeddings and not (carried and carried.embedding is not None):
                quant["embeddings"] = f"tied to the {opts.head_quant} lm_head"
    n_params = count_params(spec)
    return {
        "format": C.FORMAT_NAME,
        "format_version": C.FORMAT_VERSION,
        "name": Path(source.path).stem if source.kind == "gguf" else source.id.rstrip("/").split("/")[-1],
        "architecture": spec.architecture,
        "config": {
            "num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
            "max_positions": spec.max_positions, "rms_norm_eps": spec.rms_norm_eps,
            "sliding_window": spec.sliding_window, "tie_word_embeddings": spec.tie_word_embeddings,
            "num_parameters": n_params,
            **({"layer_windows": list(spec.layer_windows)} if spec.layer_windows else {}),
            **({"attn_softcap": spec.attn_softcap} if spec.attn_softcap else {}),
            **({"final_softcap": spec.final_softcap} if spec.final_softcap else {}),
            **compute_traits(spec),
        },
        "graphs": {
            "decoder": {"file": GRAPH_FILE, "lora": False},
            **({"decoder_lora": {"file": LORA_GRAPH_FILE, "lora": True}} if LORA_GRAPH_FILE in graphs else {}),
            **({"decoder_webgpu": {"file": WEBGPU_GRAPH_FILE, "lora": False, "kv_write": kv_write_op("webgpu")}}
               if WEBGPU_GRAPH_FILE in graphs else {}),
            **({"decoder_webgpu_lora": {"file": WEBGPU_LORA_GRAPH_FILE, "lora": True, "kv_write": kv_write_op("webgpu")}}
               if WEBGPU_LORA_GRAPH_FILE in graphs else {}),
            **({"decoder_kv8": {"file": KV8_GRAPH_FILE, "lora": False, "kv_write": kv_write_op(opts.target),
                                "kv_dtype": "int8"}} if KV8_GRAPH_FILE in graphs else {}),
        },
        "io": io,
        "kv_cache": {"layout": "paged", "block_size": opts.kv_block_size, "dtype": "float32",
                     "write": kv_write_op(opts.target),
                     "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
        "quantization": quant,
        "lora": ({"targets": list(C.LORA_TARGETS), "graph": LORA_GRAPH_FILE, C.LORA_PER_MODULE: True}
                 if LORA_GRAPH_FILE in graphs else None),
        "target": opts.target,
        "tokenizer": tok_meta,
        "chat_template": tok_meta.pop("chat_template"),
        "special_tokens": {"eos_token_ids": sorted(eos), "bos_token_id": tok_meta.get("bos_token_id")},
        "generation_config": "generation_config.json",
        "provenance": {
            "source": source.id, "source_kind": source.kind, "source_sha256": source_fingerprint(source),
            "source_architecture": spec.source_architecture or spec.architecture,
            "exporter_version": __version__, "export_seconds": round(time.time() - started, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }


def carried_summary(carried, opts: ConvertOptions) -> dict:
    """What the package carries from the GGUF, for the manifest and `inspect`."""
    layouts: dict[str, int] = {}
    for grid in carried.projections.values():
        key = gguf_blocks.describe(grid)
        layouts[key] = layouts.get(key, 0) + 1
    head = "the file's own, exact" if "lm_head" in carried.projections else (
        f"{opts.head_quant} RTN, its best {opts.head_rescore} rescored from the file's exact embedding rows")
    return {"exact": not carried.requantized, "projections": layouts, "lm_head": head,
            "embeddings": gguf_blocks.describe(carried.embedding) if carried.embedding is not None else None,
            "requantized": carried.requantized}


def count_params(spec) -> int:
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    attn = h * (spec.num_heads * d) * 2 + h * (spec.num_kv_heads * d) * 2
    per_layer = attn + 3 * h * i + 2 * h
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    return spec.num_layers * per_layer + spec.vocab_size * h + head + h


def compute_traits(spec) -> dict:
    """How the decoder computes beyond its projections, for engines that run it again outside its graph
    (the instant loop's backward, runtime/backends/lora_gradients.py): they read this, never the
    architecture's name. Written whole, so that a package without it is known to predate it."""
    local = list(spec.layer_rope_local) if spec.layer_rope_local and any(spec.layer_rope_local) else None
    return {"compute": {"activation": spec.activation, "embed_scale": float(spec.embed_scale),
                        "attn_scale": spec.attn_scale, "qk_norm": bool(spec.qk_norm),
                        "sandwich_norms": bool(spec.sandwich_norms), "layer_rope_local": local}}
