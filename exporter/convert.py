"""The export pipeline: source -> graphs -> quantization -> a validated model package."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter import __version__, gguf_blocks
from exporter.awq import apply_awq, calibration_ids
from exporter.block_matmul import apply_grids
from exporter.browser_format import SESSION_CONFIG, dequantize_at_load
from exporter.decoder_graph import LoraSlots, build_decoder
from exporter.external_data import save_with_shared_data
from exporter.gptq import ACT_ORDER, DAMP, apply_gptq, model_samples
from exporter.hf_model import check_architecture, decoder_spec, float_weights
from exporter.progress import stage
from exporter.quantize import BITS, METHODS, QUANTS, quantize_weights
from exporter.sources import gguf_add_bos, load_config, load_model_and_tokenizer, resolve, source_fingerprint
from runtime import contract as C
from runtime.errors import RuvLLMError
from runtime.package import file_digest, load_package

TARGETS = ("cpu", "wasm", "webgpu", "cuda")
BROWSER_TARGETS = ("wasm", "webgpu")
GRAPH_FILE, LORA_GRAPH_FILE, DATA_FILE = "model.onnx", "model_lora.onnx", "model.onnx.data"
WEBGPU_GRAPH_FILE = "model_webgpu.onnx"  # a --target wasm package's graph for pages that get a GPU


@dataclass
class ConvertOptions:
    quant: str = "fp32"
    block_size: int | None = None  # quantization block (int4/int8; None: see weight_plan)
    mlp_block_size: int | None = None  # the MLP projections' block, if not block_size (see weight_plan)
    method: str | None = None  # int8/int4: "rtn" (round to nearest) or "awq" (see awq.py); None: see weight_plan
    calibration: str | None = None  # a text file for AWQ's calibration (default: the stdlib's documentation)
    head_quant: str | None = None  # the LM head's precision when quant is int8/int4 (None: see head_plan)
    head_rescore: int | None = None  # rescore the head's K best tokens from the embedding table (None: see head_plan)
    kv_block_size: int = 16
    target: str = "cpu"
    lora: bool = True
    max_context: int | None = None
    progress: bool = True


def kv_write_op(target: str) -> str:
    """The operator that writes a step's K/V into the gathered context (see build_decoder): in place
    everywhere, except that onnxruntime-web's WebGPU backend only has a kernel for ScatterND."""
    return "ScatterND" if target == "webgpu" else "TensorScatter"


AWQ_INT4_BLOCK = 64  # int4's default block with a calibrated method (AWQ, GPTQ); RTN's default stays 32
RESCORE_TOP = 32  # candidates the int4 head hands to the exact pass (64 measured no better)


def weight_plan(opts: ConvertOptions, source_kind: str = "folder") -> ConvertOptions:
    """Resolve the weights' quantization method and block sizes. int4 defaults to AWQ in blocks of 64:
    on SmolLM2 it is closer to fp32 than RTN in blocks of 32 on every measure (7k tokens: KL 0.24 vs
    0.38, perplexity 15.7 vs 16.3 against fp32's 12.7, top-1 80% vs 74%) while reading 11% fewer bytes a
    token (4.6 vs 5.1 bits a weight with the block's scale and zero point): a decode step 7.5% faster
    at 1 stream and 10% at 16. --mlp-block-size 128 (the MLP is three quarters of the weights) is
    faster still (a step +5-9% at 1 stream, +3-11% at 16) but costs ~15% more KL to fp32 on longer texts
    and fails the quality test's bounds on its short one, so it is not the default (ARCHITECTURE.md).
    int8 loses almost nothing with RTN (KL 0.004), so it keeps RTN.

    A GGUF source is already quantized: int4 and int8 default to "gguf", the file's own blocks carried
    over exactly (gguf_blocks.py); another method dequantizes them and quantizes a second time."""
    gguf = source_kind == "gguf" and opts.quant in ("int8", "int4")
    method = opts.method or ("gguf" if gguf else "awq" if opts.quant == "int4" else "rtn")
    if method == "gguf" and not gguf:
        raise RuvLLMError("--method gguf carries a GGUF file's blocks over: it needs a .gguf source and --quant int4/int8")
    if gguf and method != "gguf":
        print(f"warning: --method {method} quantizes this GGUF's already quantized weights a second time (a "
              f"lossier model than the file); leave --method out to carry its blocks over exactly", file=sys.stderr)
    if method not in (*METHODS, "gguf"):
        raise RuvLLMError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    if method != "rtn" and opts.quant not in ("int8", "int4"):
        raise RuvLLMError(f"--method {method} applies to --quant int8/int4, not {opts.quant}")
    block, mlp_block = opts.block_size, opts.mlp_block_size
    if block is None:
        block = AWQ_INT4_BLOCK if method not in ("rtn", "gguf") and opts.quant == "int4" else 32
    for flag, size in (("--block-size", block), ("--mlp-block-size", mlp_block)):
        if size is not None and (size < 16 or size & (size - 1)):
            raise RuvLLMError(f"{flag} must be a power of two, at least 16 (got {size})")
    if method == "gguf" and (opts.block_size or mlp_block):
        raise RuvLLMError("--block-size and --mlp-block-size do not apply to a GGUF's own blocks (--method gguf); "
                          "name another --method to re-quantize the file")
    if opts.quant == "w8a8" and opts.target in BROWSER_TARGETS:
        raise RuvLLMError("--quant w8a8 is for native targets (onnxruntime-web has no fast int8 GEMM); "
                          "browser packages use int4")
    if mlp_block is not None and opts.quant not in ("int8", "int4"):
        raise RuvLLMError(f"--mlp-block-size applies to --quant int8/int4, not {opts.quant}")
    return dataclasses.replace(opts, method=method, block_size=block,
                               mlp_block_size=None if mlp_block == block else mlp_block)


