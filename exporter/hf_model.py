"""Reads a loaded `transformers` causal LM into a DecoderSpec and a dict of float32 weights."""

from __future__ import annotations

import numpy as np

from exporter.decoder_graph import DecoderSpec
from runtime.contract import SUPPORTED_ARCHITECTURES
from runtime.errors import UnsupportedModelError

DEFAULT_MAX_CONTEXT = 32768


def check_architecture(config) -> str:
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError(f"{arch} with mlp_bias=True is not supported yet")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported (only silu)")
    return arch


def rope_tables(model, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin exactly as transformers computes them (any rope scaling it knows), first half only."""
    import torch

    rotary = model.model.rotary_emb
    pos = torch.arange(max_positions, dtype=torch.long)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(dummy, pos)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


def decoder_spec(model, max_context: int | None = None) -> DecoderSpec:
    cfg = model.config
    arch = check_architecture(cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    max_pos = int(getattr(cfg, "max_position_embeddings", 2048))
    max_pos = min(max_pos, max_context or DEFAULT_MAX_CONTEXT)
    cos, sin = rope_tables(model, max_pos)
    window = getattr(cfg, "sliding_window", None) if arch == "mistral" else None
    if arch == "qwen2" and getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError("qwen2 with use_sliding_window=True is not supported yet")
    return DecoderSpec(
        architecture=arch,
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
        sliding_window=int(window) if window else None,
        attention_bias=bool(getattr(cfg, "attention_bias", False)) or arch == "qwen2",
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


def float_weights(model) -> dict[str, np.ndarray]:
    return {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
