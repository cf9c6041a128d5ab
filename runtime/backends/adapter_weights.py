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
from runtime.core.xlora import mix_sets

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_tensor(path, ref: TensorRef, fh=None) -> np.ndarray:
    """One tensor of a safetensors file, as fp32; fh: the file, already open (an adapter reads hundreds)."""
    if fh is None:
        with open(path, "rb") as f:
            return read_tensor(path, ref, f)
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
    with open(info.weights, "rb") as fh:
        return _adapter_arrays(info, config, fh)


def _adapter_arrays(info: AdapterInfo, config: dict, fh) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    if info.kind == "ruvllm":
        return {t: (read_tensor(info.weights, a, fh), read_tensor(info.weights, b, fh))
                for t, (a, b) in info.stacked.items()}
    features, layers = target_features(config), config["num_layers"]
    out = {}
    for target in info.targets:
        fin, fout = features[target]
        out[target] = (np.zeros((layers, fin, info.rank), np.float32), np.zeros((layers, info.rank, fout), np.float32))
    for (layer, target), part in info.parts.items():
        a = read_tensor(info.weights, part.a, fh)  # [r, in]
        b = read_tensor(info.weights, part.b, fh)  # [out, r]
        r = a.shape[0]
        out[target][0][layer, :, :r] = a.T
        out[target][1][layer, :r, :] = b.T * part.scale
    return out


class AdapterTensors:
    """The LoRA graph's adapter inputs, allocated once: per target, A^T and B of every slot side by side,
    [layers, columns, in] and [layers, columns, out]. Each slot takes `rank` columns, the largest rank of
    the adapters loaded so far (slot s: columns (s-1)*rank .. s*rank - 1; slot 0, the base model, none),
    and a step binds, as contiguous views, only the columns up to its highest slot: one rank-8 adapter
    costs 8 columns of work, not max_loras * max_lora_rank."""

    def __init__(self, config: dict, max_loras: int, max_rank: int, max_cpu_loras: int | None = None,
                 dtype=np.float32) -> None:
        self.config, self.max_rank, self.max_loras = config, max_rank, max_loras
        layers, cols = config["num_layers"], max_loras * max_rank
        self.stacked: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # in the graph's input dtype (fp16: see native)
        for target, (fin, fout) in target_features(config).items():
            self.stacked[target] = (np.zeros((layers, cols, fin), dtype), np.zeros((layers, cols, fout), dtype))
        self.rank = 0  # columns per slot
        self.holders: dict[int, AdapterInfo] = {}
        self.adapted_in: dict[int, frozenset] = {}  # per slot, the (layer, target) pairs its adapter adapts
        self._idle: tuple = (None, frozenset())  # (columns, writes) -> its answer
        self._writes = 0
        self._cache: OrderedDict[str, dict] = OrderedDict()
        self._cache_size = max(max_cpu_loras or max_loras, 1)

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
        if not 0 < slot <= self.max_loras:
            raise ValueError(f"adapter slot {slot} is outside 1..{self.max_loras}")
        if info.rank > self.max_rank:
            raise AdapterError(f"adapter {info.name!r} has rank {info.rank}, more than the maximum {self.max_rank}")
        self.holders[slot] = info
        if info.rank > self.rank:  # wider slots: lay every loaded adapter out again
            self.rank = info.rank
            for a_all, b_all in self.stacked.values():
                a_all[:] = 0.0
                b_all[:] = 0.0
            for s, held in self.holders.items():
                self._write(s, held)
        else:
            self._write(slot, info)

    def _write(self, slot: int, info: AdapterInfo) -> None:
        arrays = self._arrays(info)
        self._writes += 1
        self.adapted_in[slot] = frozenset((layer, target) for target, (a, _) in arrays.items()
                                          for layer in range(a.shape[0]) if a[layer].any())
        start = (slot - 1) * self.rank
        for target, (a_all, b_all) in self.stacked.items():
            a_all[:, start:start + self.rank] = 0.0
            b_all[:, start:start + self.rank] = 0.0
            if target in arrays:
                a, b = arrays[target]  # [layers, in, r], [layers, r, out]
                r = a.shape[2]
                a_all[:, start:start + r] = a.transpose(0, 2, 1)
                b_all[:, start:start + r] = b

    def columns(self, token_slots: list[int]) -> int:
        """Columns a step with these slots needs bound: up to its highest slot's."""
        return max(token_slots) * self.rank

    def idle(self, columns: int) -> frozenset:
        """(layer, target) pairs no adapter in the slots of these columns adapts (a target it leaves out, a
        layer outside its layers_to_transform): their deltas are zero for every row."""
        key = (columns, self._writes)
        if self._idle[0] != key:  # a step's answer is the last one's until a slot changes
            slots = range(1, columns // max(self.rank, 1) + 1)
            used = frozenset().union(*(self.adapted_in.get(s, frozenset()) for s in slots))
            every = frozenset((layer, t) for t, (a, _) in self.stacked.items() for layer in range(a.shape[0]))
            self._idle = (key, every - used)
        return self._idle[1]

    def views(self, columns: int, idle: frozenset = frozenset()) -> dict[str, np.ndarray]:
        """Every layer's A and B inputs over the first `columns` columns (contiguous views, no copy); an
        idle pair's with none (ruvllm's LoRA kernels then pass its projection through untouched)."""
        out = {}
        for target, (a_all, b_all) in self.stacked.items():
            for layer in range(a_all.shape[0]):
                width = 0 if (layer, target) in idle else columns
                out[C.lora_a(layer, target)] = a_all[layer, :width]
                out[C.lora_b(layer, target)] = b_all[layer, :width]
        return out

    def mixing(self, token_slots: list[int], columns: int, mix: dict | None = None) -> np.ndarray:
        """lora_weights [tokens, sets * columns]: each token weighs its sequence's slot's columns 1, the
        rest 0; a token in `mix` (X-LoRA: token -> [(slot, weight)]) weighs each of those slots' columns
        instead. A weight that is a list (layerwise X-LoRA: one per contract.lora_module) makes every
        row that many sets, the other tokens' repeated."""
        slots = np.asarray(token_slots, np.int64)
        col_slot = np.arange(columns) // max(self.rank, 1) + 1  # the slot each column belongs to
        sets = mix_sets(mix)
        one_hot = (slots[:, None] == col_slot[None, :]).astype(np.float32)
        weights = np.repeat(one_hot[:, None, :], sets, axis=1) if sets > 1 else one_hot[:, None, :]
        for token, pairs in (mix or {}).items():
            row = weights[token]  # [sets, columns]
            row[:] = 0.0
            for slot, w in pairs:
                row[:, (slot - 1) * self.rank:slot * self.rank] = np.asarray(w, np.float32).reshape(-1, 1)
        return weights.reshape(len(token_slots), sets * columns)