def head_plan(opts: ConvertOptions, tied: bool) -> ConvertOptions:
    """Resolve the LM head's quantization. The head is a fifth of SmolLM2's weights and read in full
    every token: an int4 head alone loses quality (on 7k tokens of text, KL to fp32 0.49 vs 0.34 with
    int8, perplexity +15%), an int8 head costs ~5% of a decode step. With tied embeddings the default
    for int4 on native targets is both: the int4 head ranks the vocabulary and its best RESCORE_TOP
    tokens are scored again from the fp16 embedding table: close to int8 (KL 0.38, perplexity +3%)
    at int4's speed.
    Browser packages dequantize to fp32 at load, so their head stays int8 (the download's size)."""
    quantized, native = opts.quant in ("int8", "int4", "w8a8"), opts.target not in BROWSER_TARGETS
    rescore_default = (opts.quant in ("int4", "w8a8") and native and tied and opts.head_quant in (None, "int4")
                       and opts.method != "gguf")
    head_quant = opts.head_quant or ("int4" if rescore_default else "int8")
    rescore = opts.head_rescore if opts.head_rescore is not None else (RESCORE_TOP if rescore_default else 0)
    if rescore and not (quantized and native):
        raise RuvLLMError("--head-rescore applies to int8/int4 packages for native targets")
    if rescore and not tied:
        raise RuvLLMError("--head-rescore needs a model with tied embeddings (the exact rows come from that table)")
    if rescore < 0:
        raise RuvLLMError("--head-rescore must be 0 (off) or a positive number of candidates")
    return dataclasses.replace(opts, head_quant=head_quant, head_rescore=rescore)


