"""The exporter -> runtime contract: package format version and graph I/O names.

The runtime owns this module; the exporter imports it, so both sides agree by construction.
docs/design/package.md documents every name here with its shape and meaning; io_roles() goes into
the manifest so that a step runner in another language reads names from there.
"""

from runtime.formats.families import FAMILIES

FORMAT_NAME = "ruvllm-package"
FORMAT_VERSION = 2  # 2: the graph writes this step's K/V into its gathered context itself (TensorScatter),
# and needs block tables as wide as every row's first new position + query_len (runtime.core.step_batch)
READABLE_FORMAT_VERSIONS = (1, 2)  # a version-1 graph reads the same inputs; wider tables are harmless
MANIFEST = "manifest.json"

# Architectures whose decoder graph the exporter builds (Hugging Face `model_type` values): the families' rows.
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# --- graph inputs: the step's tokens, flattened over the batch ---
INPUT_IDS = "input_ids"  # int64 [num_tokens]
POSITION_IDS = "position_ids"  # int64 [num_tokens]
QUERY_INDEX = "query_index"  # int64 [batch, query_len]: flat token index of each padded query slot
FLAT_INDEX = "flat_index"  # int64 [num_tokens]: b * query_len + s of each flat token
BLOCK_TABLES = "block_tables"  # int64 [batch, max_blocks]
LOGITS_INDEX = "logits_index"  # int64 [num_logits]: flat tokens whose next-token logits are wanted

# --- graph inputs: in-graph logits processing, one row per logits_index entry ---
TEMPERATURE = "temperature"  # float [num_logits]
REPETITION_PENALTY = "repetition_penalty"  # float [num_logits]
PRESENCE_PENALTY = "presence_penalty"  # float [num_logits]
FREQUENCY_PENALTY = "frequency_penalty"  # float [num_logits]
SPARSE_IDS = "sparse_token_ids"  # int64 [num_logits, num_sparse]
SPARSE_SEEN = "sparse_token_seen"  # float [num_logits, num_sparse]: 1 if in prompt or output (repetition)
SPARSE_COUNTS = "sparse_token_counts"  # float [num_logits, num_sparse]: times generated so far
SPARSE_BIAS = "sparse_logit_bias"  # float [num_logits, num_sparse]
TOP_K = "top_k"  # int64 [1]: how many candidates to return

# --- graph input: structured output (graphs exported since format 2's logits_mask; the last input) ---
# Added to the processed logits before the temperature: 0 for an allowed token, -inf for one a grammar
# forbids. A step without constrained rows feeds [1, vocab] zeros (each backend keeps one bound).
LOGITS_MASK = "logits_mask"  # float [num_logits | 1, vocab]

# --- graph inputs: LoRA (only in the LoRA graph variant) ---
# The adapters of a step sit side by side as "adapter columns": adapter j's rank-r factors take columns
# j*r .. (j+1)*r - 1. A token's delta on a target is ((x A^T) * w) B, w its row of LORA_WEIGHTS: one
# adapter's weight repeated over its columns (one-hot per token for multi-LoRA, X-LoRA's mixture).
# A row holds one set of lora_columns weights for every target, or (graphs whose manifest's lora section
# says LORA_PER_MODULE) lora_modules(num_layers) sets, set lora_module(layer, target) for that target:
# layerwise X-LoRA weighs each layer's and target's experts apart.
LORA_WEIGHTS = "lora_weights"  # float [num_tokens, lora_sets * lora_columns], lora_sets 1 or lora_modules
LORA_PER_MODULE = "per_module_weights"  # manifest["lora"] key: the LoRA graph reads per-module weight sets

# The step's per-step graph inputs with their dtype and symbolic shape, in the graph's input order: the
# exporter declares them from this table, the manifest carries them, and both backends build each
# input (an empty one too) with this rank and dtype.
INT64, FLOAT32 = "int64", "float32"
STEP_INPUTS: tuple[tuple[str, str, tuple], ...] = (
    (INPUT_IDS, INT64, ("num_tokens",)),
    (POSITION_IDS, INT64, ("num_tokens",)),
    (QUERY_INDEX, INT64, ("batch", "query_len")),
    (FLAT_INDEX, INT64, ("num_tokens",)),
    (BLOCK_TABLES, INT64, ("batch", "max_blocks")),
    (LOGITS_INDEX, INT64, ("num_logits",)),
    (TEMPERATURE, FLOAT32, ("num_logits",)),
    (REPETITION_PENALTY, FLOAT32, ("num_logits",)),
    (PRESENCE_PENALTY, FLOAT32, ("num_logits",)),
    (FREQUENCY_PENALTY, FLOAT32, ("num_logits",)),
    (SPARSE_IDS, INT64, ("num_logits", "num_sparse")),
    (SPARSE_SEEN, FLOAT32, ("num_logits", "num_sparse")),
    (SPARSE_COUNTS, FLOAT32, ("num_logits", "num_sparse")),
    (SPARSE_BIAS, FLOAT32, ("num_logits", "num_sparse")),
    (TOP_K, INT64, (1,)),
)
STEP_INPUT_DTYPES = {name: dtype for name, dtype, _ in STEP_INPUTS}


