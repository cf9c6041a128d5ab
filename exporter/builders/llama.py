"""The Llama family: Llama (and Llama 2/3 shapes), Mistral (sliding-window attention), Qwen2 (q/k/v bias),
Qwen3 (an RMS norm over each query and key head before RoPE), Gemma (GeGLU, RMS norms that scale by
1 + w, embeddings times sqrt(hidden)), Gemma 2 (Gemma's, plus sliding and full layers in turn,
soft-capped scores and logits, norms after attention and the MLP too), Gemma 3 (Gemma 2's without the
soft caps, with Qwen3's head norms (1 + w) and a RoPE base of its own for the sliding layers).

They share one graph (DecoderBuilder's); what differs is read from their configs here.
"""

from __future__ import annotations

import numpy as np

from exporter.builders.decoder import DecoderBuilder
from runtime.errors import UnsupportedModelError

# transformers' GELU names: the exact (erf) one, and those that compute the tanh approximation
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")


class LlamaBuilder(DecoderBuilder):
    architectures = ("llama",)


class MistralBuilder(DecoderBuilder):
    architectures = ("mistral",)

    @classmethod
    def spec_options(cls, config) -> dict:
        window = getattr(config, "sliding_window", None)
        return {**super().spec_options(config), "sliding_window": int(window) if window else None}


class Qwen2Builder(DecoderBuilder):
    architectures = ("qwen2",)

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError(f"{config.model_type} with use_sliding_window=True is not supported yet")

    @classmethod
    def spec_options(cls, config) -> dict:
        return {**super().spec_options(config), "attention_bias": True}  # Qwen2's q/k/v always carry biases


class Qwen3Builder(Qwen2Builder):
    architectures = ("qwen3",)

    @classmethod
    def spec_options(cls, config) -> dict:
        return {**super().spec_options(config), "attention_bias": bool(getattr(config, "attention_bias", False)),
                "qk_norm": True}


class GemmaBuilder(DecoderBuilder):
    architectures = ("gemma",)
    activations = ("gelu", *GELU_TANH)

    @classmethod
    def spec_options(cls, config) -> dict:
        act = "gelu" if cls.activation_name(config) == "gelu" else "gelu_tanh"
        return {**super().spec_options(config), "activation": act, "embed_scale": float(config.hidden_size) ** 0.5}

    @classmethod
    def float_weights(cls, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """GemmaRMSNorm multiplies by (1 + w): the graph's norms multiply by their weight as it is."""
        return {k: (v + 1.0 if k.endswith("norm.weight") else v) for k, v in weights.items()}


class Gemma2Builder(GemmaBuilder):
    architectures = ("gemma2",)

    @classmethod
    def activation_name(cls, config) -> str:
        return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"

    @classmethod
    def spec_options(cls, config) -> dict:
        types = getattr(config, "layer_types", None) or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
        window = getattr(config, "sliding_window", None)
        windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
        scalar = getattr(config, "query_pre_attn_scalar", None)
        return {**super().spec_options(config), "layer_windows": windows, "sandwich_norms": True,
                "attn_softcap": getattr(config, "attn_logit_softcapping", None),
                "final_softcap": getattr(config, "final_logit_softcapping", None),
                "attn_scale": float(scalar) ** -0.5 if scalar else None}


class Gemma3Builder(Gemma2Builder):
    """Gemma 3's text model: its layer_types (five sliding layers to a full one) and rope_parameters per layer
    type (hf_model.decoder_spec reads both); q_norm and k_norm scale by 1 + w, as its other norms do."""

    architectures = ("gemma3_text",)

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("gemma3_text with use_bidirectional_attention=True (an encoder) is not supported")

    @classmethod
    def spec_options(cls, config) -> dict:
        return {**super().spec_options(config), "qk_norm": True}
