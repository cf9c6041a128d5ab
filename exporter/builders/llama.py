"""The Llama family: Llama (and Llama 2/3 shapes), Mistral (sliding-window attention), Qwen2 (q/k/v bias),
Qwen3 (an RMS norm over each query and key head before RoPE).

They share one graph (DecoderBuilder's); what differs is read from their configs here.
"""

from __future__ import annotations

from exporter.builders.decoder import DecoderBuilder
from runtime.errors import UnsupportedModelError


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