def past_key(layer: int) -> str:
    return f"past.{layer}.key"  # float [kv_heads, num_blocks, block_size, head_dim]


def past_value(layer: int) -> str:
    return f"past.{layer}.value"


def past_key_scale(layer: int) -> str:
    # float16 [kv_heads, num_blocks, block_size, groups]: the scales of each int8 key row's groups of numbers.
    # Not an exported input: the native backend's rewrite adds it for --kv-dtype int8 (graph_rewrite.kv_quantized)
    return f"past.{layer}.key_scale"


def past_value_scale(layer: int) -> str:
    return f"past.{layer}.value_scale"


# float [num_blocks, num_layers, kv_heads, block_size, head_dim], one per kind: full-precision copies of the
# rows of the blocks sequences are still writing, beside an int8 pool (ruvllm.PagedAttention reads a query's
# own block from them), every layer's block by block. Not exported inputs either: added with the scales
# where the kernel runs (graph_rewrite.kv_quantized)
KV_TAIL_KEY, KV_TAIL_VALUE = "kv_tail.key", "kv_tail.value"
# int64 [batch]: each row's floor, the first position before a query's own block that it may read from the
# tails (the scheduler's kv_blocks.exact_floor); added with the tails
KV_EXACT_FROM = "kv_tail.exact_from"


KV_DTYPES = ("fp32", "int8", "int4")  # the native KV pool's element types (--kv-dtype)


def kv_scale_inputs(num_layers: int) -> set[str]:
    """The inputs an int8 pool adds to a graph: its scales, and (on ruvllm.PagedAttention) its tails and
    the rows' floors."""
    scales = {f(i) for i in range(num_layers) for f in (past_key_scale, past_value_scale)}
    return scales | {KV_TAIL_KEY, KV_TAIL_VALUE, KV_EXACT_FROM}


def lora_a(layer: int, target: str) -> str:
    return f"lora.{layer}.{target}.A"  # float [lora_columns, in_features]: the adapters' A, transposed


def lora_b(layer: int, target: str) -> str:
    return f"lora.{layer}.{target}.B"  # float [lora_columns, out_features], scale folded in


def lora_module(layer: int, target: str) -> int:
    """A target's weight set in a per-module LORA_WEIGHTS row."""
    return layer * len(LORA_TARGETS) + LORA_TARGETS.index(target)


def lora_modules(num_layers: int) -> int:
    return num_layers * len(LORA_TARGETS)


def adapter_inputs(num_layers: int) -> set[str]:
    """Every layer's and target's adapter input names (A and B)."""
    return {f(i, t) for i in range(num_layers) for t in LORA_TARGETS for f in (lora_a, lora_b)}


# --- graph outputs ---
PRESENT_KEY = "present.key"  # float [num_layers, num_tokens, kv_heads, head_dim]: this step's keys (rotated)
PRESENT_VALUE = "present.value"  # float [num_layers, num_tokens, kv_heads, head_dim]
LOGITS = "logits"  # float [num_logits, vocab]: raw logits, before any processing
TOPK_LOGPROBS = "topk_logprobs"  # float [num_logits, top_k]: log-softmax of the processed logits
TOPK_IDS = "topk_ids"  # int64 [num_logits, top_k]
# the LoRA graph's only: every token's last hidden state (after the final norm), what an X-LoRA
# classifier reads in its scaling pass
HIDDEN_STATES = "hidden_states"  # float [num_tokens, hidden_size]



GRAPH_OUTPUTS = (PRESENT_KEY, PRESENT_VALUE, LOGITS, TOPK_LOGPROBS, TOPK_IDS)  # a decoder graph's, in order
ONNX_DTYPES = {INT64: 7, FLOAT32: 1}  # onnx's TensorProto numbers, as a manifest's io section holds them


def declared_io(num_layers: int, kv_heads: int, head_dim: int, vocab: int) -> dict:
    """The manifest's io section of a decoder graph built to this contract (its inputs as the exporter's graph
    declares them): for a package without graphs (a GGUF the page opened for its WASM step) and for checks."""
    past = [{"name": name, "dtype": 1, "shape": [kv_heads, "num_blocks", "block_size", head_dim]}
            for i in range(num_layers) for name in (past_key(i), past_value(i))]
    return {"inputs": [{"name": name, "dtype": ONNX_DTYPES[dtype], "shape": list(shape)}
                       for name, dtype, shape in STEP_INPUTS] + past
            + [{"name": LOGITS_MASK, "dtype": 1, "shape": ["mask_rows", vocab]}],
            "outputs": list(GRAPH_OUTPUTS), "roles": io_roles(num_layers)}


def io_roles(num_layers: int) -> dict:
    """Which graph input or output plays each part of a step, for a step runner that must not spell the
    names itself (the page's, in JS): the exporter writes this into the manifest's io section."""
    return {"past_keys": [past_key(i) for i in range(num_layers)],
            "past_values": [past_value(i) for i in range(num_layers)],
            "present_key": PRESENT_KEY, "present_value": PRESENT_VALUE, "logits": LOGITS,
            "topk_ids": TOPK_IDS, "topk_logprobs": TOPK_LOGPROBS, "logits_mask": LOGITS_MASK,
            "step_inputs": [name for name, _, _ in STEP_INPUTS]}


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
