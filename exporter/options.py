"""What an export makes: the options a user gives, resolved into a weight and head plan with the
measurements behind each default, and the package's file names."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from exporter.quantizers.quantize import METHODS
from runtime.errors import RuvLLMError

TARGETS = ("cpu", "wasm", "webgpu", "cuda")
BROWSER_TARGETS = ("wasm", "webgpu")
GRAPH_FILE, LORA_GRAPH_FILE, DATA_FILE = "model.onnx", "model_lora.onnx", "model.onnx.data"
WEBGPU_GRAPH_FILE = "model_webgpu.onnx"  # a --target wasm package's graph for pages that get a GPU
WEBGPU_LORA_GRAPH_FILE = "model_webgpu_lora.onnx"  # the same with LoRA inputs
WEBGPU_GRAPHS = (WEBGPU_GRAPH_FILE, WEBGPU_LORA_GRAPH_FILE)  # their weights stay at their bits (browser_format)
KV8_GRAPH_FILE = "model_kv8.onnx"  # the graph on an int8 KV pool, for the page's kvDtype "int8" (its weights shared)


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
    layerwise: bool | None = None  # AWQ/GPTQ one layer at a time on a streamed source (None: streamed.layerwise)


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
    and fails the quality test's bounds on its short one, so it is not the default (docs/PERFORMANCE.md).
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
    if method == "smoothquant" and opts.quant != "w8a8":
        raise RuvLLMError(f"--method smoothquant applies to --quant w8a8 (int8 activations), not {opts.quant}")
    if method not in ("rtn", "smoothquant") and opts.quant not in ("int8", "int4"):
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
