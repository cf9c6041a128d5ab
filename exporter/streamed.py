"""The export of a GGUF file or a Hugging Face folder tensor by tensor: memory follows one tensor.

The graph is built from the config alone (a transformers model with no weights gives the spec and
the rotary tables); each projection is read from the memory-mapped file when the builder reaches it,
as the file's own blocks or, for a type with no grid here (and for a folder's float weights), RTN of
that one tensor; its packed numbers go to the package's data file at once. AWQ and GPTQ run here one
decoder layer at a time (quantizers/layerwise.py) where the model is large (`layerwise`). The page's
targets (which dequantize at load), HQQ, SmoothQuant, smaller models' AWQ and GPTQ (which also
calibrate on the model's own samples) and a checkpoint that names its weights otherwise load the model
whole (convert.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from exporter.builders import FUSED_PROJECTIONS, LoraSlots, build_decoder, family_for
from exporter.builders.projections import OwnBits, ProjectionGrids
from exporter.options import (
    BROWSER_TARGETS,
    DATA_FILE,
    GRAPH_FILE,
    LORA_GRAPH_FILE,
    ConvertOptions,
    head_plan,
    kv_write_op,
)
from exporter.progress import stage
from exporter.quantizers.grid import Grid, rtn_grid, stack_rows
from exporter.quantizers.quantize import BITS, MLP_WEIGHTS
from exporter.sources.gguf_blocks import GraphGrids
from exporter.sources.gguf_tensors import GgufTensors, LazyWeights
from exporter.sources.safetensors_tensors import SafetensorsTensors
from exporter.writers.external_data import WeightStore
from runtime.backends.block_layouts import OWN
from runtime.errors import RuvLLMError
from runtime.formats.block_types import GATHER_TYPES

HEAD_ROWS = 8192  # rows of a float LM head quantized at a time (a 128k vocabulary's head is 1 GB in fp32)


def streams(source, opts: ConvertOptions, architecture: str) -> bool:
    """Whether this export reads its source tensor by tensor (the rest load the model whole). A page's
    package streams where the page runs it on its WASM step alone (a GGUF the step reads, int4 from the
    file's blocks): its graphs are then the native engine's, and the page never runs them."""
    if architecture == "phi3":  # (Phi-3's fused checkpoint is rebuilt as Mistral from the loaded model)
        return False
    if opts.target in BROWSER_TARGETS:
        return opts.target == "wasm" and step_only(source, opts)
    if source.kind not in ("gguf", "folder") or opts.quant not in ("fp32", "fp16", "int8", "int4"):
        return False
    return opts.method in ("gguf", "rtn") or (opts.method in CALIBRATED and layerwise(source, opts))


CALIBRATED = ("awq", "gptq", "awq+gptq")  # the methods quantizers/layerwise.py runs layer by layer


def layerwise(source, opts: ConvertOptions) -> bool:
    """Whether AWQ/GPTQ run one layer at a time: --layerwise, else when the model's fp32 weights exceed a
    quarter of this machine's memory (the whole-model path holds them about three times over: the model,
    the graphs' copy, the quantizer's)."""
    if opts.layerwise is not None:
        return opts.layerwise
    import os

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 4 * source_parameters(source) > memory / 4


def source_parameters(source) -> int:
    """How many numbers the source's tensors hold, from the files' headers (nothing read beyond them)."""
    import json
    import struct

    if source.kind == "gguf":
        from runtime.formats.gguf_file import read_header_file

        return sum(int(np.prod(t.shape)) for t in read_header_file(source.path).tensors.values())
    total = 0
    for f in Path(source.path).glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(int(np.prod(t["shape"])) for k, t in header.items() if k != "__metadata__")
    return total


PAGE_FP32_BYTES = 2 << 30  # past this, a page cannot hold the graphs' fp32 weights (onnxruntime-web's form)


def step_only(source, opts: ConvertOptions) -> bool:
    """Whether a page's package carries the WASM step alone: a GGUF whose tensors the step reads, int4
    from its own blocks, too large for the page's onnxruntime-web graphs (their weights become fp32 at
    load) to run anyway."""
    if source.kind != "gguf" or opts.method != "gguf" or opts.quant != "int4":
        return False
    from exporter.step_weights import step_arrays
    from runtime.errors import PackageError

    if 4 * source_parameters(source) <= PAGE_FP32_BYTES:
        return False
    try:
        step_arrays(source.path, 16)  # the header's checks; no array is read
    except PackageError:
        return False
    return True


def skeleton(source):
    """The transformers model of the file's config with no weights (parameters on the meta device;
    buffers such as the rotary frequencies are real), and its tokenizer and generation config."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from exporter.sources.locate import load_config

    config = load_config(source)
    where, kwargs = source.load_args
    tok = AutoTokenizer.from_pretrained(where, **kwargs)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:  # a folder's own generation_config.json, as from_pretrained reads it
        gen = GenerationConfig.from_pretrained(where).to_dict() if source.kind == "folder" else None
    except OSError:
        gen = None
    return model.eval(), tok, gen or GenerationConfig.from_model_config(config).to_dict()


