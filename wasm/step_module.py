"""The page's WASM decode step (wasm/step/step.c): built with zig cc (PyPI `ziglang`, no other wasm32
compiler needed) and, for tests and native comparisons, hosted in wasmtime (PyPI `wasmtime`), where it
runs the engine's StepBatches as the page will.

The module's structs are wasm32 (4-byte ints, floats and pointers), written here field by field in the
order step.c declares them.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parent / "step" / "step.c"
# -mrelaxed-simd: clang fuses step.c's multiply-adds into f32x4.relaxed_madd, which Chromium and wasmtime run
# as FMA: the native engine's rounding (SmolLM2 against it: mean KL 0.0033 and greedy 64 / 64 tokens,
# against 0.0042 and 35 / 64 unfused) and faster. Node 20 needs --experimental-wasm-relaxed-simd.
FLAGS = ["--target=wasm32-freestanding", "-O3", "-msimd128", "-mrelaxed-simd", "-nostdlib", "-Wl,--no-entry",
         "-Wl,--export-dynamic"]
LAYER_FIELDS = 23  # attn_norm, q/k/v/o (w, d, m each), ffn_norm, gate/up/down (w, d, m each)


def build(out: str | Path) -> Path:
    """Compile step.c to `out` (a .wasm file)."""
    try:
        import ziglang  # noqa: F401
    except ImportError as err:
        raise RuntimeError("building the WASM step needs the ziglang package: pip install ziglang") from err
    out = Path(out)
    subprocess.run([sys.executable, "-m", "ziglang", "cc", *FLAGS, "-o", str(out), str(SOURCE)], check=True,
                   capture_output=True)
    return out


class WasmStep:
    """step.wasm in wasmtime over a weights directory (step.bin, step.json: exporter/step_weights.py), with
    a KV pool of num_blocks blocks of block_size and room for steps of max_tokens tokens (and rows) and
    max_logits logits rows."""

    def __init__(self, wasm: str | Path, weights: str | Path, num_blocks: int, block_size: int,
                 max_tokens: int = 512, max_logits: int = 64) -> None:
        import wasmtime

        weights = Path(weights)
        index = json.loads((weights / "step.json").read_text())
        self.cfg = cfg = index["config"]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.store = wasmtime.Store(wasmtime.Engine())
        instance = wasmtime.Instance(self.store, wasmtime.Module.from_file(self.store.engine, str(wasm)), [])
        exports = instance.exports(self.store)
        self.memory, self._arena, self._run = exports["memory"], exports["arena"], exports["step_run"]
        blob = (weights / "step.bin").read_bytes()
        at = {}
        for a in index["arrays"]:
            at[a["name"]] = self._put(blob[a["offset"]:a["offset"] + a["bytes"]])
        layers = []
        for i in range(cfg["layers"]):
            layers.append(at[f"{i}.attn_norm"])
            for p in ("q", "k", "v", "o"):
                layers += [at[f"{i}.{p}.{part}"] for part in "wdm"]
            layers.append(at[f"{i}.ffn_norm"])
            for p in ("gate", "up", "down"):
                layers += [at[f"{i}.{p}.{part}"] for part in "wdm"]
        table = self._put(struct.pack(f"<{len(layers)}I", *layers))
        self.model = self._put(struct.pack("<8if5I", cfg["dim"], cfg["hidden"], cfg["layers"], cfg["heads"],
                                           cfg["kv_heads"], cfg["head_dim"], cfg["vocab"], cfg["max_pos"], cfg["eps"],
                                           at["embd"], at["embd_d"], at["out_norm"], at["rope"], table))
        rows = cfg["layers"] * cfg["kv_heads"] * num_blocks * block_size * cfg["head_dim"] * 4
        self.pool = self._put(struct.pack("<2i2I", num_blocks, block_size, self._alloc(rows), self._alloc(rows)))
        if exports["step_init"](self.store, self.model, max_tokens) != max_tokens:
            raise MemoryError(f"the WASM step cannot hold steps of {max_tokens} tokens")
        self.max_tokens, self.max_logits = max_tokens, max_logits
        self.max_blocks = -(-cfg["max_pos"] // block_size)
        # the batch's arrays, made once: ids, pos, slots, row_first, row_count, logits_at, tables; logits
        self._ints_at = [self._alloc(4 * max_tokens) for _ in range(6)] + [self._alloc(4 * max_tokens * self.max_blocks)]
        self._logits = self._alloc(4 * max_logits * cfg["vocab"])
        self._batch = self._alloc(48)

    def _alloc(self, size: int) -> int:
        ptr = self._arena(self.store, size)
        if not ptr:
            raise MemoryError(f"the WASM step's memory cannot grow by {size} bytes")
        return ptr

    def _put(self, data: bytes) -> int:
        ptr = self._alloc(len(data))
        self.memory.write(self.store, data, ptr)
        return ptr

    def run(self, batch) -> np.ndarray:
        """A StepBatch (runtime/core/step_batch.py): its K/V into the pool, the logits of its logits rows
        [num_logits, vocab]."""
        n, rows, logits = len(batch.input_ids), len(batch.block_tables), len(batch.logits_index)
        if n > self.max_tokens or logits > self.max_logits or batch.max_blocks > self.max_blocks:
            raise ValueError(f"a step of {n} tokens, {logits} logits rows and {batch.max_blocks} blocks a row is "
                             f"more than this WasmStep holds")
        first = [q[0] for q in batch.query_index]
        count = [q[-1] - q[0] + 1 for q in batch.query_index]
        arrays = [batch.input_ids, batch.position_ids, batch.kv_slots, first, count, batch.logits_index,
                  [b for table in batch.block_tables for b in table]]
        for ptr, values in zip(self._ints_at, arrays):
            self.memory.write(self.store, np.asarray(values, np.int32).tobytes(), ptr)
        ids, pos, slots, row_first, row_count, logits_at, tables = self._ints_at
        self.memory.write(self.store, struct.pack("<4i8I", n, rows, batch.max_blocks, logits, ids, pos, slots,
                                                  row_first, row_count, tables, logits_at, self._logits), self._batch)
        status = self._run(self.store, self.model, self.pool, self._batch)
        if status:
            raise ValueError("the WASM step refused the batch: " + ("too many tokens" if status == 1 else
                                                                     "a position or slot out of range"))
        out = self.memory.read(self.store, self._logits, self._logits + 4 * logits * self.cfg["vocab"])
        return np.frombuffer(out, np.float32).reshape(logits, self.cfg["vocab"])
