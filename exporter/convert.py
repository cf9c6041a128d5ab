"""The export pipeline: source -> graphs -> quantization -> a validated model package."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from exporter import staging
from exporter.builders import LoraSlots, build_decoder
from exporter.options import (
    BROWSER_TARGETS,
    DATA_FILE,
    GRAPH_FILE,
    KV8_GRAPH_FILE,
    LORA_GRAPH_FILE,
    TARGETS,
    WEBGPU_GRAPH_FILE,
    WEBGPU_GRAPHS,
    WEBGPU_LORA_GRAPH_FILE,
    ConvertOptions,
    head_plan,
    kv_write_op,
    weight_plan,
)
from exporter.progress import stage
from exporter.quantizers.awq import apply_awq, apply_smoothquant, calibration_ids
from exporter.quantizers.block_matmul import apply_grids, kernel_layouts
from exporter.quantizers.browser_format import dequantize_at_load, keep_blocks_for_webgpu
from exporter.quantizers.gptq import apply_gptq, model_samples
from exporter.quantizers.quantize import BITS, QUANTS, quantize_weights
from exporter.sources import gguf_blocks
from exporter.sources.gguf_generation import gguf_generation
from exporter.sources.hf_model import as_supported, check_architecture, decoder_spec, float_weights
from exporter.sources.locate import (
    load_config,
    load_model_and_tokenizer,
    resolve,
)
from exporter.sources.safetensors_tensors import NotStreamable
from exporter.step_weights import package_step
from exporter.streamed import convert_streamed, streams
from exporter.writers.external_data import save_with_shared_data
from exporter.writers.manifest import carried_summary
from exporter.writers.manifest import manifest as write_manifest
from exporter.writers.tokenizer_files import write_tokenizer
from runtime import contract as C
from runtime.backends.graph_rewrite import declared_fusions
from runtime.errors import RuvLLMError
from runtime.package import file_entry, load_package, record_verified


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
    arch = check_architecture(load_config(source))  # fail fast, before loading any weights
    if arch == "phi3" and source.kind == "gguf":
        raise RuvLLMError(f"{source.id}: a Phi-3 GGUF's fused blocks cannot be carried over yet; export the "
                          "Hugging Face folder instead")
    started = time.time()
    on = opts.progress
    if streams(source, opts, arch):
        try:
            return convert_streamed(source, out, opts, started)
        except NotStreamable as err:  # (before anything is written)
            if on:
                print(f"export: {err}; loading the model whole", file=sys.stderr)

    bar = stage({"gguf": "reading GGUF", "hub": "downloading/reading"}.get(source.kind, "reading model"), enabled=on)
    model, tok = load_model_and_tokenizer(source)
    model = as_supported(model)
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
    if opts.method == "smoothquant":  # activation outliers moved into the weights before W8A8
        lora_scales = apply_smoothquant(model, calibration, progress=on)
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
            layouts = carried_summary(carried, opts)["projections"]
            print("export: the GGUF's blocks carried over exactly: "
                  + ", ".join(f"{n} {t}" for t, n in sorted(types.items())) + " -> "
                  + "; ".join(f"{n} x {layout}" for layout, n in layouts.items()), file=sys.stderr)
        if carried.requantized:
            why = "no exact layout here, or 4-bit blocks with minimums, which int8 computes worse" if opts.quant == "int8" \
                else f"no exact {opts.quant} layout here"
            print(f"warning: {len(carried.requantized)} of the GGUF's matrices (e.g. {carried.requantized[0]}) are "
                  f"quantized with RTN in blocks of 32 ({why})", file=sys.stderr)

    def build(lora_slots: LoraSlots | None, kv_write: str):
        return build_decoder(spec, weights, lora_slots, weight_dtype, embed_dtype, tied_gemm=True,
                             kv_write=kv_write, head_rescore=opts.head_rescore, lora_scales=lora_scales,
                             embed_grid=carried and carried.embedding)

    graphs = {GRAPH_FILE: build(None, kv_write_op(opts.target))}
    if opts.lora:
        graphs[LORA_GRAPH_FILE] = build(LoraSlots(), kv_write_op(opts.target))
    if opts.target == "wasm":  # the page picks its device at load: a GPU gets the graph its backend has kernels for
        graphs[WEBGPU_GRAPH_FILE] = build(None, kv_write_op("webgpu"))
        if opts.lora:
            graphs[WEBGPU_LORA_GRAPH_FILE] = build(LoraSlots(), kv_write_op("webgpu"))
    weights.clear()  # free the float copies before quantizing
    bar.close()
    own = carried.projections if carried else {}
    if opts.method == "hqq":  # the projections' grids, once for every graph (they share the weights)
        own = hqq_projection_grids(graphs[GRAPH_FILE], BITS[opts.quant], opts.block_size, opts.mlp_block_size, on)

    if quantized:
        tied = "model.embed_tokens.weight" if spec.tie_word_embeddings else None
        for name in stage(f"quantizing ({opts.quant}, graphs)", list(graphs), enabled=on):
            skip = frozenset(n.name for n in graphs[name].graph.node if n.op_type == "MatMul" and n.input[-1] in own)
            graphs[name] = quantize_weights(graphs[name], opts.quant, opts.block_size, head_quant=opts.head_quant,
                                            mlp_block_size=opts.mlp_block_size, grids=grids, skip=skip)
            if own:
                graphs[name] = apply_grids(graphs[name], own)
            if name in WEBGPU_GRAPHS or opts.target == "webgpu":  # the GPU holds the blocks at their bits
                graphs[name] = keep_blocks_for_webgpu(graphs[name], tied, exact=carried is not None)
            elif opts.target in BROWSER_TARGETS:  # storage stays quantized, compute becomes fp32 (browser_format)
                graphs[name] = dequantize_at_load(graphs[name], tied, exact=carried is not None)
            elif opts.target == "cpu":  # int4 grids in the CPU kernel's layout: a load maps them
                kernel_layouts(graphs[name])

    return write_package(out, graphs, None, tok, source, spec, opts, gen_cfg, started, gptq_calibration, carried)


def staging_dir(out: Path) -> Path:
    """A fresh folder beside the destination (a rename from another filesystem, a tmpfs /tmp, would fail);
    what killed exports left there is removed first (exporter/staging.py)."""
    return staging.staging_dir(out.parent, "export")


def write_package(out: Path, graphs: dict, store, tok, source, spec, opts: ConvertOptions, gen_cfg: dict,
                  started: float, gptq_calibration=None, carried=None, tmp: Path | None = None,
                  browser_graphs: bool = True) -> Path:
    """The graphs (their weights already in `store`'s file in `tmp`, or in memory), tokenizer and
    manifest, checked by the runtime's own reader, renamed into place. browser_graphs=False: a page's
    package whose graphs are the native engine's (the page runs its WASM step only)."""
    bar = stage("writing package", enabled=opts.progress)
    tmp = tmp or staging_dir(out)
    try:
        save_with_shared_data(graphs, tmp, DATA_FILE, store)
        if store is not None:
            store.close()
        kv8 = kv_int8_graph(tmp / GRAPH_FILE, tmp / KV8_GRAPH_FILE, spec.num_layers)
        if kv8 is not None:
            graphs[KV8_GRAPH_FILE] = kv8
        tokenizer_meta = write_tokenizer(tok, tmp, source)
        if source.kind == "gguf":  # the file's own sampling settings, where llama.cpp's converter kept them
            gen_cfg = {**gen_cfg, **gguf_generation(str(source.path))}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2, default=str))
        manifest = write_manifest(source, spec, opts, tokenizer_meta, gen_cfg, graphs, started, gptq_calibration, carried)
        if opts.target == "wasm" and opts.method == "gguf" and opts.quant == "int4":  # the graphs' own blocks
            step = package_step(source.path, tmp, spec.max_positions, opts.progress)
            if step:
                manifest["wasm_step"] = step if browser_graphs else {**step, "only": True}
            elif not browser_graphs:
                raise RuvLLMError(f"{source.id}: the WASM step cannot read this file, and its graphs are not the page's")
        for entry in manifest["graphs"].values():  # what the native backend must fuse, or refuse the graph
            entry["fusions"] = declared_fusions(tmp / entry["file"], manifest["config"])
        manifest["files"] = {f.name: file_entry(f)
                             for f in sorted(tmp.iterdir()) if f.name != C.MANIFEST}
        (tmp / C.MANIFEST).write_text(json.dumps(manifest, indent=2))
        load_package(tmp, verify_hashes=False)  # what we wrote must pass the runtime's own checks
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
        record_verified(out, manifest)  # the sha256s above were read from these very files
    finally:
        if store is not None:
            store.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    bar.close()
    return out