def convert(source_name: str, out_dir: str | Path, opts: ConvertOptions | None = None) -> Path:
    opts = opts or ConvertOptions()
    if opts.quant not in QUANTS:
        raise RuvLLMError(f"unknown --quant {opts.quant!r}; choose one of {', '.join(QUANTS)}")
    if opts.target not in TARGETS:
        raise RuvLLMError(f"unknown --target {opts.target!r}; choose one of {', '.join(TARGETS)}")
    try:
        source = resolve(source_name)
    except RuvLLMError:
        weight_plan(opts)  # a wrong option is named before a missing source
        raise
    opts = weight_plan(opts, source.kind)
    if opts.head_quant not in (None, "int8", "int4"):
        raise RuvLLMError(f"unknown --head-quant {opts.head_quant!r}; choose int8 or int4")
    out = Path(out_dir)
    check_architecture(load_config(source))  # fail fast, before loading any weights
    started = time.time()
    on = opts.progress

    bar = stage({"gguf": "reading GGUF", "hub": "downloading/reading"}.get(source.kind, "reading model"), enabled=on)
    model, tok = load_model_and_tokenizer(source)
    bar.close()

    lora_scales, grids, gptq_calibration = None, None, None
    calibration = calibration_ids(tok, opts.calibration) if opts.method not in ("rtn", "gguf") else []
    if "gptq" in opts.method and not opts.calibration:  # sampled before AWQ's clipping changes the weights
        bar = stage("sampling GPTQ calibration", enabled=on)
        own = model_samples(model)
        bar.close()
        gptq_sequences = calibration[:len(calibration) // 2] + own
        gptq_calibration = f"half of it, and {len(own)} samples of {len(own[0])} tokens from the model itself"
    else:
        gptq_sequences, gptq_calibration = calibration, opts.calibration and Path(opts.calibration).name
    if opts.method in ("awq", "awq+gptq"):  # scales folded into the float weights before the graphs are built
        lora_scales = apply_awq(model, calibration, opts.block_size, BITS[opts.quant],
                                progress=on, mlp_block=opts.mlp_block_size)
    if opts.method in ("gptq", "awq+gptq"):  # the weights become their quantized values; grids keep the integers
        grids = apply_gptq(model, gptq_sequences, opts.block_size, BITS[opts.quant],
                           mlp_block=opts.mlp_block_size, progress=on)

    bar = stage("building graphs", enabled=on)
    spec = decoder_spec(model, opts.max_context)
    weights = float_weights(model)
    gen_cfg = model.generation_config.to_dict() if model.generation_config is not None else {}
    del model
    quantized = opts.quant in ("int8", "int4", "w8a8")
    weight_dtype = np.float16 if opts.quant == "fp16" else np.float32
    embed_dtype = np.float32 if opts.quant == "fp32" else np.float16
    opts = head_plan(opts, spec.tie_word_embeddings)
    if opts.head_rescore > spec.vocab_size:
        raise RuvLLMError(f"--head-rescore {opts.head_rescore} is more than the vocabulary ({spec.vocab_size} tokens)")
    carried = None
    if opts.method == "gguf":  # the file's blocks, checked bit for bit against what transformers loaded
        read = gguf_blocks.read(source.path, weights, spec.num_layers)
        carried = gguf_blocks.graph_grids(read, spec.num_layers, BITS[opts.quant], spec.tie_word_embeddings,
                                          exact_head=not opts.head_rescore)
        if on:
            types: dict[str, int] = {}
            for t in read.types.values():
                types[t] = types.get(t, 0) + 1
            layouts = _carried_summary(carried, opts)["projections"]
            print("export: the GGUF's blocks carried over exactly: "
                  + ", ".join(f"{n} {t}" for t, n in sorted(types.items())) + " -> "
                  + "; ".join(f"{n} x {layout}" for layout, n in layouts.items()), file=sys.stderr)
        if carried.requantized:
            print(f"warning: {len(carried.requantized)} of the GGUF's matrices have no exact {opts.quant} layout here "
                  f"(e.g. {carried.requantized[0]}): quantized with RTN in blocks of 32", file=sys.stderr)

    def build(lora_slots: LoraSlots | None, kv_write: str):
        return build_decoder(spec, weights, lora_slots, weight_dtype, embed_dtype, tied_gemm=True,
                             kv_write=kv_write, head_rescore=opts.head_rescore, lora_scales=lora_scales,
                             embed_grid=carried and carried.embedding)

    graphs = {GRAPH_FILE: build(None, kv_write_op(opts.target))}
    if opts.lora:
        graphs[LORA_GRAPH_FILE] = build(LoraSlots(), kv_write_op(opts.target))
    if opts.target == "wasm":  # the page picks its device at load: a GPU gets the graph its backend has kernels for
        graphs[WEBGPU_GRAPH_FILE] = build(None, kv_write_op("webgpu"))
    weights.clear()  # free the float copies before quantizing
    bar.close()

    if quantized:
        tied = "model.embed_tokens.weight" if spec.tie_word_embeddings else None
        for name in stage(f"quantizing ({opts.quant}, graphs)", list(graphs), enabled=on):
            own = carried.projections if carried else {}
            skip = frozenset(n.name for n in graphs[name].graph.node if n.op_type == "MatMul" and n.input[-1] in own)
            graphs[name] = quantize_weights(graphs[name], opts.quant, opts.block_size, head_quant=opts.head_quant,
                                            mlp_block_size=opts.mlp_block_size, grids=grids, skip=skip)
            if own:
                graphs[name] = apply_grids(graphs[name], own)
            if opts.target in BROWSER_TARGETS:  # storage stays quantized, compute becomes fp32 (browser_format)
                graphs[name] = dequantize_at_load(graphs[name], tied, exact=carried is not None)

    bar = stage("writing package", enabled=on)
    # stage beside the destination: a rename from another filesystem (a tmpfs /tmp) would fail
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ruvllm-export-", dir=out.parent))
    try:
        save_with_shared_data(graphs, tmp, DATA_FILE)
        tokenizer_meta = _write_tokenizer(tok, tmp, source)
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2, default=str))
        manifest = _manifest(source, spec, opts, tokenizer_meta, gen_cfg, graphs, started, gptq_calibration, carried)
        manifest["files"] = {f.name: {"size": f.stat().st_size, "sha256": file_digest(f)}
                             for f in sorted(tmp.iterdir()) if f.name != C.MANIFEST}
        (tmp / C.MANIFEST).write_text(json.dumps(manifest, indent=2))
        load_package(tmp, verify_hashes=False)  # what we wrote must pass the runtime's own checks
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    bar.close()
    return out