class StreamedProjections:
    """The grid of each graph weight (exporter.builders.FUSED_PROJECTIONS' names and "lm_head"): a GGUF's
    own blocks (at their own bits for the kernel, or fused as the graph fuses them and widened to the
    package's bits), or RTN of the floats where a part has no grid here (or, for int8, 4-bit blocks with
    minimums: gguf_blocks.graph_grids says why), and of a folder's float weights. Remembers what it
    carried and what it quantized again, for the manifest."""

    def __init__(self, tensors, opts: ConvertOptions, tied: bool, bar=None, calibrated=None) -> None:
        """tensors: a GgufTensors or a SafetensorsTensors; calibrated: a layerwise.LayerwiseQuantizer, whose
        grids the layers' projections take."""
        self.t, self.opts, self.tied, self.bar, self.calibrated = tensors, opts, tied, bar, calibrated
        self.bits, self.head_bits = BITS[opts.quant], BITS[opts.head_quant]
        self.carried: set[str] = set()  # graph weights on the file's own blocks
        self.requantized: set[str] = set()
        self.embedding: Grid | None = None  # the embedding's grid, when the graph has it: a tied head is it

    def grid(self, name: str) -> Grid | None:
        if name == "model.embed_tokens.weight" and self.embedding is not None:
            return self.embedding
        return self.t.grid(name)

    def parts(self, name: str) -> list[str]:
        if name == "lm_head":
            untied = not self.tied and "lm_head.weight" in self.t.tensors
            return ["lm_head.weight" if untied else "model.embed_tokens.weight"]
        layer, fused = name.split(".")[1], name.split(".")[2]
        return [f"model.layers.{layer}.{p}.weight" for p in FUSED_PROJECTIONS[fused]]

    def __call__(self, name: str) -> Grid | OwnBits:
        parts = self.parts(name)
        head = name == "lm_head"
        if self.calibrated is not None and not head:
            grid = self.calibrated.grid(name)
            if self.bar is not None:
                self.bar.update(1)
            return grid
        exact = self.opts.method == "gguf" and not (head and self.opts.head_rescore)
        if exact and self.bits == 4 and all(self.t.type_of(p) in OWN for p in parts):
            own = [(self.t.type_of(p), self.t.own_bits(p)) for p in parts]  # at their own bits, for the kernel
            if all(a[0].shape[0] % 16 == 0 and a[0].shape[1] % OWN[kind].superblock == 0 for kind, a in own):
                self.carried.add(name)
                self.t.release()
                if self.bar is not None:
                    self.bar.update(1)
                return OwnBits.of(own)
        grids = [self.grid(p) for p in parts] if exact else []
        if exact and all(g is not None and not (self.bits == 8 and g.bits < 8 and g.mins is not None) for g in grids):
            grid = stack_rows(grids)
            grid = grid.with_bits(max(grid.bits, self.bits))
            self.carried.add(name)
        else:
            if exact:  # the file's blocks, but not carried: say so (a coarse rescored head is not a loss)
                self.requantized.update(parts)
            bits = self.head_bits if head else self.bits
            block = (self.opts.mlp_block_size or self.opts.block_size) if name.endswith(MLP_WEIGHTS) \
                else self.opts.block_size
            grid = self.rtn(parts, bits, block)
        self.t.release()
        if self.bar is not None:
            self.bar.update(1)
        return grid

    def rtn(self, parts: list[str], bits: int, block: int) -> Grid:
        if len(parts) == 1 and self.t.rows(parts[0]) > HEAD_ROWS and ".self_attn." not in parts[0]:
            n = self.t.rows(parts[0])  # row by row range: never the whole float matrix
            chunks = [rtn_grid(self.t.float(parts[0], slice(r, min(r + HEAD_ROWS, n))), bits, block)
                      for r in range(0, n, HEAD_ROWS)]
            return Grid(np.concatenate([c.q for c in chunks]), np.concatenate([c.scale for c in chunks]),
                        np.concatenate([c.zero for c in chunks]), block, bits)
        return rtn_grid(np.concatenate([self.t.float(p) for p in parts]), bits, block)


