"""The page's WASM step's weights (wasm/step/step.c): a llama or Qwen2 GGUF's own blocks, repacked, nothing
quantized again. Every matrix keeps its file type's bits (STEP_TYPES: runtime/formats/block_types.py's types
marked `step`; the generated wasm/step/abi.h's `enum kind` numbers them the same), in one shape of layout for all of them, so the step
reads four output rows at a time and a block of 32 weights at a time whatever the type:

| part | what | types |
|---|---|---|
| `w` | the low nibbles [N, K/2], block by block: byte i of a block of 32 holds weight i (low) and i + 16 (high); Q8_0: the int8 weights [N, K] | all |
| `hb` | the bits above the nibble as bit planes, uint32 [N, K/32, planes]: bit j of plane p is weight j's bit 4 + p | Q5_0, Q5_1, Q5_K (1 plane), Q6_K (2) |
| `d` | fp16 scales, four rows side by side: [N/4, K/32, 4]; K-quants: the super-block's d [N/4, K/256, 4] | all |
| `m` | fp16 minimums [N/4, K/32, 4]; K-quants: the super-block's dmin [N/4, K/256, 4] | Q4_1, Q5_1, Q4_K, Q5_K |
| `sc` | the 6-bit scales as bytes [N/4, K/32, 4]; Q6_K: int8 scales of each half [N/4, K/32, 2, 4] | K-quants |
| `mb` | the 6-bit minimums as bytes [N/4, K/32, 4] | Q4_K, Q5_K |

Sizes are the file's (Q4_K and Q5_K: +1/8 bit a weight, their scales as whole bytes). Scales stay fp16:
step.c widens them as it reads them (exactly), so the file is the module's memory image and is copied in
as it downloads. q and k keep the file's row order (llama.cpp's converter permutes a llama's rows for
RoPE on adjacent pairs; a Qwen2's rotate halves), which step.c's RoPE follows (`rope_neox`).

One file of arrays (`step.bin`) and its index: {"config": {...}, "matrices": {name: type}, "arrays":
[{"name", "dtype", "offset", "bytes"}, ...]}, every array 64-byte aligned.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from exporter.sources.gguf_blocks import own_parts
from runtime.errors import PackageError
from runtime.formats.block_types import OWN, STEP_TYPES
from runtime.formats.gguf_file import read_header_file
from runtime.formats.step_abi import FORMAT
from runtime.formats.step_plan import StepPlan, step_plan, step_reads


def _four(a: np.ndarray) -> np.ndarray:
    """[N, blocks, ...] -> [N / 4, blocks, ..., 4]: four rows' numbers side by side."""
    n = a.shape[0]
    b = a.reshape(n // 4, 4, *a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(b, 1, -1))


def step_matrix(type_name: str, raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """One matrix of GGUF type `type_name` ([rows, cols], the file's raw blocks) in step.c's layout."""
    if not step_reads(type_name, rows, cols):
        raise PackageError(f"a {type_name} matrix [{rows}, {cols}]: the WASM step reads "
                           f"{', '.join(STEP_TYPES)} with rows in fours")
    parts = own_parts(type_name, raw, rows, cols)
    q = parts[0]
    t = OWN[type_name]
    if t.op == "MatMulQ8":
        return {"w": (q.astype(np.int16) - t.zero).astype(np.int8), "d": _four(parts[1])}
    blocks = q.reshape(rows, cols // 32, 32)
    out = {"w": ((blocks[..., :16] & 15) | ((blocks[..., 16:] & 15) << 4)).astype(np.uint8).reshape(rows, cols // 2)}
    if t.bits > 4:
        weights = (np.uint32(1) << np.arange(32, dtype=np.uint32))
        planes = [((((blocks >> (4 + p)) & 1).astype(np.uint32)) * weights).sum(-1, dtype=np.uint32)
                  for p in range(t.bits - 4)]
        out["hb"] = np.stack(planes, -1)
    if t.scales == "kquant":
        _, d, dmin, sc, m = parts
        out.update(d=_four(d), m=_four(dmin), sc=_four(sc), mb=_four(m))
    elif t.scales == "six":
        _, d, sc = parts
        out.update(d=_four(d), sc=_four(sc.reshape(rows, cols // 32, 2)))
    elif t.scales == "half":
        out["d"] = _four(parts[1])
    else:
        out.update(d=_four(parts[1]), m=_four(parts[2]))
    return out


def rope_frequencies(base: float, head_dim: int) -> np.ndarray:
    """float64 [head_dim / 2]: base ** (-2i / head_dim), as the page's gguf_source.js computes them; step.c divides
    each by its llama 3 factor (rope_factors), if any, and turns a position's angles from them."""
    return base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _tensor(blob: np.ndarray, t) -> np.ndarray:
    return blob[t.offset:t.offset + t.nbytes]


def _floats(blob: np.ndarray, t) -> np.ndarray:
    raw = _tensor(blob, t)
    if t.type_name == "F32":
        return raw.view(np.float32)
    if t.type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # BF16


def step_arrays(gguf_path: str | Path, max_pos: int) -> tuple[StepPlan, Iterator[tuple[str, np.ndarray]]]:
    """The plan of a GGUF for step.c (runtime/formats/step_plan.py, from the header alone) and its arrays,
    one at a time, one matrix in memory at a time. PackageError where the file is not what step.c
    computes, before the first array."""
    plan = step_plan(read_header_file(gguf_path), max_pos, str(gguf_path))
    blob = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    if plan.size and max((t.offset + t.nbytes for t in plan.sources.values()), default=0) > blob.size:
        raise PackageError(f"{gguf_path}: its tensors run past the file's end (a truncated file)")

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        made: dict[str, dict[str, np.ndarray]] = {}
        for a in plan.arrays:
            if a.rope is not None:
                arr = rope_frequencies(a.rope, plan.config["head_dim"])
            elif a.part is not None:
                if a.tensor not in made:
                    made.clear()  # one matrix at a time
                    t = plan.sources[a.tensor]
                    made[a.tensor] = step_matrix(t.type_name, _tensor(blob, t), *t.shape)
                arr = made[a.tensor][a.part]
            else:
                arr = _floats(blob, plan.sources[a.tensor])
            if arr.dtype.name != a.dtype or tuple(arr.shape) != a.shape:
                raise AssertionError(f"{a.name}: {arr.dtype} {arr.shape}, the plan says {a.dtype} {a.shape}")
            yield a.name, arr

    return plan, arrays()


def write_step_weights(gguf_path: str | Path, out: str | Path, max_pos: int) -> dict:
    """step.bin under `out` and its index (returned, and written beside it as step.json)."""
    out = Path(out)
    plan, arrays = step_arrays(gguf_path, max_pos)
    by_name = {a.name: a for a in plan.arrays}
    with open(out / "step.bin", "wb") as f:
        for name, arr in arrays:
            f.write(b"\0" * (by_name[name].offset - f.tell()))
            f.write(np.ascontiguousarray(arr).tobytes())
    index = plan.index()
    (out / "step.json").write_text(json.dumps(index))
    return index


def package_step(gguf_path: str | Path, out: str | Path, max_pos: int, progress: bool = True) -> dict | None:
    """The package's WASM step entry (manifest "wasm_step"), its files written under `out`; None, with a
    warning, where the GGUF's tensors are not what step.c computes (the page then runs onnxruntime-web)."""
    import sys

    try:
        write_step_weights(gguf_path, out, max_pos)
    except PackageError as err:
        if progress:
            print(f"note: no WASM step in this package ({err})", file=sys.stderr)
        return None
    return {"weights": "step.bin", "index": "step.json", "max_positions": max_pos, "format": FORMAT}
