"""Adapters' numbers for the LoRA graph: read from their safetensors files, stacked into its inputs.

The LoRA graph takes, per target, A [layers, slots, in, rank] and B [layers, slots, rank, out] (the
scale folded into B) and per-token mixing weights [tokens, slots]. Slot 0 stays zero (no adapter);
an adapter put in a slot fills its rank's columns and zeros the rest. Adapters read from disk are
kept in an LRU of `max_cpu_loras`, so switching back to a recent one does not read its file again.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from runtime import contract as C
from runtime.core.adapters import AdapterError, AdapterInfo, TensorRef, target_features

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_tensor(path, ref: TensorRef) -> np.ndarray:
    with open(path, "rb") as fh:
        fh.seek(ref.start)
        raw = fh.read(ref.end - ref.start)
    dtype = _DTYPES[ref.dtype]
    if len(raw) != int(np.prod(ref.shape)) * np.dtype(dtype).itemsize:
        raise AdapterError(f"{path}: corrupt safetensors file (a tensor is cut short)")
    arr = np.frombuffer(raw, dtype).reshape(ref.shape)
    if ref.dtype == "BF16":  # the upper half of an fp32
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def adapter_arrays(info: AdapterInfo, config: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """target -> (A [layers, in, rank], B [layers, rank, out] times the scale), for the adapter's targets."""
    if info.kind == "ruvllm":
        return {t: (read_tensor(info.weights, a), read_tensor(info.weights, b)) for t, (a, b) in info.stacked.items()}
    features, layers = target_features(config), config["num_layers"]
    out = {}
    for target in info.targets:
        fin, fout = features[target]
        out[target] = (np.zeros((layers, fin, info.rank), np.float32), np.zeros((layers, info.rank, fout), np.float32))
    for (layer, target), part in info.parts.items():
        a = read_tensor(info.weights, part.a)  # [r, in]
        b = read_tensor(info.weights, part.b)  # [out, r]
        r = a.shape[0]
        out[target][0][layer, :, :r] = a.T
        out[target][1][layer, :r, :] = b.T * part.scale
    return out


class AdapterTensors:
    """The LoRA graph's adapter inputs, allocated once and bound by reference."""

    def __init__(self, config: dict, max_loras: int, max_rank: int, max_cpu_loras: int | None = None) -> None:
        self.config, self.max_rank = config, max_rank
        self.slots = max_loras + 1
        layers = config["num_layers"]
        self.inputs: dict[str, np.ndarray] = {}
        for target, (fin, fout) in target_features(config).items():
            self.inputs[C.lora_a(target)] = np.zeros((layers, self.slots, fin, max_rank), np.float32)
            self.inputs[C.lora_b(target)] = np.zeros((layers, self.slots, max_rank, fout), np.float32)
        self._cache: OrderedDict[str, dict] = OrderedDict()
        self._cache_size = max(max_cpu_loras or max_loras, 1)
        self._eye = np.eye(self.slots, dtype=np.float32)

    def _arrays(self, info: AdapterInfo) -> dict:
        arrays = self._cache.get(info.id)
        if arrays is None:
            arrays = adapter_arrays(info, self.config)
            self._cache[info.id] = arrays
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(info.id)
        return arrays

    def put(self, slot: int, info: AdapterInfo) -> None:
        if not 0 < slot < self.slots:
            raise ValueError(f"adapter slot {slot} is outside 1..{self.slots - 1}")
        if info.rank > self.max_rank:
            raise AdapterError(f"adapter {info.name!r} has rank {info.rank}, more than the maximum {self.max_rank}")
        arrays = self._arrays(info)
        for target in C.LORA_TARGETS:
            a_all, b_all = self.inputs[C.lora_a(target)], self.inputs[C.lora_b(target)]
            a_all[:, slot] = 0.0
            b_all[:, slot] = 0.0
            if target in arrays:
                a, b = arrays[target]
                a_all[:, slot, :, :a.shape[2]] = a
                b_all[:, slot, :b.shape[1], :] = b

    def mixing(self, token_slots: list[int]) -> np.ndarray:
        """One-hot mixing weights [tokens, slots]: each token on its sequence's adapter (slot 0: none)."""
        return self._eye[np.asarray(token_slots, np.int64)]
