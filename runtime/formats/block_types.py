"""Every GGUF block type RuvLLM reads, in one table: how the file stores a block (its GGUF id, weights and
bytes a block, as gguf-py's GGML_QUANT_SIZES and ggml's type traits have them) and how RuvLLM's engines
read the type at its own bits (the `kquant` number of the layouts, the bits, scale and zero-point layout,
and which engine reads it: the native kernels' MatMulQ4/MatMulQ8, their GatherQ, the page's WASM step).

The native kernels' table (runtime/backends/kernels/block_types.h), the WASM step's `enum kind`
(wasm/step/abi.h) and the page's JS table (web/src/formats.js) are generated from it
(runtime/formats/generate.py); block_layouts.py, step_weights.py and the GGUF readers read it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPER = 256  # a K-quant's super-block

# a type's scale layout in RuvLLM's own-bit layouts: "kquant" (q, d, dmin, sc, m as bytes), "kquant4" (the
# same with sc | m << 4 in a byte), "six" (q, d, int8 sc, a zero point), "half" (q, d, a zero point),
# "halfmin" (q, d, m)
SCALES = ("kquant", "six", "half", "halfmin", "kquant4")


@dataclass(frozen=True)
class BlockType:
    """One GGUF tensor type: the file's block, and (kind > 0) RuvLLM's reading of it at its own bits."""

    name: str
    ggml: int  # the GGUF file's type id (ggml_type)
    elems: int  # weights in one of the file's blocks
    nbytes: int  # bytes of one of the file's blocks
    kind: int = 0  # the layouts' `kquant` attribute (1 and up); 0: no own-bit layout (a float type)
    bits: int = 0  # bits a weight: 2 to 6 as fields (see `fields`), 8 for Q8_0 (a whole byte)
    block: int = 0  # weights a scale covers
    zero: int = 0  # the zero point (0: the type has minimums instead)
    scales: str = ""  # one of SCALES
    superblock: int = 32  # K must be a multiple of it (SUPER for the K-quants)
    op: str = "MatMulQ4"  # the native kernel that multiplies by it
    step: bool = False  # the page's WASM step computes on it (wasm/step/blocks.h)
    gather: bool = False  # the native GatherQ reads an embedding table of it (kernels/gather_blocks.h)

    @property
    def mins(self) -> bool:
        """Whether a block has a minimum (w = scale * q + minimum) rather than a zero point."""
        return self.zero == 0

    @property
    def kquant(self) -> bool:
        """A K-quant: scales per block inside super-blocks of 256 with their own fp16 d (and dmin)."""
        return self.superblock == SUPER

    @property
    def planes(self) -> int:
        """The WASM step's bit planes above a weight's nibble (Q5_*: 1, Q6_K: 2)."""
        return max(self.bits - 4, 0) if self.bits < 8 else 0

    @property
    def fields(self) -> tuple[tuple[int, int], ...]:
        """(width, bit position) of each line kind a weight's bits are stored in, in the native layout's
        order: a nibble (4 bits at 0) where bits >= 4, then a 2-bit field, then a 1-bit one, each above the
        last (Q6_K: 4 + 2, Q5: 4 + 1, Q3_K: 2 + 1, Q2_K: 2)."""
        out, at = [], 0
        for width in (4, 2, 1):
            if self.bits & width:
                out.append((width, at))
                at += width
        return tuple(out)


BLOCK_TYPES: tuple[BlockType, ...] = (
    BlockType("F32", 0, 1, 4),
    BlockType("F16", 1, 1, 2),
    BlockType("BF16", 30, 1, 2),
    BlockType("Q4_K", 12, 256, 144, kind=1, bits=4, block=32, scales="kquant", superblock=SUPER, step=True, gather=True),
    BlockType("Q6_K", 14, 256, 210, kind=2, bits=6, block=16, zero=32, scales="six", superblock=SUPER, step=True,
              gather=True),
    BlockType("Q5_K", 13, 256, 176, kind=3, bits=5, block=32, scales="kquant", superblock=SUPER, step=True),
    BlockType("Q5_0", 6, 32, 22, kind=4, bits=5, block=32, zero=16, scales="half", step=True),
    BlockType("Q4_0", 2, 32, 18, kind=5, bits=4, block=32, zero=8, scales="half", step=True),
    BlockType("Q4_1", 3, 32, 20, kind=6, bits=4, block=32, scales="halfmin", step=True),
    BlockType("Q5_1", 7, 32, 24, kind=7, bits=5, block=32, scales="halfmin", step=True),
    # MatMulQ8's (kernels/matmul_q8.h): the int8 weights stored as q + 128 unsigned, zero point 128
    BlockType("Q8_0", 8, 32, 34, kind=8, bits=8, block=32, zero=128, scales="half", op="MatMulQ8", step=True,
              gather=True),
    # the 2- and 3-bit K-quants, blocks of 16: Q3_K d * (sc - 32) * (q - 4) (its high-mask bit is q's bit 2),
    # Q2_K d * sc * q - dmin * m (4-bit sc and m)
    BlockType("Q3_K", 11, 256, 110, kind=9, bits=3, block=16, zero=4, scales="six", superblock=SUPER),
    BlockType("Q2_K", 10, 256, 84, kind=10, bits=2, block=16, scales="kquant4", superblock=SUPER),
)

BY_NAME = {t.name: t for t in BLOCK_TYPES}
OWN = {t.name: t for t in sorted(BLOCK_TYPES, key=lambda t: t.kind) if t.kind}  # the types read at their own bits
BY_KIND = {t.kind: t.name for t in OWN.values()}
STEP_TYPES = tuple(name for name, t in OWN.items() if t.step)
GATHER_TYPES = tuple(name for name, t in OWN.items() if t.gather)
# MatMulQ4's kquant for an int4 grid the exporter writes in the kernel's layout (not a GGUF type)
GRID_KIND = max(BY_KIND) + 1


def own_sections(t: BlockType, n: int, k: int) -> tuple[int, int, int]:
    """Bytes of a native own-bit layout's sections for [n, k]: weights (their field lines), scale bytes,
    fp16 scales."""
    blocks, supers = n * (k // t.block), n * (k // SUPER)
    sc, half = {"kquant": (blocks * 2, supers * 4), "kquant4": (blocks, supers * 4), "six": (blocks, supers * 2),
                "half": (0, blocks * 2), "halfmin": (0, blocks * 4)}[t.scales]
    return n * k * t.bits // 8, sc, half