def embedding(tensors: GgufTensors, opts: ConvertOptions) -> Grid | OwnBits | None:
    """The embedding table as the graph gathers it: a Q4_K, Q6_K or Q8_0 table at its own bits in an int4
    package (ruvllm.GatherQ on the layout its tied head computes with), else the file's grid (or None)."""
    name = "model.embed_tokens.weight"
    kind = tensors.type_of(name)
    if opts.quant == "int4" and kind in GATHER_TYPES:  # the tables ruvllm.GatherQ reads
        parts = tensors.own_bits(name)
        if parts[0].shape[0] % 16 == 0 and parts[0].shape[1] % OWN[kind].superblock == 0:
            return OwnBits.of([(kind, parts)])
    return tensors.grid(name)


def convert_streamed(source, out: Path, opts: ConvertOptions, started: float) -> Path:
    """The package, streamed (raises safetensors_tensors.NotStreamable for a folder it cannot read so)."""
    from exporter.convert import staging_dir, write_package
    from exporter.sources.hf_model import decoder_spec

    on = opts.progress
    bar = stage("reading GGUF" if source.kind == "gguf" else "reading model", enabled=on)
    model, tok, gen_cfg = skeleton(source)
    spec = decoder_spec(model, opts.max_context)
    tensors = GgufTensors(source.path, model) if source.kind == "gguf" else SafetensorsTensors(source.path, model)
    family = family_for(model.config)
    bar.close()
    calibrated, gptq_calibration = None, None
    if opts.method in CALIBRATED:
        from exporter.quantizers.awq import calibration_ids
        from exporter.quantizers.layerwise import GPTQ_CALIBRATION, LayerwiseQuantizer

        calibrated = LayerwiseQuantizer(model, tensors, opts.method, calibration_ids(tok, opts.calibration),
                                        opts.block_size, BITS[opts.quant], opts.mlp_block_size, on)
        if "gptq" in opts.method:
            gptq_calibration = (Path(opts.calibration).name + "; " if opts.calibration else "") + GPTQ_CALIBRATION
    del model
    opts = head_plan(opts, spec.tie_word_embeddings)
    if opts.head_rescore > spec.vocab_size:
        raise RuvLLMError(f"--head-rescore {opts.head_rescore} is more than the vocabulary ({spec.vocab_size} tokens)")
    quantized = opts.quant in ("int8", "int4")
    weights = LazyWeights(tensors, family, calibrated)
    embed_grid = embedding(tensors, opts) if opts.method == "gguf" else None
    n_graphs = 2 if opts.lora else 1
    bar = stage("building graphs", total=4 * spec.num_layers + 1 if quantized else None, enabled=on)
    grids = StreamedProjections(tensors, opts, spec.tie_word_embeddings, bar, calibrated) if quantized else None
    tensors.release()
    if grids is not None and isinstance(embed_grid, Grid):
        grids.embedding = embed_grid
    tmp = staging_dir(out)
    store = WeightStore(tmp / DATA_FILE)
    try:
        projections = None
        graphs = {}
        for file_name, slots in ((GRAPH_FILE, None), (LORA_GRAPH_FILE, LoraSlots()))[:n_graphs]:
            graph_grids = ProjectionGrids(grids, kernel_layout=opts.target == "cpu") if grids else None
            if projections is not None and graph_grids is not None:
                graph_grids.layouts = projections.layouts  # the second graph reuses the first's tensors
            graphs[file_name] = build_decoder(
                spec, weights, slots, np.float16 if opts.quant == "fp16" else np.float32,
                np.float32 if opts.quant == "fp32" else np.float16, tied_gemm=True, kv_write=kv_write_op(opts.target),
                head_rescore=opts.head_rescore, embed_grid=embed_grid, grids=graph_grids, store=store,
                lora_scales=calibrated and calibrated.scales)
            projections = projections or graph_grids
        bar.close()
    except BaseException:
        store.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    carried = None
    if quantized and opts.method == "gguf":
        layouts = {name: layout for name, layout in projections.layouts.items() if name in grids.carried}
        carried = GraphGrids(layouts, embed_grid, sorted(grids.requantized))
        if on:
            print(f"export: the GGUF's blocks carried over exactly for {len(layouts)} of {len(projections.layouts)} "
                  f"weights, streamed ({time.time() - started:.1f} s)", file=sys.stderr)
        if carried.requantized:
            print(f"warning: {len(carried.requantized)} of the GGUF's matrices (e.g. {carried.requantized[0]}) are "
                  f"quantized with RTN in blocks of {opts.block_size} (no exact {opts.quant} layout here)", file=sys.stderr)
    return write_package(out, graphs, store, tok, source, spec, opts, gen_cfg, started, gptq_calibration, carried,
                         tmp=tmp, browser_graphs=False)
