"""A GGUF's tensors as numpy views of the memory-mapped file, found through the standard-library header reader
(runtime/formats/gguf_file.py): gguf-py's GGUFReader parses every metadata array item by item (3 s for
SmolLM2's 49k-token vocabulary, each time a file is opened), where only the tensors are wanted here. Each
tensor looks as GGUFReader's does (name, tensor_type, shape innermost first, n_elements, n_bytes,
data_offset, data: a typed view, or the raw blocks [rows, bytes] of a quantized type)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.formats.gguf_file import GGUFHeader, read_header_file

PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}


@dataclass
class MappedTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # innermost first, as GGUFReader's
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class MappedGGUF:
    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.header: GGUFHeader = read_header_file(path)
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors: list[MappedTensor] = []
        for t in self.header.tensors.values():
            qtype = GGMLQuantizationType(t.ggml)
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(t.shape)) if t.shape else 1
            nbytes = n * size // block
            raw = self.data[t.offset:t.offset + nbytes]
            plain = PLAIN.get(qtype.name)
            view = raw.view(plain).reshape(t.shape) if plain else raw.reshape(quant_shape_to_byte_shape(t.shape, qtype))
            self.tensors.append(MappedTensor(t.name, qtype, np.array(t.shape[::-1], np.uint64), n, nbytes, t.offset, view))

    @property
    def architecture(self) -> str:
        return self.header.architecture
