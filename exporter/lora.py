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
    """The LoRA graph's per-layer inputs for these adapters side by side in adapter columns (adapter j's
    rank taking columns j*rank ..), zero where an adapter lacks a layer or target."""
    rank = max([a.shape[1] for ad in adapters for a, _ in ad.values()] + [1])
    cols = rank * len(adapters)
    out = {}
    for layer in range(num_layers):
        for target in C.LORA_TARGETS:
            fin, fout = features[target]
            a_all = np.zeros((cols, fin), np.float32)
            b_all = np.zeros((cols, fout), np.float32)
            for j, ad in enumerate(adapters):
                if (layer, target) in ad:
                    a, b = ad[layer, target]
                    a_all[j * rank: j * rank + a.shape[1]] = a.T
                    b_all[j * rank: j * rank + b.shape[0]] = b
            out[C.lora_a(layer, target)] = a_all
            out[C.lora_b(layer, target)] = b_all
    return out


def adapter_weights(token_adapters: list[int | None], num_adapters: int, rank: int) -> np.ndarray:
    """lora_weights for tokens on these adapters (None: the base model), with stack_adapters' columns."""
    w = np.zeros((len(token_adapters), num_adapters * rank), np.float32)
    for n, j in enumerate(token_adapters):
        if j is not None:
            w[n, j * rank:(j + 1) * rank] = 1.0
    return w
