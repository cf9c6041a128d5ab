"""The Llama family: Llama (and Llama 2/3 shapes), Mistral (sliding-window attention), Qwen2 (q/k/v bias),
Qwen3 (an RMS norm over each query and key head before RoPE), Gemma (GeGLU, RMS norms that scale by
1 + w, embeddings times sqrt(hidden)).

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
        act = "gelu" if config.hidden_act == "gelu" else "gelu_tanh"
        return {**super().spec_options(config), "activation": act, "embed_scale": float(config.hidden_size) ** 0.5}

    @classmethod
    def float_weights(cls, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """GemmaRMSNorm multiplies by (1 + w): the graph's norms multiply by their weight as it is."""
        return {k: (v + 1.0 if k.endswith("norm.weight") else v) for k, v in weights.items()}
