"""What a decoder graph is built from: the model's shape, and which projections the graph fuses."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime import contract as C


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
    tie_word_embeddings: bool = False


# the graph's projection weights (`layers.{i}.{name}`) and the Hugging Face projections stacked in each
FUSED_PROJECTIONS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                     "down_proj": ("mlp.down_proj",)}


@dataclass
class LoraSlots:
    """Shape of the LoRA inputs of the LoRA graph variant."""

    targets: tuple[str, ...] = C.LORA_TARGETS


def proj_features(spec: DecoderSpec) -> dict[str, tuple[int, int]]:
    h, d = spec.hidden_size, spec.head_dim
    return {
        "q_proj": (h, spec.num_heads * d), "k_proj": (h, spec.num_kv_heads * d),
        "v_proj": (h, spec.num_kv_heads * d), "o_proj": (spec.num_heads * d, h),
        "gate_proj": (h, spec.intermediate_size), "up_proj": (h, spec.intermediate_size),
        "down_proj": (spec.intermediate_size, h),
    }