def hqq_projection_grids(graph, bits: int, block: int, mlp_block: int | None, progress: bool) -> dict:
    """HQQ grids of every projection of the graph but the LM head (which keeps its own bits, by RTN)."""
    from onnx import numpy_helper

    from exporter.quantizers.hqq import hqq_grid
    from exporter.quantizers.quantize import LM_HEAD_NODE, MLP_WEIGHTS

    inits = {t.name: t for t in graph.graph.initializer}
    names = [n.input[1] for n in graph.graph.node
             if n.op_type == "MatMul" and n.name != LM_HEAD_NODE and len(n.input) == 2 and n.input[1] in inits]
    grids = {}
    for name in stage("HQQ (projections)", names, enabled=progress):
        b = (mlp_block or block) if name.endswith(MLP_WEIGHTS) else block
        grids[name] = hqq_grid(np.ascontiguousarray(numpy_helper.to_array(inits[name]).T), bits, b)
    return grids


def kv_int8_graph(graph: Path, out: Path, num_layers: int):
    """The saved graph on an int8 KV pool (graph_rewrite.kv_in_int8_graph: the gathered blocks times their
    group scales, this step's rows rounded as the pool stores them), written beside it with the same
    weights file: onnxruntime-web cannot rewrite a graph, so the page's kvDtype "int8" opens this one.
    None where the rewrite does not know every layer's attention (it leaves no file then)."""
    import onnx

    from runtime.backends.graph_rewrite import kv_in_int8_graph

    model = onnx.load(str(graph), load_external_data=False)
    if kv_in_int8_graph(model) != num_layers:
        return None
    onnx.save(model, str(out))
    return model
