"""Saves several ONNX graphs whose weights live in one shared external-data file.

The base and LoRA decoder graphs hold the same (quantized) weights; storing each tensor once
keeps the package the size of one graph. Tensors are deduplicated by content.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from onnx import TensorProto

ALIGN = 64
SMALL = 1024  # tensors below this many bytes stay inside the .onnx file


def save_with_shared_data(models: dict[str, onnx.ModelProto], out_dir: Path, data_name: str) -> None:
    """Write each model as out_dir/<name>, moving large initializers into out_dir/data_name."""
    offsets: dict[str, tuple[int, int]] = {}
    with open(out_dir / data_name, "wb") as data:
        for file_name, model in models.items():
            for tensor in model.graph.initializer:
                raw = tensor.raw_data or onnx.numpy_helper.to_array(tensor).tobytes()
                if len(raw) < SMALL:
                    continue
                key = hashlib.sha256(raw).hexdigest()
                if key not in offsets:
                    pos = data.tell()
                    pad = (-pos) % ALIGN
                    data.write(b"\0" * pad)
                    offsets[key] = (pos + pad, len(raw))
                    data.write(raw)
                offset, length = offsets[key]
                _clear_data(tensor)
                tensor.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, v
            onnx.save_model(model, out_dir / file_name)


def _clear_data(tensor: TensorProto) -> None:
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
