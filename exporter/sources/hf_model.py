"""Reads a loaded `transformers` causal LM into a DecoderSpec and a dict of float32 weights."""

from __future__ import annotations

import sys

import numpy as np

from exporter.builders import DecoderSpec, family_for
from exporter.builders.family_config import float_weights as family_weights
from exporter.builders.family_config import spec_options
from exporter.sources import phi3

DEFAULT_MAX_CONTEXT = 32768


def check_architecture(config) -> str:
    """The config's architecture, if a builder family supports it (else UnsupportedModelError)."""
    if config.model_type == phi3.ARCHITECTURE:  # rebuilt as Mistral when loaded (as_supported)
        phi3.check_config(config)
        return config.model_type
    family_for(config)
    return config.model_type


def as_supported(model):
    """The loaded model as a family the builders have (Phi-3 becomes the Mistral it computes)."""
    return phi3.as_mistral(model) if model.config.model_type == phi3.ARCHITECTURE else model


def rope_tables(model, max_positions: int, layer_type: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin exactly as transformers computes them (any rope scaling it knows), first half only; of one
    layer type's parameters where the model has several (Gemma 3's sliding and full layers)."""
    import torch

    rotary = model.model.rotary_emb
    pos = torch.arange(max_positions, dtype=torch.long)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(dummy, pos) if layer_type is None else rotary(dummy, pos, layer_type)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


def decoder_spec(model, max_context: int | None = None) -> DecoderSpec:
    cfg = model.config
    family = family_for(cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    max_pos = int(getattr(cfg, "max_position_embeddings", 2048))
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    original = rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    if rope.get("rope_type") in ("longrope", "su") and original and not max_context:
        # longrope switches to its long factors for sequences past the original context: one set of
        # tables cannot do both, and short prompts are the common case
        max_context = int(original)
        print(f"export: longrope: the context is limited to its original {original} tokens (--max-context for "
              "more, computed with the long factors throughout)", file=sys.stderr)
    max_pos = min(max_pos, max_context or DEFAULT_MAX_CONTEXT)
    per_type = rope_per_layer_type(cfg)
    cos, sin = rope_tables(model, max_pos, "full_attention" if per_type else None)
    local = {}
    if per_type and "sliding_attention" in cfg.layer_types:
        lcos, lsin = rope_tables(model, max_pos, "sliding_attention")
        local = {"rope_local_cos": lcos, "rope_local_sin": lsin,
                 "layer_rope_local": tuple(t == "sliding_attention" for t in cfg.layer_types)}
    return DecoderSpec(
        architecture=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=float(cfg.rms_norm_eps),
        max_positions=max_pos,
        rope_cos=cos,
        rope_sin=sin,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        source_architecture=getattr(cfg, "source_model_type", None),
        **local,
        **spec_options(family, cfg),
    )


def rope_per_layer_type(cfg) -> bool:
    """Whether the config gives each layer type its own RoPE parameters (Gemma 3: a local base for the
    sliding layers, a global one for the full layers), as transformers' rope_parameters does."""
    params, types = getattr(cfg, "rope_parameters", None), getattr(cfg, "layer_types", None)
    return bool(types) and isinstance(params, dict) and all(isinstance(params.get(t), dict) for t in set(types))


def float_weights(model) -> dict[str, np.ndarray]:
    """Every weight as float32, as the family's graph reads it (family_config.float_weights)."""
    weights = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    return family_weights(family_for(model.config), weights)
