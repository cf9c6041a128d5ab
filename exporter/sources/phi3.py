"""Phi-3 and Phi-3.5, read as the Mistral graph they compute.

Phi-3 is Mistral's computation (RMS norms, SwiGLU, RoPE, an optional sliding window) with q, k, v
stored as one `qkv_proj` and gate, up as one `gate_up_proj`. The loaded model is rebuilt as a
`MistralForCausalLM` with those matrices split, so everything after loading (AWQ, GPTQ, the
builder, the adapters' targets) sees the seven projections every other family has. The package
says `"architecture": "mistral"`, and `provenance.source_architecture` says phi3.
"""

from __future__ import annotations

from runtime.errors import UnsupportedModelError

ARCHITECTURE = "phi3"
TARGET = "mistral"


def check_config(config) -> None:
    """Refuse what the rebuilt model would compute differently (Phi-4-mini's partial rotary)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    if float(partial) != 1.0:
        raise UnsupportedModelError(f"phi3 with partial_rotary_factor={partial} (Phi-4-mini) is not supported yet")
    if rope.get("rope_type", "default") not in ("default", "longrope", "su"):
        raise UnsupportedModelError(f"phi3 with rope_type {rope.get('rope_type')!r} is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"phi3 with activation {config.hidden_act!r} is not supported (only silu)")


def as_mistral(model):
    """A MistralForCausalLM computing what the loaded Phi3ForCausalLM computes, sharing its tensors."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    c = model.config
    check_config(c)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    extra = {k: getattr(c, k) for k in ("original_max_position_embeddings",) if getattr(c, k, None) is not None}
    cfg = MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim, hidden_act=c.hidden_act, max_position_embeddings=c.max_position_embeddings,
                        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters),
                        sliding_window=getattr(c, "sliding_window", None), tie_word_embeddings=c.tie_word_embeddings,
                        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, **extra)
    cfg.source_model_type = ARCHITECTURE
    q, kv, inter = heads * head_dim, kv_heads * head_dim, c.intermediate_size
    weights = {}
    for name, t in model.state_dict().items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[:-len("qkv_proj.weight")]
            weights[base + "q_proj.weight"], weights[base + "k_proj.weight"], weights[base + "v_proj.weight"] = \
                t[:q], t[q:q + kv], t[q + kv:]
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name[:-len("gate_up_proj.weight")]
            weights[base + "gate_proj.weight"], weights[base + "up_proj.weight"] = t[:inter], t[inter:]
        else:
            weights[name] = t
    with torch.device("meta"):
        rebuilt = MistralForCausalLM(cfg)
    rebuilt.load_state_dict({k: v.contiguous() for k, v in weights.items()}, strict=False, assign=True)
    missing = [n for n, p in rebuilt.named_parameters() if p.is_meta]
    if missing:
        raise UnsupportedModelError(f"phi3: no weights for {missing[:3]} in the checkpoint")
    rebuilt.model.rotary_emb = type(rebuilt.model.rotary_emb)(config=cfg)  # its buffers, off the meta device
    rebuilt.generation_config = model.generation_config
    return rebuilt.eval()