def _write_tokenizer(tok, out: Path, source) -> dict:
    with tempfile.TemporaryDirectory() as td:
        tok.save_pretrained(td)
        src = Path(td) / "tokenizer.json"
        if not src.exists():
            raise RuvLLMError(f"{source.id}: the tokenizer has no tokenizer.json (only fast tokenizers are supported)")
        shutil.copy(src, out / "tokenizer.json")
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)
    # Does plain encoding add a BOS? A GGUF's own flag wins over transformers' conversion (DESIGN §7).
    plain = tok("a", add_special_tokens=False).input_ids
    with_special = tok("a").input_ids
    add_bos = tok.bos_token_id is not None and len(with_special) > len(plain) and with_special[0] == tok.bos_token_id
    if source.kind == "gguf":
        flag = gguf_add_bos(source.path)
        if flag is not None:
            add_bos = flag
    return {
        "file": "tokenizer.json",
        "chat_template": "chat_template.jinja" if (out / "chat_template.jinja").exists() else None,
        "add_bos_token": bool(add_bos),
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": tok.unk_token,
        "pad_token": tok.pad_token,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
    }


def _manifest(source, spec, opts: ConvertOptions, tok_meta: dict, gen_cfg: dict, graphs: dict, started: float,
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
        if opts.quant == "w8a8":  # block_size, symmetric, accuracy_level and op are the head's
            quant["projections"] = {"op": "MatMulInteger", "weights": "int8, symmetric, per output channel",
                                    "activations": "uint8 around 128, symmetric, per row (dynamic)"}
        if opts.mlp_block_size:
            quant["mlp_block_size"] = opts.mlp_block_size
        if carried is not None:
            quant.update(block_size=min((g.block for g in carried.projections.values()), default=32),
                         gguf=_carried_summary(carried, opts))
            if carried.embedding is not None:
                quant["embeddings"] = f"the file's blocks ({gguf_blocks.describe(carried.embedding)})"
        if opts.method not in ("rtn", "gguf"):
            quant["calibration"] = opts.calibration and Path(opts.calibration).name or "python-stdlib-docs"
        if "gptq" in opts.method:
            quant["gptq"] = {"act_order": ACT_ORDER, "damp": DAMP, "calibration": gptq_calibration}
        if opts.head_rescore:
            quant["lm_head_rescore"] = {"top": opts.head_rescore, "from": f"the {quant['embeddings']} embedding table"}
        if opts.target in BROWSER_TARGETS:
            quant.update(op="DequantizeLinear+MatMul", compute="fp32", dequantized="at session creation",
                         session_config=dict(SESSION_CONFIG))
            if spec.tie_word_embeddings and not (carried and carried.embedding is not None):
                quant["embeddings"] = f"tied to the {opts.head_quant} lm_head"
    n_params = _count_params(spec)
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
        },
        "graphs": {
            "decoder": {"file": GRAPH_FILE, "lora": False},
            **({"decoder_lora": {"file": LORA_GRAPH_FILE, "lora": True}} if LORA_GRAPH_FILE in graphs else {}),
            **({"decoder_webgpu": {"file": WEBGPU_GRAPH_FILE, "lora": False, "kv_write": kv_write_op("webgpu")}}
               if WEBGPU_GRAPH_FILE in graphs else {}),
        },
        "io": io,
        "kv_cache": {"layout": "paged", "block_size": opts.kv_block_size, "dtype": "float32",
                     "write": kv_write_op(opts.target),
                     "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
        "quantization": quant,
        "lora": {"targets": list(C.LORA_TARGETS), "graph": LORA_GRAPH_FILE} if LORA_GRAPH_FILE in graphs else None,
        "target": opts.target,
        "tokenizer": tok_meta,
        "chat_template": tok_meta.pop("chat_template"),
        "special_tokens": {"eos_token_ids": sorted(eos), "bos_token_id": tok_meta.get("bos_token_id")},
        "generation_config": "generation_config.json",
        "provenance": {
            "source": source.id, "source_kind": source.kind, "source_sha256": source_fingerprint(source),
            "exporter_version": __version__, "export_seconds": round(time.time() - started, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }


def _carried_summary(carried, opts: ConvertOptions) -> dict:
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


def _count_params(spec) -> int:
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    attn = h * (spec.num_heads * d) * 2 + h * (spec.num_kv_heads * d) * 2
    per_layer = attn + 3 * h * i + 2 * h
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    return spec.num_layers * per_layer + spec.vocab_size * h + head + h
