"""What a decoder graph is built from: the model's shape, and which projections the graph fuses."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime import contract as C
from runtime.core.adapters import target_features


@dataclass
class DecoderSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    rope_cos: np.ndarray  # [max_positions, head_dim // 2]
    rope_sin: np.ndarray
    sliding_window: int | None = None
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMS norm over each query and key head (weights [head_dim]) before RoPE
    activation: str = "silu"  # the gated MLP's: "silu", "gelu_tanh" (Gemma's GeGLU) or "gelu" (erf)
    embed_scale: float = 1.0  # Gemma: the embeddings times sqrt(hidden)
    source_architecture: str | None = None  # the checkpoint's, when it was read as another family (Phi-3)
    # Gemma 2: a window per layer (None: full attention), tanh soft-capping of the attention scores and of
    # the logits, the score scale from query_pre_attn_scalar, and norms after attention and the MLP too
    layer_windows: tuple[int | None, ...] | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_scale: float | None = None
    sandwich_norms: bool = False
    tie_word_embeddings: bool = False
    # Gemma 3: the sliding layers' own rotary tables (another base) and which layers read them
    rope_local_cos: np.ndarray | None = None
    rope_local_sin: np.ndarray | None = None
    layer_rope_local: tuple[bool, ...] | None = None


# the graph's projection weights (`layers.{i}.{name}`) and the Hugging Face projections stacked in each
FUSED_PROJECTIONS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                     "down_proj": ("mlp.down_proj",)}


@dataclass
class LoraSlots:
    """Shape of the LoRA inputs of the LoRA graph variant."""

    targets: tuple[str, ...] = C.LORA_TARGETS


def proj_features(spec: DecoderSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target: the runtime's own table, which adapters are checked against."""
    return target_features({"hidden_size": spec.hidden_size, "head_dim": spec.head_dim, "num_heads": spec.num_heads,
                            "num_kv_heads": spec.num_kv_heads, "intermediate_size": spec.intermediate_size})
