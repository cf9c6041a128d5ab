"""What a family's row (runtime/formats/families.py) makes of a transformers config: its refusals, the
DecoderSpec fields beyond the shared ones, and its weights as the graph reads them. One graph
(DecoderBuilder's) serves every family; nothing here branches on a family's name.
"""

from __future__ import annotations

import numpy as np

from runtime.errors import UnsupportedModelError
from runtime.formats.families import FAMILIES, HF_ACTIVATIONS, Family, sliding


def family_for(config) -> Family:
    """The row of a transformers config's model_type, after its checks; UnsupportedModelError naming the
    supported list for any other architecture (Phi-3 is rebuilt as the Mistral it computes: sources/phi3.py)."""
    arch = getattr(config, "model_type", None)
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: {', '.join(FAMILIES)}, phi3")
    family = FAMILIES[arch]
    check_config(family, config)
    return family


def activation_name(family: Family, config) -> str:
    """transformers' name of the MLP's activation, read from the fields this family's code reads."""
    for name in family.activation_fields:
        value = getattr(config, name, None)
        if value:
            return value
    return "silu" if family.activation == "silu" else "gelu_pytorch_tanh"


def check_config(family: Family, config) -> None:
    """Refuse, with UnsupportedModelError, a config the family's graph would compute wrongly."""
    arch = config.model_type
    for flag in family.refuses:
        if getattr(config, flag, False):
            raise UnsupportedModelError(f"{arch} with {flag}=True is not supported yet")
    act = activation_name(family, config)
    if HF_ACTIVATIONS.get(act) not in family.activations:
        names = [n for n, kind in HF_ACTIVATIONS.items() if kind in family.activations]
        raise UnsupportedModelError(f"{arch} with activation {act!r} is not supported (only {', '.join(names)})")


def spec_options(family: Family, config) -> dict:
    """DecoderSpec fields the family reads from its config beyond the shared ones."""
    bias = family.qkv_bias
    out = {"attention_bias": bool(getattr(config, "attention_bias", False)) if bias is None else bias,
           "qk_norm": family.qk_norm, "activation": HF_ACTIVATIONS[activation_name(family, config)],
           "sandwich_norms": family.sandwich_norms}
    if family.embed_scale:
        out["embed_scale"] = float(config.hidden_size) ** 0.5
    window = getattr(config, "sliding_window", None)
    if family.every_layer_window:
        out["sliding_window"] = int(window) if window else None
    elif family.swa_pattern:
        n = config.num_hidden_layers
        types = getattr(config, "layer_types", None) or [
            "sliding_attention" if sliding(family, i) else "full_attention" for i in range(n)]
        out["layer_windows"] = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    if family.soft_caps:
        scalar = getattr(config, "query_pre_attn_scalar", None)
        out.update(attn_softcap=getattr(config, "attn_logit_softcapping", None),
                   final_softcap=getattr(config, "final_logit_softcapping", None),
                   attn_scale=float(scalar) ** -0.5 if scalar else None)
    return out


def float_weights(family: Family, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's weights as the graph reads them: a family whose norms scale by offset + w has it folded in."""
    if not family.norm_offset:
        return weights
    return {k: (v + family.norm_offset if k.endswith("norm.weight") else v) for k, v in weights.items()}
