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
from runtime.formats.families import sliding
from runtime.formats.step_abi import ACTIVATIONS, ARCHS, FORMAT, PARTS

PROJECTIONS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
               "down": "ffn_down"}
ALIGN = 64


def extra_norms(family) -> list[tuple[str, str]]:
    """A family's per-layer norms beyond attn_norm and ffn_norm: (the GGUF's name, the step's)."""
    return ([("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")] if family.qk_norm else []) + (
        [("post_attention_norm", "post_attn_norm"), ("post_ffw_norm", "post_ffn_norm")] if family.sandwich_norms else [])


def _four(a: np.ndarray) -> np.ndarray:
    """[N, blocks, ...] -> [N / 4, blocks, ..., 4]: four rows' numbers side by side."""
    n = a.shape[0]
    b = a.reshape(n // 4, 4, *a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(b, 1, -1))


def step_reads(type_name: str, rows: int, cols: int) -> bool:
    """Whether step.c computes on a [rows, cols] matrix of this GGUF type: four rows at a time, whole blocks."""
    return type_name in STEP_TYPES and rows % 4 == 0 and cols % OWN[type_name].superblock == 0


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


def step_arrays(gguf_path: str | Path, max_pos: int) -> tuple[dict, dict[str, str], Iterator[tuple[str, np.ndarray]]]:
    """(config, matrix types, the arrays one at a time) of a GGUF for step.c: the types fill in as the
    arrays are read, one matrix in memory at a time. PackageError where the file is not what step.c
    computes (a llama or Qwen2 GGUF whose matrices are of the types in STEP_TYPES), before the first array."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}

    def field(key: str, default=None):
        if key not in reader.fields:
            if default is not None:
                return default
            raise PackageError(f"{gguf_path}: no {key}: the WASM step runs llama and Qwen2 GGUFs only")
        part = reader.fields[key].parts[-1]
        return bytes(part).decode() if part.dtype == np.uint8 else part[0]

    arch = field("general.architecture")
    if arch not in ARCHS:
        raise PackageError(f"{gguf_path}: architecture {arch!r}; the WASM step runs {', '.join(ARCHS)}")
    family = ARCHS[arch]
    dim, layers = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.block_count"))
    hidden, heads = int(field(f"{arch}.feed_forward_length")), int(field(f"{arch}.attention.head_count"))
    kv_heads, theta = int(field(f"{arch}.attention.head_count_kv")), float(field(f"{arch}.rope.freq_base", 10000.0))
    eps = float(field(f"{arch}.attention.layer_norm_rms_epsilon"))
    hd = int(field(f"{arch}.attention.key_length", dim // heads))
    if dim % 32 or hidden % 32 or (heads * hd) % 32 or hd % 4:
        raise PackageError(f"{gguf_path}: widths {dim}, {hidden}, {heads} x {hd}: the WASM step needs multiples of 32")
    vocab = int(tensors["token_embd.weight"].shape[1])
    shapes = {"q": (heads * hd, dim), "k": (kv_heads * hd, dim), "v": (kv_heads * hd, dim), "o": (dim, heads * hd),
              "gate": (hidden, dim), "up": (hidden, dim), "down": (dim, hidden)}
    wanted = {"embd": ("token_embd.weight", vocab, dim)}
    if "output.weight" in tensors:
        wanted["head"] = ("output.weight", vocab, dim)
    for i in range(layers):
        for key, (rows, cols) in shapes.items():
            wanted[f"{i}.{key}"] = (f"blk.{i}.{PROJECTIONS[key]}.weight", rows, cols)
            bias = f"blk.{i}.{PROJECTIONS[key]}.bias"
            if bias in tensors and key not in ("q", "k", "v"):
                raise PackageError(f"{gguf_path}: a bias on {PROJECTIONS[key]}; the WASM step adds q, k and v's only")
        for name, _ in extra_norms(family):
            if f"blk.{i}.{name}.weight" not in tensors:
                raise PackageError(f"{gguf_path}: no blk.{i}.{name}.weight, which a {arch} layer has")
    window = int(field(f"{arch}.attention.sliding_window", 0)) if family.swa_pattern else 0
    if family.swa_pattern and not window:
        raise PackageError(f"{gguf_path}: no {arch}.attention.sliding_window")
    windows = [window if sliding(family, i) else 0 for i in range(layers)]
    for gguf_name, rows, cols in wanted.values():  # every matrix checked before any is read
        t = tensors.get(gguf_name)
        if t is None:
            raise PackageError(f"{gguf_path}: no {gguf_name}")
        if (int(t.shape[-1]), int(t.shape[0])) != (rows, cols):
            raise PackageError(f"{gguf_path}: {gguf_name} is {[int(d) for d in t.shape][::-1]}, not [{rows}, {cols}]")
        if not step_reads(t.tensor_type.name, rows, cols):
            raise PackageError(f"{gguf_path}: {gguf_name} is {t.tensor_type.name} [{rows}, {cols}]; the WASM step "
                               f"reads {', '.join(STEP_TYPES)} with rows in fours")
    matrices: dict[str, str] = {}

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        def matrix(name: str):
            gguf_name, rows, cols = wanted[name]
            t = tensors[gguf_name]
            matrices[name] = t.tensor_type.name
            parts = step_matrix(t.tensor_type.name, t.data, rows, cols)
            return [(f"{name}.{part}", parts[part]) for part in PARTS if part in parts]

        yield from matrix("embd")
        if "head" in wanted:
            yield from matrix("head")
        yield "out_norm", np.asarray(tensors["output_norm.weight"].data, np.float32)

        def rope(base: float) -> np.ndarray:
            inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
            if "rope_freqs.weight" in tensors:  # llama 3's frequency factors: llama.cpp divides each frequency by its own
                inv = inv / np.asarray(tensors["rope_freqs.weight"].data, np.float64)
            angle = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
            return np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)

        yield "rope", rope(theta)
        if family.local_rope_base:  # the sliding layers' own base
            yield "rope_local", rope(family.local_rope_base)
        for i in range(layers):
            yield f"{i}.attn_norm", np.asarray(tensors[f"blk.{i}.attn_norm.weight"].data, np.float32)
            yield f"{i}.ffn_norm", np.asarray(tensors[f"blk.{i}.ffn_norm.weight"].data, np.float32)
            for name, as_name in extra_norms(family):
                yield f"{i}.{as_name}", np.asarray(tensors[f"blk.{i}.{name}.weight"].data, np.float32)
            for key in shapes:
                yield from matrix(f"{i}.{key}")
                bias = tensors.get(f"blk.{i}.{PROJECTIONS[key]}.bias")
                if bias is not None:
                    yield f"{i}.{key}.bias", np.asarray(bias.data, np.float32)

    config = {"arch": arch, "dim": dim, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
              "head_dim": hd, "vocab": vocab, "max_pos": max_pos, "eps": eps, "rope_neox": family.rope_neox,
              "act": ACTIVATIONS.index(family.activation), "embed_scale": float(np.float32(dim ** 0.5)) if family.embed_scale else 1.0,
              "attn_scale": 1.0 / float(hd) ** 0.5, "windows": windows,
              "layer_rope": ["rope_local" if family.local_rope_base and sliding(family, i) else "rope" for i in range(layers)],
              "kinds": {name: OWN[name].kind for name in STEP_TYPES}}
    return config, matrices, arrays()


def write_step_weights(gguf_path: str | Path, out: str | Path, max_pos: int) -> dict:
    """step.bin under `out` and its index (returned, and written beside it as step.json)."""
    out = Path(out)
    config, matrices, arrays = step_arrays(gguf_path, max_pos)
    index: dict = {"config": config, "matrices": matrices, "arrays": []}
    with open(out / "step.bin", "wb") as f:
        for name, arr in arrays:
            f.write(b"\0" * (-f.tell() % ALIGN))
            index["arrays"].append({"name": name, "dtype": str(arr.dtype), "offset": f.tell(), "bytes": arr.nbytes})
            f.write(np.ascontiguousarray(arr).tobytes())
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
