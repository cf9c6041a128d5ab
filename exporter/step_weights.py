"""The page's WASM decode step's weights (wasm/step/step.c): a llama-family GGUF's own blocks, repacked,
nothing quantized again. Q4_1 projections become nibbles [N, K / 2] with their scales and minimums
[N / 4, K / 32, 4] (four output rows a pass); the Q8_0 embedding, which the head reuses, stays int8 rows
with a scale per 32. Scales and minimums stay the GGUF's fp16 (the page widens them to fp32 as it loads
them: exact); norms stay fp32; RoPE's cos/sin table is precomputed in float64. q and k keep
the GGUF's row order (llama.cpp's converter permutes them for RoPE on adjacent pairs), which step.c's
RoPE follows.

One file of arrays (`step.bin`) and its index: {"config": {...}, "arrays": [{"name", "dtype", "offset",
"bytes"}, ...]}, every array 64-byte aligned.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.errors import PackageError

PROJECTIONS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
               "down": "ffn_down"}
ALIGN = 64


def _q4_1(raw_blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """GGUF Q4_1 rows (blocks of 32: fp16 scale, fp16 minimum, 16 bytes of nibbles) in step.c's layout."""
    raw = np.asarray(raw_blocks, np.uint8).reshape(rows, cols // 32, 20)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    m = raw[..., 2:4].copy().view(np.float16)[..., 0]

    def four(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(rows // 4, 4, cols // 32).transpose(0, 2, 1))

    return {"w": np.ascontiguousarray(raw[..., 4:]).reshape(rows, cols // 2), "d": four(d), "m": four(m)}


def step_arrays(gguf_path: str | Path, max_pos: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, arrays) of a GGUF for step.c; PackageError where its tensors are not the types step.c
    computes (llama architecture, Q4_1 projections, a Q8_0 embedding tied to the head)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}

    def field(key: str):
        if key not in reader.fields:
            raise PackageError(f"{gguf_path}: no {key}: the WASM step runs llama-family GGUFs only")
        part = reader.fields[key].parts[-1]
        return bytes(part).decode() if part.dtype == np.uint8 else part[0]

    if field("general.architecture") != "llama":
        raise PackageError(f"{gguf_path}: architecture {field('general.architecture')!r}; the WASM step runs llama")
    if "output.weight" in tensors:
        raise PackageError(f"{gguf_path}: an untied output head; the WASM step reads the head from the embedding")
    dim, layers = int(field("llama.embedding_length")), int(field("llama.block_count"))
    hidden, heads = int(field("llama.feed_forward_length")), int(field("llama.attention.head_count"))
    kv_heads, theta = int(field("llama.attention.head_count_kv")), float(field("llama.rope.freq_base"))
    eps, hd = float(field("llama.attention.layer_norm_rms_epsilon")), dim // heads
    embd = tensors["token_embd.weight"]
    if embd.tensor_type.name != "Q8_0":
        raise PackageError(f"{gguf_path}: a {embd.tensor_type.name} embedding; the WASM step reads Q8_0")
    vocab = int(embd.shape[1])
    raw = np.asarray(embd.data, np.uint8).reshape(vocab, dim // 32, 34)
    arrays: dict[str, np.ndarray] = {
        "embd": np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(vocab, dim),
        "embd_d": raw[..., 0:2].copy().view(np.float16)[..., 0],
        "out_norm": np.asarray(tensors["output_norm.weight"].data, np.float32),
    }
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angle = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    arrays["rope"] = np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)
    shapes = {"q": (heads * hd, dim), "k": (kv_heads * hd, dim), "v": (kv_heads * hd, dim), "o": (dim, heads * hd),
              "gate": (hidden, dim), "up": (hidden, dim), "down": (dim, hidden)}
    for i in range(layers):
        arrays[f"{i}.attn_norm"] = np.asarray(tensors[f"blk.{i}.attn_norm.weight"].data, np.float32)
        arrays[f"{i}.ffn_norm"] = np.asarray(tensors[f"blk.{i}.ffn_norm.weight"].data, np.float32)
        for key, (rows, cols) in shapes.items():
            t = tensors[f"blk.{i}.{PROJECTIONS[key]}.weight"]
            if t.tensor_type.name != "Q4_1" or rows % 4 or cols % 32:
                raise PackageError(f"{gguf_path}: blk.{i}.{PROJECTIONS[key]} is {t.tensor_type.name} "
                                   f"[{rows}, {cols}]; the WASM step reads Q4_1 with rows in fours")
            for part, arr in _q4_1(t.data, rows, cols).items():
                arrays[f"{i}.{key}.{part}"] = arr
    config = {"dim": dim, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": hd,
              "vocab": vocab, "max_pos": max_pos, "eps": eps}
    return config, arrays


def write_step_weights(gguf_path: str | Path, out: str | Path, max_pos: int) -> dict:
    """step.bin under `out` and its index (returned, and written beside it as step.json)."""
    out = Path(out)
    config, arrays = step_arrays(gguf_path, max_pos)
    index: dict = {"config": config, "arrays": []}
    with open(out / "step.bin", "wb") as f:
        for name, arr in arrays.items():
            f.write(b"\0" * (-f.tell() % ALIGN))
            index["arrays"].append({"name": name, "dtype": str(arr.dtype), "offset": f.tell(), "bytes": arr.nbytes})
            f.write(np.ascontiguousarray(arr).tobytes())
    (out / "step.json").write_text(json.dumps(index))
    return index


def package_step(gguf_path: str | Path, out: str | Path, max_pos: int, progress: bool = True) -> dict | None:
    """The package's WASM step entry (manifest "wasm_step"), its files written under `out`; None, with a
    warning, where the GGUF's tensors are not the types step.c computes (the page then runs onnxruntime-web)."""
    import sys

    try:
        write_step_weights(gguf_path, out, max_pos)
    except PackageError as err:
        if progress:
            print(f"note: no WASM step in this package ({err})", file=sys.stderr)
        return None
    return {"weights": "step.bin", "index": "step.json", "max_positions": max_pos}
