"""The decoder graph builder: one graph (DecoderBuilder's) for every family, whose differences are rows of
traits (runtime/formats/families.py) read off a transformers config by family_config.py."""

from __future__ import annotations

import numpy as np

from exporter.builders.decoder import BuildOptions, DecoderBuilder
from exporter.builders.family_config import family_for
from exporter.builders.spec import FUSED_PROJECTIONS, DecoderSpec, LoraSlots, proj_features

__all__ = ["FUSED_PROJECTIONS", "BuildOptions", "DecoderBuilder", "DecoderSpec", "LoraSlots",
           "build_decoder", "family_for", "proj_features"]


def build_decoder(spec: DecoderSpec, weights, lora: LoraSlots | None = None,
                  weight_dtype: type = np.float32, embed_dtype: type = np.float32, tied_gemm: bool = False,
                  kv_write: str = "TensorScatter", head_rescore: int = 0, lora_scales=None, embed_grid=None,
                  grids=None, store=None):
    """The onnx.ModelProto of spec's model (see DecoderBuilder for the options); `weights` maps Hugging
    Face names to float32 [out, in] arrays (a dict, or a mapping that reads them when asked)."""
    options = BuildOptions(lora, weight_dtype, embed_dtype, tied_gemm, kv_write, head_rescore, lora_scales, embed_grid,
                           grids, store)
    return DecoderBuilder(spec, weights, options).build()
