"""A model family's traits, once: what every engine reads of a model's architecture instead of branching on its
name. The exporter's graph builder reads them off a transformers config (exporter/builders/family_config.py),
the page's WASM step and its weights' writer (exporter/step_weights.py, runtime/formats/step_plan.py) off a GGUF,
and the per-user trainer off the manifest's compute traits written from them. A new family is mostly a row here.

Standard library; the step's rows are generated into web/src/formats.js with the other formats.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")  # the step's gated MLPs: SwiGLU, GeGLU with the tanh GELU (Model.act)
# transformers' activation names and what the graph computes for each (the exact, erf GELU only in the graph)
HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", **dict.fromkeys(
    ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh"), "gelu_tanh")}


@dataclass(frozen=True)
class Family:
    """How one architecture computes."""

    model_type: str  # transformers' name (a package's "architecture"; adapters name it)
    gguf: str | None = None  # llama.cpp's name (a GGUF's general.architecture), where it has its own
    step: bool = False  # the page's WASM step runs its GGUFs
    rope_neox: bool = True  # a GGUF's q/k rows as the model has them (RoPE on halves), else interleaved pairs
    activation: str = "silu"  # the gated MLP's where the file names none (a GGUF): one of ACTIVATIONS
    activations: tuple[str, ...] = ("silu",)  # what it computes of HF_ACTIVATIONS' values
    activation_fields: tuple[str, ...] = ("hidden_act",)  # the config fields naming it, first set wins
    qkv_bias: bool | None = None  # q, k and v carry biases; None: as a config's attention_bias (a GGUF's tensors) say
    qk_norm: bool = False  # an RMS norm over each query and key head before RoPE (weights [head_dim])
    norm_offset: float = 0.0  # its checkpoints' norms scale by offset + w (Gemma: 1; llama.cpp's files fold it in)
    sandwich_norms: bool = False  # attention's and the MLP's outputs normed before their residual adds
    embed_scale: bool = False  # the embeddings times sqrt(dim)
    # sliding-window attention: every swa_pattern-th layer (the last of each group) attends to all, the others
    # to the window (a config's layer_types, where it has them, say the same); 0: none, unless every_layer_window
    swa_pattern: int = 0
    every_layer_window: bool = False  # Mistral: every layer attends to the config's sliding_window, if it sets one
    local_rope_base: float | None = None  # the sliding layers' RoPE base where a GGUF gives only the global one
    soft_caps: bool = False  # tanh soft caps of the scores and logits, and the score scale, as the config gives
    refuses: tuple[str, ...] = ("mlp_bias",)  # config flags it does not compute when true


_GEMMA = dict(activation="gelu_tanh", activations=("gelu", "gelu_tanh"), norm_offset=1.0, embed_scale=True)
_GEMMA2 = dict(_GEMMA, activation_fields=("hidden_activation", "hidden_act"),
               sandwich_norms=True, swa_pattern=2, soft_caps=True)

# transformers' model types, in the order the exporter lists them (runtime.contract.SUPPORTED_ARCHITECTURES);
# llama.cpp's rules where a GGUF names no value (Gemma 3: five sliding layers to a global one, local base 10,000)
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", gguf="llama", step=True, rope_neox=False),
    Family("mistral", rope_neox=False, every_layer_window=True),
    Family("qwen2", gguf="qwen2", step=True, qkv_bias=True, refuses=("mlp_bias", "use_sliding_window")),
    Family("qwen3", gguf="qwen3", qk_norm=True, refuses=("mlp_bias", "use_sliding_window")),
    Family("gemma", gguf="gemma", **_GEMMA),
    Family("gemma2", gguf="gemma2", **_GEMMA2),
    Family("gemma3_text", gguf="gemma3", step=True, qk_norm=True, local_rope_base=10000.0,
           refuses=("mlp_bias", "use_bidirectional_attention"), **dict(_GEMMA2, swa_pattern=6)),
)}
STEP_FAMILIES: dict[str, Family] = {f.gguf: f for f in FAMILIES.values() if f.step}  # by GGUF architecture


def sliding(family: Family, layer: int) -> bool:
    """Whether layer `layer` attends through the sliding window (by the family's pattern)."""
    if family.every_layer_window:
        return True
    return family.swa_pattern > 0 and (layer + 1) % family.swa_pattern != 0
