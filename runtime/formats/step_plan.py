"""What the page's WASM step makes of a GGUF, decided once from the file's header alone (standard library):
the step's config, and step.bin's arrays in order (name, dtype, shape, offset) with where each comes from
(a matrix's raw blocks, a norm's floats, a RoPE table). The exporter (exporter/step_weights.py) fills the
plan natively; the page fills the same plan from the file's byte ranges (web/src/gguf_source.js, the
step's own repacking, wasm/step/repack.h), so a package made either way is the same bytes.

step.bin's layout of a matrix, per block type (step.c reads it; exporter/step_weights.py documents it): `w`
the nibbles or Q8_0's int8, `hb` the bit planes above the nibble, `d`/`m` fp16 scales and minimums four
rows side by side, `sc`/`mb` the K-quants' scale and minimum bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.errors import PackageError
from runtime.formats.block_types import OWN, STEP_TYPES, SUPER
from runtime.formats.families import ACTIVATIONS, STEP_FAMILIES, sliding
from runtime.formats.gguf_file import GGUFHeader, TensorInfo
from runtime.formats.step_abi import FORMAT, MATRICES, PARTS

PROJECTIONS = dict(zip(MATRICES, ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")))
ALIGN = 64
ITEM = {"uint8": 1, "int8": 1, "float16": 2, "uint32": 4, "float32": 4, "float64": 8}
FLOAT_TENSORS = ("F32", "F16", "BF16")  # a norm's or bias's types the plan widens to fp32


def step_reads(type_name: str, rows: int, cols: int) -> bool:
    """Whether step.c computes on a [rows, cols] matrix of this GGUF type: four rows at a time, whole blocks."""
    return type_name in STEP_TYPES and rows % 4 == 0 and cols % OWN[type_name].superblock == 0


def step_parts(type_name: str, rows: int, cols: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(part, dtype, shape) of a [rows, cols] matrix of this type in step.bin, in QMat's order (PARTS)."""
    t = OWN[type_name]
    blocks, four = cols // 32, rows // 4
    if t.op == "MatMulQ8":
        parts = {"w": ("int8", (rows, cols)), "d": ("float16", (four, blocks, 4))}
    else:
        parts = {"w": ("uint8", (rows, cols // 2))}
        if t.bits > 4:
            parts["hb"] = ("uint32", (rows, blocks, t.bits - 4))
        if t.scales == "kquant":
            supers = (four, cols // SUPER, 4)
            parts.update(d=("float16", supers), m=("float16", supers), sc=("uint8", (four, blocks, 4)),
                         mb=("uint8", (four, blocks, 4)))
        elif t.scales == "six":
            parts.update(d=("float16", (four, cols // SUPER, 4)), sc=("int8", (four, blocks, 2, 4)))
        elif t.scales == "half":
            parts["d"] = ("float16", (four, blocks, 4))
        elif t.scales == "halfmin":
            parts.update(d=("float16", (four, blocks, 4)), m=("float16", (four, blocks, 4)))
        else:
            raise PackageError(f"{type_name}: the WASM step has no layout for its scales ({t.scales})")
    return [(p, *parts[p]) for p in PARTS if p in parts]


@dataclass(frozen=True)
class Array:
    """One array of step.bin and its source: `tensor` (a matrix's part `part`, or a float vector widened to
    fp32) or `rope` (a RoPE base's inverse frequencies, float64 [head_dim / 2]: base ** (-2i / head_dim); step.c
    turns each position's angles from them, so no table of every position's cos and sin is stored)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    tensor: str | None = None
    part: str | None = None
    rope: float | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM[self.dtype]

    def index_entry(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "offset": self.offset, "bytes": self.nbytes}


@dataclass
class StepPlan:
    config: dict
    matrices: dict[str, str]  # step name -> GGUF type
    sources: dict[str, TensorInfo]  # step matrix or vector name -> the file's tensor
    arrays: list[Array] = field(default_factory=list)

    @property
    def size(self) -> int:
        return max(a.offset + a.nbytes for a in self.arrays)

    def index(self) -> dict:
        """step.json."""
        return {"config": self.config, "matrices": self.matrices, "arrays": [a.index_entry() for a in self.arrays]}

    def to_json(self) -> dict:
        """The plan as the page reads it: step.json and each array's source in the file (byte ranges)."""
        src = lambda t: {"tensor": t.name, "type": t.type_name, "at": t.offset, "bytes": t.nbytes,  # noqa: E731
                         "shape": list(t.shape)}
        return {"index": self.index(), "format": FORMAT, "size": self.size,
                "sources": {name: src(t) for name, t in self.sources.items()},
                "fill": [{"name": a.name, "source": a.tensor, "part": a.part, "rope": a.rope} for a in self.arrays]}


def step_plan(header: GGUFHeader, max_pos: int, where: str = "the GGUF") -> StepPlan:
    """The plan of a GGUF for step.c. PackageError, naming what is not so, where the file is not what step.c
    computes (an architecture of runtime/formats/families.py whose matrices are of STEP_TYPES)."""

    def meta(key: str, default=None):
        value = header.field(key, default)
        if value is None:
            raise PackageError(f"{where}: no {key}: the WASM step runs {', '.join(STEP_FAMILIES)} GGUFs only")
        return value

    arch = meta("general.architecture")
    if arch not in STEP_FAMILIES:
        raise PackageError(f"{where}: architecture {arch!r}; the WASM step runs {', '.join(STEP_FAMILIES)}")
    family = STEP_FAMILIES[arch]
    dim, layers = int(meta(f"{arch}.embedding_length")), int(meta(f"{arch}.block_count"))
    hidden, heads = int(meta(f"{arch}.feed_forward_length")), int(meta(f"{arch}.attention.head_count"))
    kv_heads, theta = int(meta(f"{arch}.attention.head_count_kv")), float(meta(f"{arch}.rope.freq_base", 10000.0))
    eps = float(meta(f"{arch}.attention.layer_norm_rms_epsilon"))
    hd = int(meta(f"{arch}.attention.key_length", dim // heads))
    if dim % 32 or hidden % 32 or (heads * hd) % 32 or hd % 4:
        raise PackageError(f"{where}: widths {dim}, {hidden}, {heads} x {hd}: the WASM step needs multiples of 32")
    tensors = header.tensors
    if "token_embd.weight" not in tensors:
        raise PackageError(f"{where}: no token_embd.weight")
    vocab = int(tensors["token_embd.weight"].shape[0])
    shapes = {"q": (heads * hd, dim), "k": (kv_heads * hd, dim), "v": (kv_heads * hd, dim), "o": (dim, heads * hd),
              "gate": (hidden, dim), "up": (hidden, dim), "down": (dim, hidden)}
    wanted = {"embd": ("token_embd.weight", vocab, dim)}
    if "output.weight" in tensors:
        wanted["head"] = ("output.weight", vocab, dim)
    norms = [("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm")] + extra_norms(family)
    for i in range(layers):
        for key, (rows, cols) in shapes.items():
            wanted[f"{i}.{key}"] = (f"blk.{i}.{PROJECTIONS[key]}.weight", rows, cols)
            if f"blk.{i}.{PROJECTIONS[key]}.bias" in tensors and key not in ("q", "k", "v"):
                raise PackageError(f"{where}: a bias on {PROJECTIONS[key]}; the WASM step adds q, k and v's only")
        for name, _ in norms:
            if f"blk.{i}.{name}.weight" not in tensors:
                raise PackageError(f"{where}: no blk.{i}.{name}.weight, which a {arch} layer has")
    window = int(meta(f"{arch}.attention.sliding_window", 0)) if family.swa_pattern else 0
    if family.swa_pattern and not window:
        raise PackageError(f"{where}: no {arch}.attention.sliding_window")
    for gguf_name, rows, cols in wanted.values():  # every matrix checked before any is read
        t = tensors.get(gguf_name)
        if t is None:
            raise PackageError(f"{where}: no {gguf_name}")
        if tuple(t.shape) != (rows, cols):
            raise PackageError(f"{where}: {gguf_name} is {list(t.shape)}, not [{rows}, {cols}]")
        if not step_reads(t.type_name, rows, cols):
            raise PackageError(f"{where}: {gguf_name} is {t.type_name} [{rows}, {cols}]; the WASM step "
                               f"reads {', '.join(STEP_TYPES)} with rows in fours")
    config = {"arch": arch, "dim": dim, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
              "head_dim": hd, "vocab": vocab, "max_pos": max_pos, "eps": eps, "rope_neox": family.rope_neox,
              "act": ACTIVATIONS.index(family.activation),
              "embed_scale": _f32(math.sqrt(dim)) if family.embed_scale else 1.0,
              "attn_scale": 1.0 / math.sqrt(hd), "windows": [window if sliding(family, i) else 0 for i in range(layers)],
              "layer_rope": ["rope_local" if family.local_rope_base and sliding(family, i) else "rope"
                             for i in range(layers)],
              "kinds": {name: OWN[name].kind for name in STEP_TYPES}}
    plan = StepPlan(config, {}, {})
    at = 0

    def add(name: str, dtype: str, shape: tuple[int, ...], **source) -> None:
        nonlocal at
        at += -at % ALIGN
        plan.arrays.append(Array(name, dtype, tuple(shape), at, **source))
        at += plan.arrays[-1].nbytes

    def matrix(name: str) -> None:
        gguf_name, rows, cols = wanted[name]
        t = tensors[gguf_name]
        plan.matrices[name] = t.type_name
        plan.sources[name] = t
        for part, dtype, shape in step_parts(t.type_name, rows, cols):
            add(f"{name}.{part}", dtype, shape, tensor=name, part=part)

    def vector(name: str, gguf_name: str, size: int) -> None:
        t = tensors.get(gguf_name)
        if t is None:
            raise PackageError(f"{where}: no {gguf_name}")
        if t.type_name not in FLOAT_TENSORS or math.prod(t.shape) != size:
            raise PackageError(f"{where}: {gguf_name} is {t.type_name} {list(t.shape)}, not {size} floats")
        plan.sources[name] = t
        add(name, "float32", (size,), tensor=name)

    matrix("embd")
    if "head" in wanted:
        matrix("head")
    vector("out_norm", "output_norm.weight", dim)
    add("rope", "float64", (hd // 2,), rope=theta)
    if family.local_rope_base:  # the sliding layers' own base
        add("rope_local", "float64", (hd // 2,), rope=family.local_rope_base)
    if "rope_freqs.weight" in tensors:  # llama 3's per-frequency divisors
        vector("rope_factors", "rope_freqs.weight", hd // 2)
    out_of = {"q": heads * hd, "k": kv_heads * hd, "v": kv_heads * hd}
    for i in range(layers):
        for name, as_name in norms:
            vector(f"{i}.{as_name}", f"blk.{i}.{name}.weight", hd if as_name in ("q_norm", "k_norm") else dim)
        for key in shapes:
            matrix(f"{i}.{key}")
            bias = f"blk.{i}.{PROJECTIONS[key]}.bias"
            if bias in tensors:
                vector(f"{i}.{key}.bias", bias, out_of[key])
    return plan


def extra_norms(family) -> list[tuple[str, str]]:
    """A family's per-layer norms beyond attn_norm and ffn_norm: (the GGUF's name, the step's)."""
    return ([("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")] if family.qk_norm else []) + (
        [("post_attention_norm", "post_attn_norm"), ("post_ffw_norm", "post_ffn_norm")] if family.sandwich_norms else [])


def _f32(x: float) -> float:
    import struct

    return struct.unpack("<f", struct.pack("<f", x))[0]
