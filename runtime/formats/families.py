"""A model family's traits, once: what the page's WASM step (and its weights' writer, exporter/step_weights.py)
reads of a GGUF's architecture instead of branching on its name. A new family there is mostly a row here.

Standard library; generated into web/src/formats.js and wasm/step/abi.h's enums with the other formats.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's: SwiGLU, GeGLU with the tanh GELU (Model.act)


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture computes, as the step reads it."""

    rope_neox: bool  # RoPE on a head's halves (the file's q/k rows as the model has them), else adjacent pairs
    activation: str = "silu"  # one of ACTIVATIONS
    qkv_bias: bool = False  # q, k and v carry biases
    qk_norm: bool = False  # an RMS norm over each query and key head before RoPE (weights [head_dim])
    sandwich_norms: bool = False  # attention's and the MLP's outputs normed before their residual adds
    embed_scale: bool = False  # the embeddings times sqrt(dim)
    # sliding-window attention: every swa_pattern-th layer (the last of each group) attends to all, the others
    # to the GGUF's `{arch}.attention.sliding_window` positions; 0: every layer attends to all
    swa_pattern: int = 0
    local_rope_base: float | None = None  # the sliding layers' RoPE base (the file's is the global layers')
    model_type: str = ""  # transformers' name of it (a package's "architecture"; adapters name it)


# llama.cpp's rules where the GGUF names no value (Gemma 3: five sliding layers to a global one, local base 10,000);
# norms scale by their weights as stored (llama.cpp's converter folds Gemma's 1 + w into the file)
FAMILIES: dict[str, Family] = {
    "llama": Family(rope_neox=False, model_type="llama"),
    "qwen2": Family(rope_neox=True, qkv_bias=True, model_type="qwen2"),
    "gemma3": Family(rope_neox=True, activation="gelu_tanh", qk_norm=True, sandwich_norms=True, embed_scale=True,
                     swa_pattern=6, local_rope_base=10000.0, model_type="gemma3_text"),
}


def sliding(family: Family, layer: int) -> bool:
    """Whether layer `layer` attends through the sliding window."""
    return family.swa_pattern > 0 and (layer + 1) % family.swa_pattern != 0
