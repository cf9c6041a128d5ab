"""Converts peft LoRA adapters into the LoRA graph's stacked inputs (scale folded into B)."""

from __future__ import annotations

import re

import numpy as np

from runtime import contract as C

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.(?:\w+\.)?weight$")


def adapter_from_peft(state_dict: dict, alpha: float, rank: int, use_rslora: bool = False) -> dict:
    """{(layer, target): (A [in, r], B [r, out] * scale)} from a peft state dict of torch tensors."""
    scale = alpha / (rank ** 0.5 if use_rslora else rank)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in state_dict.items():
        m = _KEY.search(key)
        if not m:
            continue
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target not in C.LORA_TARGETS:
            raise ValueError(f"LoRA target {target} is not one of {', '.join(C.LORA_TARGETS)}")
        arr = tensor.detach().float().numpy() if hasattr(tensor, "detach") else np.asarray(tensor, np.float32)
        parts.setdefault((layer, target), {})[which] = arr.T  # A: [r, in] -> [in, r]; B: [out, r] -> [r, out]
    return {k: (v["A"], v["B"] * scale) for k, v in parts.items()}


def stack_adapters(adapters: list[dict], num_layers: int, features: dict[str, tuple[int, int]]) -> dict:
    """Graph inputs lora.<target>.A/B for these adapters, zero where an adapter lacks a layer/target."""
    rank = max([a.shape[1] for ad in adapters for a, _ in ad.values()] + [1])
    out = {}
    for target in C.LORA_TARGETS:
        fin, fout = features[target]
        a_all = np.zeros((num_layers, len(adapters), fin, rank), np.float32)
        b_all = np.zeros((num_layers, len(adapters), rank, fout), np.float32)
        for j, ad in enumerate(adapters):
            for (layer, tgt), (a, b) in ad.items():
                if tgt == target:
                    a_all[layer, j, :, : a.shape[1]] = a
                    b_all[layer, j, : b.shape[0], :] = b
        out[C.lora_a(target)] = a_all
        out[C.lora_b(target)] = b_all
    return out
