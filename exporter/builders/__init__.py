"""Decoder graph builders, one class per architecture family over DecoderBuilder: adding a family is
adding a class here (and its name to runtime.contract.SUPPORTED_ARCHITECTURES, which the runtime reads)."""

from __future__ import annotations

import numpy as np

from exporter.builders.decoder import BuildOptions, DecoderBuilder
from exporter.builders.llama import (
    Gemma2Builder,
    Gemma3Builder,
    GemmaBuilder,
    LlamaBuilder,
    MistralBuilder,
    Qwen2Builder,
    Qwen3Builder,
)
from exporter.builders.spec import FUSED_PROJECTIONS, DecoderSpec, LoraSlots, proj_features
from runtime.contract import SUPPORTED_ARCHITECTURES
from runtime.errors import UnsupportedModelError

BUILDERS: dict[str, type[DecoderBuilder]] = {arch: cls for cls in (LlamaBuilder, MistralBuilder, Qwen2Builder,
                                                         Qwen3Builder, GemmaBuilder, Gemma2Builder,
                                                         Gemma3Builder)
                                             for arch in cls.architectures}
assert tuple(BUILDERS) == SUPPORTED_ARCHITECTURES, "runtime.contract.SUPPORTED_ARCHITECTURES lists the builders"

__all__ = ["BUILDERS", "FUSED_PROJECTIONS", "BuildOptions", "DecoderBuilder", "DecoderSpec", "LoraSlots",
           "build_decoder", "builder_for", "proj_features"]


def builder_for(config) -> type[DecoderBuilder]:
    """The builder class of a transformers config, after its family's checks; UnsupportedModelError
    naming the supported list for any other architecture."""
    arch = getattr(config, "model_type", None)
    if arch not in BUILDERS:
        raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: {', '.join(BUILDERS)}, phi3")
    cls = BUILDERS[arch]
    cls.check_config(config)
    return cls


def build_decoder(spec: DecoderSpec, weights, lora: LoraSlots | None = None,
                  weight_dtype: type = np.float32, embed_dtype: type = np.float32, tied_gemm: bool = False,
                  kv_write: str = "TensorScatter", head_rescore: int = 0, lora_scales=None, embed_grid=None,
                  grids=None, store=None):
    """The onnx.ModelProto of spec's family (see DecoderBuilder for the options); `weights` maps Hugging
    Face names to float32 [out, in] arrays (a dict, or a mapping that reads them when asked)."""
    options = BuildOptions(lora, weight_dtype, embed_dtype, tied_gemm, kv_write, head_rescore, lora_scales, embed_grid,
                           grids, store)
    return BUILDERS[spec.architecture](spec, weights, options).build()
