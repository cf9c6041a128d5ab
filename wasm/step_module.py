"""The page's WASM decode step (wasm/step/step.c): built with zig cc (PyPI `ziglang`, no other wasm32
compiler needed) and, for tests and native comparisons, hosted in wasmtime (PyPI `wasmtime`), where it
runs the engine's StepBatches as the page will.

The module's structs are packed by field name through runtime/formats/step_abi.py, the one description
that wasm/step/abi.h is generated from.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from runtime.formats import step_abi
from runtime.formats.block_types import OWN
from runtime.formats.step_abi import LEARN_REFUSALS, REFUSALS, offset, pack, pack_array, sizeof

SOURCE = Path(__file__).resolve().parent / "step" / "step.c"
# -mrelaxed-simd: clang fuses step.c's multiply-adds into f32x4.relaxed_madd, which Chromium and wasmtime run
# as FMA: the native engine's rounding (SmolLM2 against it: mean KL 0.0033 and greedy 64 / 64 tokens,
# against 0.0042 and 35 / 64 unfused) and faster. Node 20 needs --experimental-wasm-relaxed-simd.
FLAGS = ["--target=wasm32-freestanding", "-O3", "-msimd128", "-mrelaxed-simd", "-nostdlib", "-Wl,--no-entry",
         "-Wl,--export-dynamic"]


# For browsers without relaxed SIMD (the page falls back to it when step.wasm does not compile): SIMD128
# products, no fused multiply-adds
PLAIN_FLAGS = [f for f in FLAGS if f != "-mrelaxed-simd"] + ["-DPLAIN_SIMD"]
FALLBACK = "step-simd128.wasm"  # beside step.wasm
# With threads (wasm/step/threads.h): the memory is imported and shared, so that helper instances in other
# workers run on it; each instance's stack pointer is exported so that a helper gets a stack of its own.
# A page that is not cross-origin isolated has no shared memory and runs step.wasm.
THREAD_FLAGS = FLAGS + ["-matomics", "-mbulk-memory", "-DSTEP_THREADS", "-Wl,--shared-memory", "-Wl,--import-memory",
                        "-Wl,--max-memory=4294901760", "-Wl,--export=__stack_pointer"]
THREADED = "step-threads.wasm"  # beside step.wasm


def build(out: str | Path, relaxed: bool = True, threads: bool = False) -> Path:
    """Compile step.c to `out` (a .wasm file); relaxed=False: the SIMD128-only fallback; threads=True: the
    shared-memory build (relaxed SIMD)."""
    try:
        import ziglang  # noqa: F401
    except ImportError as err:
        raise RuntimeError("building the WASM step needs the ziglang package: pip install ziglang") from err
    out = Path(out)
    flags = THREAD_FLAGS if threads else FLAGS if relaxed else PLAIN_FLAGS
    subprocess.run([sys.executable, "-m", "ziglang", "cc", *flags, "-o", str(out), str(SOURCE)], check=True,
                   capture_output=True)
    return out


def _shared_memory(engine, pages: int):
    """A shared memory of `pages` pages (growing to 4 GB) an instance can import: wasmtime-py 50's own
    SharedMemory passes a pointer to its pointer when imported (bytecodealliance/wasmtime-py#318)."""
    import wasmtime
    from wasmtime import _ffi as ffi

    class Shared(wasmtime.SharedMemory):
        def _as_extern(self):
            return ffi.wasmtime_extern_t(ffi.WASMTIME_EXTERN_SHAREDMEMORY, ffi.wasmtime_extern_union(sharedmemory=self.ptr()))

    return Shared(engine, wasmtime.MemoryType(wasmtime.Limits(pages, 65535), shared=True))


class _SharedBytes:
    """A shared memory read and written as wasmtime's Memory is (wasmtime's SharedMemory has only a
    pointer)."""

    def __init__(self, shared) -> None:
        self.shared = shared

    def _address(self, start: int, size: int) -> int:
        import ctypes

        if start < 0 or start + size > self.shared.data_len():
            raise IndexError(f"bytes {start}..{start + size} are outside the WASM step's memory")
        return ctypes.addressof(self.shared.data_ptr().contents) + start

    def read(self, store, start: int, stop: int) -> bytes:
        import ctypes

        return ctypes.string_at(self._address(start, stop - start), stop - start)

    def write(self, store, data: bytes, start: int) -> None:
        import ctypes

        ctypes.memmove(self._address(start, len(data)), data, len(data))


class WasmStep:
    """step.wasm in wasmtime over a weights directory (step.bin, step.json: exporter/step_weights.py), with
    a KV pool of num_blocks blocks of block_size and room for steps of max_tokens tokens (and rows) and
    max_logits logits rows. threads > 1: `wasm` is the threaded build (step-threads.wasm), with threads - 1
    helpers, each an instance in a Python thread of its own (wasmtime runs without the GIL); close() ends
    them. kv_dtype "int8" or "int4": a quantized pool with exact tails (wasm/step/kv.h), whose tokens to keep
    and block -> tail slot changes each run is given (runtime/core/kv_tails.TailSlots)."""

    def __init__(self, wasm: str | Path, weights: str | Path, num_blocks: int, block_size: int,
                 max_tokens: int = 512, max_logits: int = 64, threads: int = 1, kv_dtype: str = "fp32",
                 tail_blocks: int = 2) -> None:
        import wasmtime

        weights = Path(weights)
        index = json.loads((weights / "step.json").read_text())
        self.cfg = cfg = index["config"]
        self.num_blocks, self.block_size = num_blocks, block_size
        blob = (weights / "step.bin").read_bytes()
        self._helpers: list = []
        if threads > 1:
            config = wasmtime.Config()
            config.wasm_threads = config.shared_memory = True
            engine = wasmtime.Engine(config)
            module = wasmtime.Module.from_file(engine, str(wasm))
            pages = -(-(len(blob) + (16 << 20)) // 65536)  # the weights and room: more than the module's data and stack
            shared = _shared_memory(engine, pages)
            self.store = wasmtime.Store(engine)
            exports = wasmtime.Instance(self.store, module, [shared]).exports(self.store)
            self.memory = _SharedBytes(shared)
        else:
            self.store = wasmtime.Store(wasmtime.Engine())
            instance = wasmtime.Instance(self.store, wasmtime.Module.from_file(self.store.engine, str(wasm)), [])
            exports = instance.exports(self.store)
            self.memory = exports["memory"]
        self._exports = exports
        self._arena, self._run = exports["arena"], exports["step_run"]
        self._sample = exports["step_sample"]
        self._scratch_at: dict[str, tuple[int, int]] = {}  # name -> (pointer, bytes): grown, never freed
        at = {a["name"]: self._put(blob[a["offset"]:a["offset"] + a["bytes"]]) for a in index["arrays"]}
        self._types, self._bytes = index["matrices"], {a["name"]: a["bytes"] for a in index["arrays"]}
        self.model = self._model(index, at)
        self.kv_dtype = kv_dtype
        self.pool = self._put(self._pool_struct(num_blocks, block_size, kv_dtype, tail_blocks))
        self._tail_slots: list[int] = []  # each tail slot's address
        if exports["step_init"](self.store, self.model, max_tokens) != max_tokens:
            raise MemoryError(f"the WASM step cannot hold steps of {max_tokens} tokens")
        self.max_tokens, self.max_logits = max_tokens, max_logits
        self.max_blocks = -(-cfg["max_pos"] // block_size)
        # the batch's arrays, made once: ids, pos, slots, row_first, row_count, logits_at, tables, exact_from,
        # keep; logits
        self._ints_at = ([self._alloc(4 * max_tokens) for _ in range(6)] + [self._alloc(4 * max_tokens * self.max_blocks)]
                         + [self._alloc(4 * max_tokens) for _ in range(2)])
        self._logits = self._alloc(4 * max_logits * cfg["vocab"])
        self._batch = self._alloc(sizeof("Batch"))
        self._learn_room = 0  # tokens step_learn's scratch holds (learn_init, at the first learn)
        if threads > 1:
            self._start_helpers(engine, module, shared, threads - 1)

    def _pool_struct(self, num_blocks: int, block_size: int, kv_dtype: str, tail_blocks: int) -> bytes:
        """step.c's Pool: the rows and scales of each kind (runtime/core/kv_blocks.py's widths), the tails' map."""
        from runtime.core.kv_blocks import kv_row_bytes, kv_scale_widths

        cfg = self.cfg
        d, rows = cfg["head_dim"], cfg["layers"] * cfg["kv_heads"] * num_blocks * block_size
        widths = kv_scale_widths(d, kv_dtype)
        pools = [self._alloc(rows * (kv_row_bytes(d, kv_dtype, k) - 2 * widths[k])) for k in range(2)]  # numbers
        pool = {"num_blocks": num_blocks, "block_size": block_size, "k": pools[0], "v": pools[1],
                "dtype": step_abi.KV_DTYPES.index(kv_dtype), "ks": 0, "vs": 0, "tail_blocks": 0, "tail_of": 0, "tails": 0}
        if kv_dtype == "fp32":
            return pack("Pool", pool)
        scales = [self._alloc(2 * rows * w) for w in widths]
        self._tail_of = self._put(struct.pack(f"<{num_blocks}i", *[-1] * num_blocks))
        self._tail_table, self._tail_room = 0, 0
        self._tail_bytes = 2 * cfg["layers"] * cfg["kv_heads"] * block_size * d * 4
        return pack("Pool", {**pool, "ks": scales[0], "vs": scales[1], "tail_blocks": tail_blocks, "tail_of": self._tail_of})

    def _tails(self, changes: list[tuple[int, int]]) -> None:
        """Apply a step's block -> tail slot changes, making room for slots not seen before."""
        for block, slot in changes:
            while slot >= len(self._tail_slots):
                self._tail_slots.append(self._alloc(self._tail_bytes))
            self.memory.write(self.store, struct.pack("<i", slot), self._tail_of + 4 * block)
        if len(self._tail_slots) > self._tail_room:  # the table of slot addresses, grown twice the size
            self._tail_room = 2 * len(self._tail_slots)
            self._tail_table = self._alloc(4 * self._tail_room)
            self.memory.write(self.store, struct.pack("<I", self._tail_table), self.pool + offset("Pool", "tails"))
        if self._tail_slots:
            self.memory.write(self.store, struct.pack(f"<{len(self._tail_slots)}I", *self._tail_slots), self._tail_table)

    def _start_helpers(self, engine, module, shared, count: int, stack: int = 1 << 18) -> None:
        import threading
        import time

        import wasmtime

        def helper(top: int) -> None:
            store = wasmtime.Store(engine)
            exports = wasmtime.Instance(store, module, [shared]).exports(store)
            exports["__stack_pointer"].set_value(store, wasmtime.Val.i32(top))
            exports["step_helper"](store)  # until close()

        for _ in range(min(count, self._exports["step_max_threads"](self.store) - 1)):
            thread = threading.Thread(target=helper, args=(self._alloc(stack) + stack,), daemon=True)
            thread.start()
            self._helpers.append(thread)
        deadline = time.monotonic() + 30
        while self.threads < len(self._helpers) + 1:
            if time.monotonic() > deadline or not all(t.is_alive() for t in self._helpers):
                raise RuntimeError(f"the WASM step's helpers did not start ({self.threads - 1} of {len(self._helpers)})")
            time.sleep(0.002)

    def _model(self, index: dict, at: dict[str, int]) -> int:
        """step.c's Model and its Layers over arrays placed at `at` (name -> address), as
        web/src/wasm_step.js builds them."""
        from runtime.formats.step_abi import MATRICES, PARTS

        cfg = index["config"]

        def qmat(name: str) -> dict:  # the matrix's kind, then its parts' addresses (0: none)
            return {"kind": cfg["kinds"][index["matrices"][name]], **{part: at.get(f"{name}.{part}", 0) for part in PARTS}}

        layers = self._put(pack_array("Layer", [
            {"attn_norm": at[f"{i}.attn_norm"], "ffn_norm": at[f"{i}.ffn_norm"],
             "bias": [at.get(f"{i}.{p}.bias", 0) for p in "qkv"], "mat": [qmat(f"{i}.{p}") for p in MATRICES],
             **{n: at.get(f"{i}.{n}", 0) for n in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")},
             "window": cfg.get("windows", [0] * cfg["layers"])[i], "rope": at[cfg.get("layer_rope", ["rope"] * cfg["layers"])[i]]}
            for i in range(cfg["layers"])]))
        fields = ("dim", "hidden", "layers", "heads", "kv_heads", "head_dim", "vocab", "max_pos", "eps")
        model = self._put(pack("Model", {**{f: cfg[f] for f in fields}, "rope_neox": int(cfg["rope_neox"]),
                                         "act": cfg.get("act", 0), "embed_scale": cfg.get("embed_scale", 1.0),
                                         "attn_scale": cfg.get("attn_scale", cfg["head_dim"] ** -0.5),
                                         "embd": qmat("embd"), "head": qmat("head" if "head" in index["matrices"] else "embd"),
                                         "out_norm": at["out_norm"], "rope": at["rope"],
                                         "rope_factors": at.get("rope_factors", 0), "layer": layers}))
        self.matrices = {"embd": model + offset("Model", "embd"), "head": model + offset("Model", "head")}  # name -> its QMat
        for i in range(cfg["layers"]):
            for j, p in enumerate(MATRICES):
                self.matrices[f"{i}.{p}"] = layers + i * sizeof("Layer") + offset("Layer", "mat") + j * sizeof("QMat")
        return model

    def project(self, name: str, x: np.ndarray) -> np.ndarray:
        """Matrix `name` ("embd", "head", "0.q", ...) times the rows of x [T, K] as step_run computes a
        projection (x rounded per block of 32): [T, N]."""
        x = np.ascontiguousarray(x, np.float32)
        t, k = x.shape
        stored = name if name in self._types else "embd"  # a tied head is the embedding
        n = self._bytes[f"{stored}.w"] // (k if OWN[self._types[stored]].bits == 8 else k // 2)  # its rows, from its weights
        xp, yp = self._scratch("project_x", x.tobytes()), self._scratch("project_y", bytes(4 * t * n))
        if self._exports["step_project"](self.store, self.matrices[name], n, k, t, xp, yp):
            raise ValueError(f"step_project: {t} rows of {k} is more than the step holds")
        return np.frombuffer(self.memory.read(self.store, yp, yp + 4 * t * n), np.float32).reshape(t, n)

    def quantize_kv(self, x: np.ndarray, kv_dtype: str, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows x [T, D] as the step writes them into an int8 or int4 pool for keys (kind 0) or values (1):
        (numbers [T, D] int8 or [T, D / 2] uint8, fp16 scales [T, width])."""
        from runtime.core.kv_blocks import kv_scale_widths

        x = np.ascontiguousarray(x, np.float32)
        t, d = x.shape
        width, int4 = kv_scale_widths(d, kv_dtype)[kind], kv_dtype == "int4"
        numbers = d // 2 if int4 else d
        xp = self._scratch("kv_x", x.tobytes())
        qp, sp = self._scratch("kv_q", bytes(t * numbers)), self._scratch("kv_s", bytes(2 * t * width))
        self._exports["step_kv_quantize"](self.store, 2 if int4 else 1, kind, xp, t, d, qp, sp)
        q = np.frombuffer(self.memory.read(self.store, qp, qp + t * numbers), np.uint8 if int4 else np.int8)
        s = np.frombuffer(self.memory.read(self.store, sp, sp + 2 * t * width), np.float16)
        return q.reshape(t, numbers).copy(), s.reshape(t, width).copy()

    def kv_read(self, kv_dtype: str, q: np.ndarray, numbers: np.ndarray, scales: np.ndarray, w: float) -> tuple[float, np.ndarray]:
        """How the step reads one stored row (quantize_kv's numbers and scales): its score against q as a key,
        and w times it as a value (an int4 row's left in the rotated space, as the step sums them)."""
        d = q.shape[0]
        qp = self._scratch("kv_qn", np.ascontiguousarray(q, np.float32).tobytes())
        rp, sp = self._scratch("kv_row", numbers.tobytes()), self._scratch("kv_scales", scales.tobytes())
        code = 2 if kv_dtype == "int4" else 1
        score = self._exports["step_kv_dot"](self.store, code, qp, rp, sp, d)
        acc = self._scratch("kv_acc", bytes(4 * d))
        self._exports["step_kv_add"](self.store, code, w, rp, sp, d, acc)
        return score, np.frombuffer(self.memory.read(self.store, acc, acc + 4 * d), np.float32).copy()

    def dequantize(self, name: str, row: int, k: int) -> np.ndarray:
        """Row `row` of matrix `name` in fp32, as the step's embedding lookup reads it."""
        out = self._scratch("dequantize", bytes(4 * k))
        self._exports["step_dequantize"](self.store, self.matrices[name], row, k, out)
        return np.frombuffer(self.memory.read(self.store, out, out + 4 * k), np.float32)

    @property
    def threads(self) -> int:
        """Threads that split each step (1 + the helpers inside step_helper)."""
        return self._exports["step_threads"](self.store)

    def close(self) -> None:
        """The helpers leave step_helper and their threads end."""
        self._exports["step_stop"](self.store)
        for thread in self._helpers:
            thread.join(timeout=30)
        self._helpers = []

    def _alloc(self, size: int) -> int:
        ptr = 0
        if 0 <= size < 1 << 32:  # wasm32 i32s: a size or an address past 2 GB crosses as a negative number
            ptr = self._arena(self.store, size - (1 << 32) if size >= 1 << 31 else size) & 0xFFFFFFFF
        if not ptr:
            raise MemoryError(f"the WASM step's memory cannot grow by {size} bytes")
        return ptr

    def _put(self, data: bytes) -> int:
        ptr = self._alloc(len(data))
        self.memory.write(self.store, data, ptr)
        return ptr

    def run(self, batch, kept: list[int] = (), changes: list[tuple[int, int]] = ()) -> np.ndarray:
        """A StepBatch (runtime/core/step_batch.py): its K/V into the pool, the logits of its logits rows
        [num_logits, vocab]. A quantized pool's: the tokens whose rows its tails keep too and the block ->
        tail slot changes before it (TailSlots.step_slots)."""
        if self.kv_dtype != "fp32":
            self._tails(list(changes))
        n, rows, logits = len(batch.input_ids), len(batch.block_tables), len(batch.logits_index)
        if n > self.max_tokens or logits > self.max_logits or batch.max_blocks > self.max_blocks:
            raise ValueError(f"a step of {n} tokens, {logits} logits rows and {batch.max_blocks} blocks a row is "
                             f"more than this WasmStep holds")
        first = [q[0] for q in batch.query_index]
        count = [q[-1] - q[0] + 1 for q in batch.query_index]
        keep = np.zeros(n, np.int32)
        keep[list(kept)] = 1
        arrays = [batch.input_ids, batch.position_ids, batch.kv_slots, first, count, batch.logits_index,
                  [b for table in batch.block_tables for b in table], batch.exact_from or [0] * rows, keep]
        for ptr, values in zip(self._ints_at, arrays):
            self.memory.write(self.store, np.asarray(values, np.int32).tobytes(), ptr)
        ids, pos, slots, row_first, row_count, logits_at, tables, exact_from, keep_at = self._ints_at
        self.memory.write(self.store, pack("Batch", {
            "num_tokens": n, "num_rows": rows, "max_blocks": batch.max_blocks, "num_logits": logits, "ids": ids, "pos": pos,
            "slots": slots, "row_first": row_first, "row_count": row_count, "tables": tables, "logits_at": logits_at,
            "logits": self._logits, "lora": 0, "exact_from": exact_from, "keep": keep_at}), self._batch)
        status = self._run(self.store, self.model, self.pool, self._batch)
        if status:
            raise ValueError("the WASM step refused the batch: " + REFUSALS.get(status, f"status {status}"))
        out = self.memory.read(self.store, self._logits, self._logits + 4 * logits * self.cfg["vocab"])
        return np.frombuffer(out, np.float32).reshape(logits, self.cfg["vocab"])

    TARGETS = step_abi.TARGETS

    def learn(self, ids: list[int], factors: dict, scale: float, scored_from: int = 0, unlikely: bool = False,
              exact: bool = False) -> tuple[float, dict]:
        """step_learn (wasm/step/learn.h): the text's loss under a LoRA and its factors' gradients.
        factors: {(layer, target): (A [rank, in], B^T [rank, out])}, q and k's B in the step's row order;
        the gradients in the same shapes. exact: fp32 products (the native trainer's numbers)."""
        rank = next(iter(factors.values()))[0].shape[0]
        if self._learn_room < len(ids):
            room = max(len(ids), 64)
            if self._exports["learn_init"](self.store, self.model, room) != room:
                raise MemoryError(f"the WASM step cannot learn from {room} tokens")
            self._learn_room = room
        layers, width = self.cfg["layers"], len(self.TARGETS)
        tables = [[0] * (width * layers) for _ in range(4)]
        for (layer, target), (a, bt) in factors.items():
            at = width * layer + self.TARGETS.index(target)
            name = f"learn.{layer}.{target}"
            tables[0][at] = self._scratch(name + ".a", np.ascontiguousarray(a, np.float32).tobytes())
            tables[1][at] = self._scratch(name + ".b", np.ascontiguousarray(bt, np.float32).tobytes())
            tables[2][at] = self._scratch(name + ".ga", bytes(4 * a.size))
            tables[3][at] = self._scratch(name + ".gb", bytes(4 * bt.size))
        ptrs = [self._scratch(f"learn.table{i}", struct.pack(f"<{width * layers}I", *t)) for i, t in enumerate(tables)]
        ids_at = self._scratch("learn.ids", np.asarray(ids, np.int32).tobytes())
        loss_at = self._scratch("learn.loss", bytes(4))
        spec = self._scratch("learn", pack("Learn", {
            "num_tokens": len(ids), "scored_from": scored_from, "unlikely": int(unlikely), "exact": int(exact), "rank": rank,
            "scale": scale, "ids": ids_at, "a": ptrs[0], "b": ptrs[1], "ga": ptrs[2], "gb": ptrs[3], "loss": loss_at}))
        status = self._exports["step_learn"](self.store, self.model, spec)
        if status:
            raise ValueError(f"the WASM step's trainer refused a {self.cfg.get('arch')} text of {len(ids)} tokens: "
                             + LEARN_REFUSALS.get(status, f"status {status}"))
        read = lambda ptr, n: np.frombuffer(self.memory.read(self.store, ptr, ptr + 4 * n), np.float32)  # noqa: E731
        grads = {}
        for (layer, target), (a, bt) in factors.items():
            at = width * layer + self.TARGETS.index(target)
            grads[(layer, target)] = (read(tables[2][at], a.size).reshape(a.shape).copy(),
                                      read(tables[3][at], bt.size).reshape(bt.shape).copy())
        return float(read(loss_at, 1)[0]), grads

    def weight_rms(self, layer: int, target: str, rows: int, cols: int) -> float:
        """learn_weight_rms: the RMS of a layer's matrix as the step reads it (what a page user's factors
        step by a share of); learn_init's room must exist."""
        from runtime.formats.step_abi import MATRICES

        if not self._learn_room:
            self._exports["learn_init"](self.store, self.model, 64)
            self._learn_room = 64
        return float(self._exports["learn_weight_rms"](self.store, self.model, layer,
                                                        MATRICES.index(target.removesuffix("_proj")), rows, cols))

    def adam(self, w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, lr: float,
             fisher: np.ndarray | None = None, start: np.ndarray | None = None, ewc: float = 0.0) -> tuple:
        """learn_adam on copies of float32 arrays: (w, m, v) after Adam's step t."""
        n = w.size
        arrays = [w, g, m, v, fisher if fisher is not None else np.zeros_like(w), start if start is not None else w]
        ptrs = [self._scratch(f"adam{i}", np.ascontiguousarray(x, np.float32).tobytes()) for i, x in enumerate(arrays)]
        c1, c2 = np.float32(1 - 0.9 ** t), np.float32(1 - 0.999 ** t)
        self._exports["learn_adam"](self.store, n, *ptrs, ewc, lr, float(c1), float(c2))
        read = lambda ptr: np.frombuffer(self.memory.read(self.store, ptr, ptr + 4 * n), np.float32).reshape(w.shape)  # noqa: E731
        return read(ptrs[0]).copy(), read(ptrs[2]).copy(), read(ptrs[3]).copy()

    def _scratch(self, name: str, data: bytes) -> int:
        """`data` in a buffer kept for `name` (made larger, twice the size, when it no longer fits)."""
        ptr, size = self._scratch_at.get(name, (0, 0))
        if len(data) > size:
            size = max(64, 2 * len(data))
            ptr = self._alloc(size)
            self._scratch_at[name] = (ptr, size)
        if data:
            self.memory.write(self.store, data, ptr)
        return ptr

    def sample(self, batch, mask: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The last run's logits rows through the graph's processing (step_sample): each row's top_k
        candidates and their log-probabilities, [num_logits, top_k] each. `mask`: per row a bitmask
        (bytes, bit i = token i allowed) or None."""
        rows, k, vocab = len(batch.logits_index), min(batch.top_k, self.cfg["vocab"]), self.cfg["vocab"]
        width = len(batch.sparse_ids[0]) if rows else 0
        f32 = lambda name, v: self._scratch(name, np.asarray(v, np.float32).tobytes())  # noqa: E731
        fields = {"temperature": f32("temperature", batch.temperature),
                  "repetition": f32("repetition", batch.repetition_penalty),
                  "presence": f32("presence", batch.presence_penalty), "frequency": f32("frequency", batch.frequency_penalty),
                  "sparse_ids": self._scratch("sparse_ids", np.asarray(batch.sparse_ids, np.int32).tobytes()),
                  "sparse_seen": f32("seen", batch.sparse_seen), "sparse_counts": f32("counts", batch.sparse_counts),
                  "sparse_bias": f32("bias", batch.sparse_bias), "mask": 0}
        if mask is not None and any(m is not None for m in mask):
            full = bytes([255]) * ((vocab + 7) // 8)
            fields["mask"] = self._scratch("mask", b"".join(full if m is None else bytes(m) for m in mask))
        out_ids, out_values, out_stats = (self._scratch(n, bytes(4 * size)) for n, size in
                                          (("ids", rows * k), ("values", rows * k), ("stats", 2 * rows)))
        spec = self._scratch("sampling", pack("Sampling", {
            "num_logits": rows, "num_sparse": width, "top_k": k, **fields, "logits": self._logits, "out_ids": out_ids,
            "out_values": out_values, "out_stats": out_stats}))
        if self._sample(self.store, self.model, spec):
            raise ValueError(f"the WASM step cannot sample top {k} of {rows} rows")
        read = lambda ptr, n, t: np.frombuffer(self.memory.read(self.store, ptr, ptr + 4 * n), t)  # noqa: E731
        ids = read(out_ids, rows * k, np.int32).reshape(rows, k)
        values = read(out_values, rows * k, np.float32).reshape(rows, k).astype(np.float64)
        stats = read(out_stats, 2 * rows, np.float32).reshape(rows, 2).astype(np.float64)
        return ids, values - (stats[:, :1] + np.log(stats[:, 1:]))
