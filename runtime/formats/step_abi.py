"""The page's WASM step's ABI (wasm/step/step.c), once: every struct its callers fill (fields, C types, order),
the arrays of a matrix, and the constants both sides read (step_run's refusals, the KV dtypes, the
architectures, the LoRA targets' order, step.bin's format).

wasm32 is ILP32: an int, a float and a pointer are 4 bytes each, aligned to 4, so a struct's layout is its
fields in order. wasm/step/abi.h (the C structs and enums) and web/src/formats.js (sizes, offsets, the
constants) are generated from this module; wasm/step_module.py packs through `pack` and `offset`, the page
through formats.js; tests/runtime/test_formats.py compiles the step and checks its sizeof and offsetof
against `layout`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from runtime.contract import LORA_TARGETS
from runtime.formats.block_types import STEP_TYPES
from runtime.formats.families import ACTIVATIONS, STEP_FAMILIES  # noqa: F401 (the step's, re-exported)

WORD = 4  # wasm32: every field here is 4 bytes


@dataclass(frozen=True)
class Field:
    """One field: its C type (a scalar, a pointer, or another struct of STRUCTS by name), how many of it
    (a C array), and what it holds."""

    name: str
    ctype: str
    count: int = 1
    doc: str = ""

    @property
    def kind(self) -> str:
        """"i32", "f32", "ptr" or the name of a nested struct."""
        if self.ctype.endswith("*"):
            return "ptr"
        return {"int32_t": "i32", "float": "f32"}.get(self.ctype, self.ctype)


def _f(names: str, ctype: str, doc: str = "", count: int = 1) -> list[Field]:
    return [Field(n.strip(), ctype, count, doc) for n in names.split(",")]


# In C order: a struct refers only to those above it.
STRUCTS: dict[str, tuple[str, list[Field]]] = {
    "QMat": ("a matrix in the step's layout (exporter/step_weights.py): its block type, then its parts", [
        *_f("kind", "int32_t", "enum kind"),
        *_f("w", "const uint8_t*", "nibbles [N, K/2] (byte i of a block: weight i low, i + 16 high); Q8_0: int8 [N, K]"),
        *_f("hb", "const uint32_t*", "bit planes [N, K/32, planes]: bit j of plane p = weight j's bit 4 + p"),
        *_f("d", "const uint16_t*", "fp16 [N/4, K/32, 4]; K-quants: the super-block's d [N/4, K/256, 4]"),
        *_f("m", "const uint16_t*", "fp16 minimums [N/4, K/32, 4]; K-quants: dmin [N/4, K/256, 4]"),
        *_f("sc", "const uint8_t*", "K-quants' scale bytes [N/4, K/32, 4]; Q6_K: int8 [N/4, K/32, 2, 4]"),
        *_f("mb", "const uint8_t*", "Q4_K, Q5_K: the minimum bytes [N/4, K/32, 4]"),
    ]),
    "Layer": ("one decoder layer's weights, and how it attends", [
        *_f("attn_norm, ffn_norm", "const float*"),
        *_f("bias", "const float*", "q, k and v's (Qwen2), or null", count=3),
        *_f("mat", "QMat", "q k v o gate up down (MATRICES)", count=7),
        *_f("q_norm, k_norm", "const float*", "[head_dim]: each head's RMS norm before RoPE (Family.qk_norm), or null"),
        *_f("post_attn_norm, post_ffn_norm", "const float*",
            "[dim]: the block outputs' norms before the residual adds (Family.sandwich_norms), or null"),
        *_f("window", "int32_t", "a sliding layer's window (positions attended: p - window + 1 .. p); 0: all"),
        *_f("rope", "const double*", "[head_dim / 2]: this layer's RoPE inverse frequencies (its base), or null: the model's"),
    ]),
    "Model": ("the model: its widths and the arrays step_init and step_run read", [
        *_f("dim, hidden, layers, heads, kv_heads, head_dim, vocab, max_pos", "int32_t"),
        *_f("eps", "float"),
        *_f("rope_neox", "int32_t", "RoPE on the halves of each head (a Qwen2 GGUF's rows), else on adjacent pairs"),
        *_f("act", "int32_t", "the gated MLP's activation: ACT_SILU, ACT_GELU_TANH (families.ACTIVATIONS)"),
        *_f("embed_scale", "float", "the embeddings times this (Gemma: sqrt(dim)); 1 for most"),
        *_f("attn_scale", "float", "the attention scores times this (1 / sqrt(head_dim) for most)"),
        *_f("embd, head", "QMat", "the embedding and the head [vocab, dim] (the same arrays where they are tied)"),
        *_f("out_norm", "const float*"),
        *_f("rope", "const double*", "[head_dim / 2]: base ** (-2i / head_dim); a position's angles are p times them"),
        *_f("rope_factors", "const float*", "[head_dim / 2]: llama 3's divisor of each frequency, or null"),
        *_f("layer", "const Layer*", "[layers]"),
    ]),
    "Pool": ("the paged KV pool", [
        *_f("num_blocks, block_size", "int32_t"),
        *_f("k, v", "float*", "[layers, kv_heads, num_blocks * block_size, head_dim]; int8 rows, or int4 two a byte"),
        *_f("dtype", "int32_t", "KV_FP32, KV_INT8, KV_INT4"),
        *_f("ks, vs", "uint16_t*", "quantized: fp16 scales [layers, kv_heads, slots, kv_width]"),
        *_f("tail_blocks", "int32_t", "quantized: blocks up to a query's own that it reads exact (kv_tails.TAIL_BLOCKS)"),
        *_f("tail_of", "const int32_t*", "quantized: [num_blocks] the tail slot holding a block's exact rows, or -1"),
        *_f("tails", "float* const*", "quantized: per tail slot [2 kinds, layers, kv_heads, block_size, head_dim]"),
    ]),
    "Lora": ("a step's adapters: each target's output gains ((x A^T) * w) B, in fp32", [
        *_f("columns", "int32_t", "columns bound this step: the first `columns` rows of every A and B"),
        *_f("weights", "const float*", "[num_tokens, columns]: each token's weight per column"),
        *_f("a", "const float* const*", "[layers * 7] (LORA_TARGETS): A [columns, in], or null (not adapted)"),
        *_f("b", "const float* const*", "[layers * 7]: B [columns, out]"),
        *_f("u", "float*", "scratch [3, num_tokens, columns]"),
    ]),
    "Batch": ("a StepBatch as int32 arrays: row b's tokens are row_first[b] .. + row_count[b] - 1", [
        *_f("num_tokens, num_rows, max_blocks, num_logits", "int32_t"),
        *_f("ids, pos", "const int32_t*", "[num_tokens]"),
        *_f("slots", "const int32_t*", "[num_tokens]: token n's K/V go to pool slot slots[n]"),
        *_f("row_first, row_count", "const int32_t*", "[num_rows]"),
        *_f("tables", "const int32_t*", "[num_rows, max_blocks]"),
        *_f("logits_at", "const int32_t*", "[num_logits]: the tokens whose logits are wanted"),
        *_f("logits", "float*", "out: [num_logits, vocab]"),
        *_f("lora", "const Lora*", "the step's adapters, or null"),
        *_f("exact_from", "const int32_t*", "quantized pools: [num_rows] each row's floor (StepBatch.exact_from)"),
        *_f("keep", "const int32_t*", "quantized pools: [num_tokens] 1 where the token's rows go into its tail too"),
    ]),
    "Sampling": ("step_sample's rows: the graph's logits processing, then the top_k", [
        *_f("num_logits, num_sparse, top_k", "int32_t"),
        *_f("temperature, repetition, presence, frequency", "const float*", "[num_logits]"),
        *_f("sparse_ids", "const int32_t*", "[num_logits, num_sparse]"),
        *_f("sparse_seen, sparse_counts, sparse_bias", "const float*", "[num_logits, num_sparse]"),
        *_f("mask", "const uint8_t*", "[num_logits, ceil(vocab / 8)] bitmasks, or null: every token allowed"),
        *_f("logits", "const float*", "[num_logits, vocab]: step_run's, processed in place"),
        *_f("out_ids", "int32_t*", "[num_logits, top_k]"),
        *_f("out_values", "float*", "[num_logits, top_k]: processed logits, best first"),
        *_f("out_stats", "float*", "[num_logits, 2]: max, sum of e^(x - max)"),
    ]),
    "Learn": ("step_learn's text and factors (learn.h)", [
        *_f("num_tokens", "int32_t", "the text (ids [num_tokens]), positions 0 .."),
        *_f("scored_from", "int32_t", "the loss counts the predictions of tokens from here on"),
        *_f("unlikely", "int32_t", "the unlikelihood loss -log(1 - p) (an answer rated bad), else -log p"),
        *_f("exact", "int32_t", "fp32 products on the dequantized weights instead of the step's rounded ones"),
        *_f("rank", "int32_t"),
        *_f("scale", "float", "alpha / rank: delta = scale x (x A^T) B^T"),
        *_f("ids", "const int32_t*"),
        *_f("a", "const float* const*", "[layers * 7] (LORA_TARGETS): A [rank, in], or null (not adapted)"),
        *_f("b", "const float* const*", "[layers * 7]: B transposed [rank, out]"),
        *_f("ga, gb", "float* const*", "[layers * 7]: the gradients, written (same shapes), where `a` has a factor"),
        *_f("loss", "float*", "out: the mean loss"),
    ]),
}

PARTS = tuple(f.name for f in STRUCTS["QMat"][1][1:])  # a matrix's arrays in step.bin, in QMat's order
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # a Layer's QMats
TARGETS = LORA_TARGETS  # Lora's and Learn's tables: [layers * 7], target t of layer l at 7 * l + t
KV_DTYPES = ("fp32", "int8", "int4")  # Pool.dtype's values, in order (KV_FP32, KV_INT8, KV_INT4)
ARCHS = STEP_FAMILIES  # the step's architectures (GGUF names) and their traits (runtime/formats/families.py)
KINDS = STEP_TYPES  # QMat.kind's values: the block types the step reads (block_types.OWN's kinds)
REFUSALS = {1: "too many tokens", 2: "a position, slot or logits row out of range",
            3: "a row reads or keeps exact rows its quantized pool's tails do not hold",
            4: "a sliding-window model on a quantized KV pool (the step keeps its KV in fp32)"}  # step_run's statuses
REFUSAL_NAMES = {1: "STEP_TOO_MANY_TOKENS", 2: "STEP_OUT_OF_RANGE", 3: "STEP_TAILS_MISSING",
                 4: "STEP_WINDOWED_QUANTIZED"}  # their C names
LEARN_REFUSALS = {1: "a text of fewer than 2 tokens, more than the trainer's room or the model's positions, or scored from "
                    "past its end",
                  2: "a rank outside 1-16, or a token outside the vocabulary",
                  3: "a model whose forward the trainer does not follow (it runs llama's and Qwen2's: SiLU, no head or "
                     "sandwich norms, no sliding window)"}  # step_learn's statuses
LEARN_REFUSAL_NAMES = {1: "LEARN_BAD_LENGTH", 2: "LEARN_OUT_OF_RANGE", 3: "LEARN_FAMILY"}  # their C names
FORMAT = 3  # step.bin's layout (1: Q4_1 only, fp32 scales; 2: RoPE tables of every position's cos and sin)


def layout(name: str, structs: dict | None = None) -> tuple[int, dict[str, tuple[int, Field]]]:
    """(sizeof, {field: (offsetof, field)}) of struct `name` in wasm32, of `structs` (STRUCTS by default)."""
    structs = STRUCTS if structs is None else structs
    at, fields = 0, {}
    for f in structs[name][1]:
        fields[f.name] = (at, f)
        at += f.count * sizeof(f.ctype, structs)
    return at, fields


def sizeof(ctype: str, structs: dict | None = None) -> int:
    structs = STRUCTS if structs is None else structs
    return layout(ctype, structs)[0] if ctype in structs else WORD


def offset(name: str, field: str) -> int:
    """offsetof(name, field)."""
    return layout(name)[1][field][0]


def words(name: str, values: dict) -> list[tuple[str, int | float]]:
    """Struct `name` as ("i" | "I" | "f", value) words: every field must be given (a pointer or int as 0 where
    none), a C array as a sequence, a nested struct as a dict."""
    size, fields = layout(name)
    unknown = set(values) - set(fields)
    if unknown:
        raise KeyError(f"{name} has no field {', '.join(sorted(unknown))}")
    out: list[tuple[str, int | float]] = []
    for fname, (_, f) in fields.items():
        if fname not in values:
            raise KeyError(f"{name}.{fname} not given")
        items = values[fname] if f.count > 1 else [values[fname]]
        if len(items) != f.count:
            raise ValueError(f"{name}.{fname} takes {f.count} values, not {len(items)}")
        for v in items:
            if f.kind in STRUCTS:
                out += words(f.kind, v)
            else:
                out.append(({"i32": "i", "f32": "f", "ptr": "I"}[f.kind], v))
    assert len(out) * WORD == size
    return out


def pack(name: str, values: dict) -> bytes:
    """Struct `name`'s bytes (little-endian wasm32) from its fields' values (see `words`)."""
    w = words(name, values)
    return struct.pack("<" + "".join(c for c, _ in w), *(v for _, v in w))


def pack_array(name: str, items: list[dict]) -> bytes:
    """A C array of struct `name`."""
    return b"".join(pack(name, v) for v in items)
