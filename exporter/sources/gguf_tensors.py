"""A GGUF file's tensors under Hugging Face names, one at a time from the memory-mapped file.

Loading a GGUF through transformers dequantizes every tensor to fp32 and copies it into a model
(about 23 bytes of RAM a parameter: a 1B model did not fit in 24 GB). Here the
file is mapped (gguf_mapped.py) and each tensor is read when the graph builder reaches it: as float32 (gguf's dequantization),
or as its own blocks (a Grid, gguf_blocks.py), with transformers' own tensor processors applied (the
q/k rows llama.cpp permutes for its rotary, Gemma 2's norm offsets), so a tensor here is bit for bit
what `from_pretrained(..., gguf_file=...)` would have put in the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from exporter.builders.family_config import float_weights
from exporter.quantizers.grid import Grid
from exporter.sources import gguf_blocks
from exporter.sources.gguf_mapped import MappedGGUF
from runtime.errors import RuvLLMError


class GgufTensors:
    def __init__(self, path: str, model) -> None:
        """model: the transformers model of the file's config, with no weights (meta tensors), for the
        map of tensor names."""
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = path
        self.reader = MappedGGUF(path)
        arch = self.reader.architecture
        # the config the processors read (head counts), as transformers parsed it from this file
        self.parsed = {"config": model.config.to_dict()}
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self.parsed["config"])
        key_map = get_gguf_hf_weights_map(model, self.processor)
        self.tensors = {}
        for t in self.reader.tensors:
            hf = key_map.get(t.name)
            if hf is not None:
                self.tensors[hf] = t

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def float(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor as float32 ([out, in] for a matrix), or `rows` of it (never the q/k projections,
        whose rows transformers reorders)."""
        from gguf import dequantize

        t = self.tensors[name]
        data = t.data if rows is None else t.data[rows]
        w = dequantize(data, t.tensor_type)
        if rows is None:
            w = self._processed(w, t.name)
        return np.ascontiguousarray(w, np.float32)

    def rows(self, name: str) -> int:
        return int(self.tensors[name].shape[-1]) if len(self.tensors[name].shape) > 1 else 1

    def grid(self, name: str) -> Grid | None:
        """The tensor's own blocks as a Grid in transformers' row order, or None for a type without a
        grid here (F16, F32, IQ types)."""
        t = self.tensors[name]
        if t.tensor_type.name not in gguf_blocks.DECODERS or len(t.shape) != 2:
            return None
        cols, rows = (int(d) for d in t.shape)
        grid = gguf_blocks.decode(t.data, t.tensor_type.name, rows, cols)
        idx = self._row_order(t.name, rows)
        if idx is not None:
            pick = lambda a: None if a is None else a[idx]  # noqa: E731
            grid = Grid(grid.q[idx], grid.scale[idx], grid.zero[idx], grid.block, grid.bits, pick(grid.mins))
        return grid

    def own_bits(self, name: str):
        """A tensor's own parts (gguf_blocks.own_parts) in transformers' row order, or None for a type the
        kernels do not read at its own bits (runtime.backends.block_layouts.OWN)."""
        from runtime.backends.block_layouts import OWN

        t = self.tensors[name]
        if t.tensor_type.name not in OWN or len(t.shape) != 2:
            return None
        cols, rows = (int(d) for d in t.shape)
        parts = gguf_blocks.own_parts(t.tensor_type.name, t.data, rows, cols)
        idx = self._row_order(t.name, rows)
        return parts if idx is None else tuple(p[idx] for p in parts)

    def _row_order(self, gguf_name: str, rows: int) -> np.ndarray | None:
        """The order transformers puts this tensor's rows in (None: the file's), a permutation only."""
        order = self._processed(np.arange(rows, dtype=np.float64).reshape(rows, 1), gguf_name).reshape(-1)
        if np.array_equal(order, np.arange(rows)):
            return None
        idx = order.astype(np.int64)
        if not np.array_equal(np.sort(idx), np.arange(rows)) or not np.array_equal(idx, order):
            raise RuvLLMError(f"{gguf_name}: transformers changes this tensor beyond reordering its rows; "
                              "its blocks cannot be carried over")
        return idx

    def release(self) -> None:
        """Drop the file's pages from this process (the page cache keeps them): a tensor read is not
        held, so memory follows one tensor, not the file."""
        import mmap

        raw = getattr(self.reader.data, "_mmap", None)
        if raw is not None and hasattr(raw, "madvise"):
            raw.madvise(mmap.MADV_DONTNEED)

    def _processed(self, w: np.ndarray, gguf_name: str) -> np.ndarray:
        return self.processor.process(weights=w, name=gguf_name, tensor_key_mapping={},
                                      parsed_parameters=self.parsed).weights


class LazyWeights(Mapping):
    """The float weights a graph builder reads (by Hugging Face name), each made when it is read and
    not kept, with the family's own transform (family_config.float_weights) applied; from a GgufTensors or a
    safetensors_tensors.SafetensorsTensors."""

    def __init__(self, tensors, family, calibrated=None) -> None:
        """calibrated: a layerwise.LayerwiseQuantizer, whose folded weights (AWQ's norms) come first."""
        self.tensors, self.family, self.calibrated = tensors, family, calibrated

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.tensors.tensors:
            raise KeyError(name)
        w = self.calibrated.weight(name) if self.calibrated is not None else None
        return float_weights(self.family, {name: self.tensors.float(name) if w is None else w})[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors.tensors)

    def __len__(self) -> int:
        return len(self.tensors.tensors)
