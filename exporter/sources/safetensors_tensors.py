"""A Hugging Face folder's tensors, one at a time from its safetensors files (which safetensors maps).

The same interface as gguf_tensors.GgufTensors, so the streamed export reads a folder as it reads a
GGUF: each tensor when the graph builder reaches it, as float32, and nothing kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

INDEX = "model.safetensors.index.json"


class NotStreamable(Exception):
    """This folder's checkpoint does not name the weights as the model does: export it the whole way."""


class SafetensorsTensors:
    def __init__(self, folder: str, model) -> None:
        from safetensors import safe_open

        root = Path(folder)
        if (root / INDEX).exists():
            where = json.loads((root / INDEX).read_text())["weight_map"]
        elif (root / "model.safetensors").exists():
            with safe_open(str(root / "model.safetensors"), framework="pt") as f:
                where = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise NotStreamable(f"{folder}: no safetensors weights")
        wanted = set(model.state_dict())
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = wanted - set(where) - ({"lm_head.weight"} if tied else set())
        if missing:
            raise NotStreamable(f"{folder}: the checkpoint lacks {sorted(missing)[0]} (named otherwise?)")
        self.root = root
        self.where = {name: root / file for name, file in where.items() if name in wanted}
        self.tensors = self.where  # the names, for LazyWeights
        self._shapes: dict[str, tuple[int, ...]] = {}

    def _open(self, name: str):
        from safetensors import safe_open

        return safe_open(str(self.where[name]), framework="pt")

    def type_of(self, name: str) -> str:
        with self._open(name) as f:
            return str(f.get_slice(name).get_dtype())

    def rows(self, name: str) -> int:
        if name not in self._shapes:
            with self._open(name) as f:
                self._shapes[name] = tuple(f.get_slice(name).get_shape())
        shape = self._shapes[name]
        return int(shape[0]) if len(shape) > 1 else 1

    def float(self, name: str, rows: slice | None = None) -> np.ndarray:
        with self._open(name) as f:
            t = f.get_tensor(name) if rows is None else f.get_slice(name)[rows]
        return np.ascontiguousarray(t.float().numpy(), np.float32)

    def grid(self, name: str):
        return None  # float weights: no blocks to carry

    def own_bits(self, name: str):
        return None

    def release(self) -> None:
        pass  # each read opens and closes its file's map
