"""Saves several ONNX graphs whose weights live in one shared external-data file.

The base and LoRA decoder graphs hold the same (quantized) weights; storing each tensor once
keeps the package the size of one graph. Tensors are deduplicated by content.

A `WeightStore` can also take the weights as a graph is built (GraphBuilder(store=...)): each
large tensor goes to the file at once and the graph keeps only its reference, so an export never
holds a model's weights in memory (a 7B GGUF's would not fit). A tensor the builder names with
`named()` is made once for every graph that asks for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

ALIGN = 64
SMALL = 1024  # tensors below this many bytes stay inside the .onnx file


class WeightStore:
    def __init__(self, path: Path) -> None:
        self.path, self.name = Path(path), Path(path).name
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._offsets: dict[str, tuple[int, int]] = {}  # content digest -> (offset, length)
        self._named: dict[str, TensorProto] = {}  # the builder's named tensors: references, made once

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        """An initializer for `array`: a reference into the file, or inline when small."""
        array = np.require(array, requirements="C")  # (np.ascontiguousarray makes a 0-d scalar [1])
        if array.nbytes < SMALL:
            return numpy_helper.from_array(array, name)
        ref = TensorProto()
        ref.name, ref.data_type = name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
        ref.dims.extend(array.shape)
        self._refer(ref, memoryview(array.reshape(-1).view(np.uint8)))
        return ref

    def named(self, name: str, make: Callable[[], np.ndarray]) -> TensorProto:
        """`tensor(name, make())`, made the first time only: every graph that names it shares it."""
        if name not in self._named:
            self._named[name] = self.tensor(name, make())
        out = TensorProto()
        out.CopyFrom(self._named[name])
        return out

    def externalize(self, tensor: TensorProto) -> None:
        """Move a large inline initializer's data into the file (in place)."""
        if tensor.data_location == TensorProto.EXTERNAL:
            return
        raw = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
        if len(raw) < SMALL:
            return
        _clear_data(tensor)
        self._refer(tensor, memoryview(raw))

    def _refer(self, tensor: TensorProto, data: memoryview) -> None:
        key = hashlib.sha256(data).hexdigest()
        if key not in self._offsets:
            pos = self._file.tell()
            pad = (-pos) % ALIGN
            self._file.write(b"\0" * pad)
            self._offsets[key] = (pos + pad, len(data))
            self._file.write(data)
        offset, length = self._offsets[key]
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        for k, v in (("location", self.name), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = k, v

    def close(self) -> None:
        self._file.close()


def save_with_shared_data(models: dict[str, onnx.ModelProto], out_dir: Path, data_name: str,
                          store: WeightStore | None = None) -> None:
    """Write each model as out_dir/<name>, moving large initializers into out_dir/data_name (the
    store's file, when the graphs were built on one)."""
    own = store is None
    store = store or WeightStore(out_dir / data_name)
    try:
        for file_name, model in models.items():
            for tensor in model.graph.initializer:
                store.externalize(tensor)
            onnx.save_model(model, out_dir / file_name)
    finally:
        if own:
            store.close()


def _clear_data(tensor: TensorProto) -> None:
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
