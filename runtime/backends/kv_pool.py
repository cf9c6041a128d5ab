"""The native KV pool: one buffer per kind on the execution provider's device, written there.

Each kind (keys, values) is one OrtValue [layers, kv_heads, blocks * block_size, head_dim] on the
device the session runs on; each layer's graph input is bound by pointer to its slice, once. On a GPU
(CUDA) the pool is allocated there and a step's K/V (the graph's present.key / present.value, bound on
the same device) go into their slots through a small ONNX graph, one ScatterND per kind, whose output
is bound to the pool itself: onnxruntime then scatters in place (its ScatterND copies the input only
when the output is another buffer), so no KV tensor crosses to the host. On CPU the pool is host
memory (an anonymous mapping seen as numpy arrays), committed as the blocks in use grow (onnxruntime's
own allocation of it made a decode step ~1.3 ms slower here: the gathers over it), wrapped as
OrtValues, and the K/V are written with one numpy assignment per kind (0.05 ms where the ScatterND
graph took ~0.3 ms a step); `device_writes=True` runs the device path on
CPU, which is how it is tested here (CUDA itself is not, on these machines).

With kv_dtype "int8" (CPU only; read by ruvllm.PagedAttention or the graph's attention rewritten for it,
graph_rewrite.kv_in_int8 / kv_in_int8_graph) each kind is int8 rows whose groups of 32 numbers
(kv_group) have one fp16 scale each (their absolute maximum / 127): a quarter of the bytes plus 2 per
group; per group rather than per row because a key row's few large channels would otherwise coarsen all
the others (SmolLM2, decode-like steps: KL 0.0047 vs 0.0052 per row; docs/PERFORMANCE.md). Each token is
quantized as it is written (in one pass by the kernel library's ruvllm_kv_write_int8 where it is built,
bit for bit as quantize_rows; numpy otherwise). Where ruvllm.PagedAttention reads the pool it is two-tier (`tails`): the rows
of the blocks sequences are still writing are also kept in fp16 (the seed's FP16 hot tier: half fp32's bytes,
and KL against an fp32 pool as with fp32 tails; docs/PERFORMANCE.md), in tails [blocks, layers, kv_heads,
block_size, head_dim] committed only where written, and a query reads its own block from them,
and the block before it from its sequence's floor on (TAIL_BLOCKS; SmolLM2 in fp32: KL 0.00008 rather than
0.00057, greedy text on 20 prompts equal to the fp32 pool's on 18 rather than 13; docs/PERFORMANCE.md). A block's tail pages go back to the system once
no later step of its sequence reads it exact or the scheduler drops it.

With kv_dtype "int4" (read by ruvllm.PagedAttention only) each kind is packed 4-bit rows [layers, kv_heads,
slots, head_dim / 2] of Hadamard-rotated numbers and fp16 (scale, minimum) pairs per group
(quantize_rows_int4; keys in groups of 32, values 64: kv_blocks.kv_int4_groups), behind the same tails.
"""

from __future__ import annotations

import numpy as np

from runtime import contract as C
from runtime.core.kv_blocks import kv_group, kv_int4_groups, kv_scale_widths
from runtime.core.kv_tails import TAIL_BLOCKS, TailBlocks

POOL_KEY, POOL_VALUE, SLOTS = "pool.key", "pool.value", "kv_slots"
FIRST_BLOCKS = 16  # blocks committed when the pool is made; it doubles from there as blocks are used


def device_of(providers: list[str]) -> str:
    """onnxruntime's device name for memory the first provider computes on."""
    return "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"


def writer_graph(num_layers: int, kv_heads: int, head_dim: int) -> bytes:
    """pool[l, h, slot[n], :] = present[l, n, h, :] for every layer, head and new token, per kind."""
    from onnx import TensorProto, helper

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    pool_shape = [num_layers, kv_heads, "pool_slots", head_dim]
    present_shape = [num_layers, "num_tokens", kv_heads, head_dim]
    inputs = [helper.make_tensor_value_info(n, f32, pool_shape) for n in (POOL_KEY, POOL_VALUE)]
    inputs += [helper.make_tensor_value_info(n, f32, present_shape) for n in (C.PRESENT_KEY, C.PRESENT_VALUE)]
    inputs.append(helper.make_tensor_value_info(SLOTS, i64, ["num_tokens"]))
    outputs = [helper.make_tensor_value_info(n + ".out", f32, pool_shape) for n in (POOL_KEY, POOL_VALUE)]

    def const(name: str, values, dims) -> object:
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, i64, dims, values))

    nodes = [
        const("layer_ids", list(range(num_layers)), [num_layers, 1, 1, 1]),
        const("head_ids", list(range(kv_heads)), [1, kv_heads, 1, 1]),
        const("lead", [num_layers, kv_heads], [2]),
        const("one", [1], [1]),
        const("slot_shape", [1, 1, -1, 1], [4]),
        helper.make_node("Shape", [SLOTS], ["n"]),
        helper.make_node("Concat", ["lead", "n", "one"], ["index_shape"], axis=0),  # [L, Hkv, N, 1]
        helper.make_node("Reshape", [SLOTS, "slot_shape"], ["slot_col"]),
        helper.make_node("Expand", ["layer_ids", "index_shape"], ["l"]),
        helper.make_node("Expand", ["head_ids", "index_shape"], ["h"]),
        helper.make_node("Expand", ["slot_col", "index_shape"], ["s"]),
        helper.make_node("Concat", ["l", "h", "s"], ["index"], axis=3),  # [L, Hkv, N, 3]
    ]
    for pool, present in ((POOL_KEY, C.PRESENT_KEY), (POOL_VALUE, C.PRESENT_VALUE)):
        nodes.append(helper.make_node("Transpose", [present], [present + ".t"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("ScatterND", [pool, "index", present + ".t"], [pool + ".out"]))
    graph = helper.make_graph(nodes, "ruvllm_kv_writer", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10).SerializeToString()


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] as int8 rows and their groups' fp16 scales [..., D / kv_group(D)]: each group in steps of
    its absolute maximum / 127 (rounded to fp16), rounded to nearest (ties to even) and kept in
    [-127, 127]; |x - q * s| <= s / 2 but where fp16 rounded a scale down (then at most 0.1% of it more).
    ruvllm.PagedAttention and graph_rewrite.kv_in_int8_graph round this step's rows with the same ops."""
    d = x.shape[-1]
    groups = x.reshape(*x.shape[:-1], d // kv_group(d), kv_group(d))
    scale = (np.abs(groups).max(axis=-1) / np.float32(127)).astype(np.float16)
    s = scale.astype(np.float32)[..., None]
    q = np.clip(np.rint(groups / np.where(s > 0, s, np.float32(1))), -127, 127).astype(np.int8)
    return q.reshape(x.shape), scale


def dequantize_rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 numbers int8 rows and their group scales (quantize_rows) stand for."""
    d, groups = q.shape[-1], scales.shape[-1]
    out = q.reshape(*q.shape[:-1], groups, d // groups).astype(np.float32) * scales.astype(np.float32)[..., None]
    return out.reshape(q.shape)


def kv_rotation(head_dim: int) -> int:
    """Numbers an int4 pool's Hadamard rotation mixes: the largest power of two dividing head_dim (a row of
    64: all of it; 96: blocks of 32)."""
    return head_dim & -head_dim


def _fwht(x: np.ndarray) -> np.ndarray:
    """Each row (last axis) times the orthonormal Hadamard matrix of kv_rotation(D) numbers, block by block:
    butterflies of distance 1, 2, 4, ..., (a, b) -> (a + b, a - b), then 1 / sqrt(n), in float32 and in
    kernels/kv_write.h's order, so that numpy, the writer and the reader round alike. Its own inverse."""
    n = kv_rotation(x.shape[-1])
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = np.stack([a + b, a - b], axis=2)
        h *= 2
    return y.reshape(x.shape) * np.float32(1 / np.sqrt(n))


def quantize_rows_int4(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] (D a multiple of 32) as an int4 pool stores it (--kv-dtype int4): rotated by an orthonormal
    Hadamard matrix (_fwht: which spreads a channel's outlier over the row, QuaRot), then per `group`
    numbers 4-bit steps above an fp16 minimum of an fp16 scale, (max - minimum) / 15, rounded to nearest
    even within [0, 15] (both held within fp16's range). Returns the packed rows [..., D / 2] uint8 (number i of each 32 in byte i's low
    nibble, number 16 + i in its high nibble) and the (scale, minimum) pairs [..., 2 D / group] fp16.
    kernels/kv_write.h computes the same bit for bit."""
    d = x.shape[-1]
    y = _fwht(np.asarray(x, np.float32))
    g = y.reshape(*x.shape[:-1], d // group, group)
    top = np.float32(65504)  # fp16's largest: numbers past it are held there, not made infinite
    lo = np.clip(g.min(-1), -top, top).astype(np.float16)
    lof = lo.astype(np.float32)[..., None]
    scale = np.minimum((g.max(-1, keepdims=True) - lof) / np.float32(15), top).astype(np.float16)[..., 0]
    s = scale.astype(np.float32)[..., None]
    q = np.clip(np.rint((g - lof) / np.where(s > 0, s, np.float32(1))), 0, 15).astype(np.uint8)
    q = q.reshape(*x.shape[:-1], d // 32, 2, 16)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*x.shape[:-1], d // 2)
    return packed, np.stack([scale, lo], -1).reshape(*x.shape[:-1], 2 * (d // group))


def dequantize_rows_int4(packed: np.ndarray, pairs: np.ndarray, rotated: bool = False) -> np.ndarray:
    """The float32 numbers int4 rows stand for (quantize_rows_int4): steps x scale + minimum, rotated back
    (the rotation is its own inverse); `rotated`: left in the rotated space, as ruvllm.PagedAttention reads
    them (it scores keys against the rotated query and rotates a segment's weighted values back once)."""
    d, groups = 2 * packed.shape[-1], pairs.shape[-1] // 2
    p = packed.reshape(*packed.shape[:-1], d // 32, 1, 16)
    q = np.concatenate([p & 15, p >> 4], axis=-2).reshape(*packed.shape[:-1], groups, d // groups).astype(np.float32)
    f = pairs.astype(np.float32).reshape(*pairs.shape[:-1], groups, 2)
    y = (q * f[..., :1] + f[..., 1:]).reshape(*packed.shape[:-1], d)
    return y if rotated else _fwht(y)


def _native_writer(kv_dtype: str):
    """The kernel library's one-pass writer of an int8 or int4 pool (kernel_library.kv_writer), or None:
    numpy's quantize_rows (quantize_rows_int4) and copies then."""
    from runtime.backends.kernel_library import kv_writer

    return kv_writer(kv_dtype)


def _reserved(shape: list[int], dtype=np.float32) -> np.ndarray:
    """Zeroed float32 memory that becomes resident page by page as it is written. Not numpy's own
    allocation: numpy asks for transparent huge pages on large arrays, and a pool's rows for one layer
    and head lie megabytes apart, so the first blocks of each would commit 2 MB pages across all of them
    (SmolLM2: 400 MB for 256 tokens)."""
    import mmap

    count, size = int(np.prod(shape)), np.dtype(dtype).itemsize
    # private: its pages can be given back with MADV_DONTNEED (for shared memory that only unmaps them, and
    # MADV_REMOVE cost ~0.1 ms a call)
    buf = mmap.mmap(-1, max(size * count, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count).reshape(shape)


_madvise = None


def _release_pages(arr: np.ndarray, ranges: list[tuple[int, int]]) -> None:
    """Give back the memory of (byte offset, length) ranges of a reserved array (page-aligned): it reads
    as zeros again and is committed anew when next written."""
    global _madvise
    import ctypes
    import mmap

    if _madvise is None:
        _madvise = ctypes.CDLL(None).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    base = arr.ctypes.data
    for offset, length in ranges:
        _madvise(base + offset, length, mmap.MADV_DONTNEED)


class DeviceKVPool:
    def __init__(self, ort, providers: list[str], num_layers: int, kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, device_writes: bool | None = None, kv_dtype: str = "fp32",
                 tails: bool = False) -> None:
        """tails: keep fp16 copies of the blocks being written beside an int8 or int4 pool (the graph
        reads them: contract.KV_TAIL_KEY)."""
        self.device = device_of(providers)
        self.device_writes = self.device != "cpu" if device_writes is None else device_writes
        self.int8, self.int4 = kv_dtype == "int8", kv_dtype == "int4"
        self.quantized = self.int8 or self.int4
        self.tails = tails and self.quantized
        self.tail_blocks = TAIL_BLOCKS  # what the graph's kernel was given (graph_rewrite.kv_quantized)
        self.dtype = np.int8 if self.int8 else np.uint8 if self.int4 else np.float32
        if self.quantized and (self.device != "cpu" or self.device_writes):
            raise ValueError(f"an {kv_dtype} KV pool lives in host memory: it runs on the CPU only")
        width = head_dim // 2 if self.int4 else head_dim  # an int4 row: two numbers a byte
        self.layer_shape = [kv_heads, num_blocks, block_size, width]  # what each layer's graph input sees
        shape = [num_layers, kv_heads, num_blocks * block_size, width]
        self.layer_bytes = kv_heads * num_blocks * block_size * width * np.dtype(self.dtype).itemsize
        # fp16 numbers a row's scales take, per kind (keys' and values' int4 groups differ: kv_int4_groups)
        self.int4_groups = kv_int4_groups(head_dim) if self.int4 else (0, 0)
        self.scale_widths = kv_scale_widths(head_dim, kv_dtype)
        self.scale_bytes = tuple(kv_heads * num_blocks * block_size * w * 2 for w in self.scale_widths)  # a layer's
        self.num_blocks, self.block_size, self.num_layers, self.head_dim = num_blocks, block_size, num_layers, head_dim
        self.committed = num_blocks  # blocks whose memory is written (zeros) and so resident
        if self.device == "cpu":
            # reserved, not committed: the pool's memory is zeroed (and so becomes resident) ahead of use,
            # doubling as the blocks in use grow (ensure), so a short chat does not hold the whole budget.
            # Committing a range at once keeps page faults out of the steps: a lazily mapped page faulting
            # at its first write cost ~1.7 ms a step on SmolLM2.
            self._host = (_reserved(shape, self.dtype), _reserved(shape, self.dtype))
            self._scales = tuple(_reserved([*shape[:3], w], np.float16) for w in self.scale_widths) if self.quantized else ()
            # committed where written (never by ensure), given back as their blocks fall behind
            tail_shape = [num_blocks, num_layers, kv_heads, block_size, head_dim]  # a block's rows: one range
            self._tails = (_reserved(tail_shape, np.float16), _reserved(tail_shape, np.float16)) if self.tails else ()
            self._tail_rows = TailBlocks(block_size, self.tail_blocks)  # its live blocks' tail rows hold memory
            # a quantized pool's one-pass writer (kernel library) and its arrays' addresses, which never move;
            # None: numpy writes it
            self._native = _native_writer(kv_dtype) if self.quantized else None
            self._pointers = [(a.ctypes.data, s.ctypes.data, t.ctypes.data if self.tails else None)
                              for a, s, t in zip(self._host, self._scales, self._tails or (None, None))]
            self.committed = 0
            self.ensure(min(num_blocks, FIRST_BLOCKS))
            self.keys, self.values = (ort.OrtValue.ortvalue_from_numpy(arr) for arr in self._host)
            self._scale_values = [ort.OrtValue.ortvalue_from_numpy(arr) for arr in self._scales]
            self._tail_values = [ort.OrtValue.ortvalue_from_numpy(arr) for arr in self._tails]
        else:
            self._host, self._scales, self._scale_values, self._tail_values = None, (), [], []
            self._native = None
            self.keys = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, self.device, 0)
            self.values = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, self.device, 0)
            for pool in (self.keys, self.values):
                pool.update_inplace(np.zeros(shape, np.float32))
        if not self.device_writes:
            return
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = 1  # a few kilobytes a step
        self.writer = ort.InferenceSession(writer_graph(num_layers, kv_heads, head_dim), sess_options=opts,
                                           providers=providers)
        self._io = self.writer.io_binding()
        for name, pool in ((POOL_KEY, self.keys), (POOL_VALUE, self.values)):
            self._io.bind_ortvalue_input(name, pool)
            self._io.bind_ortvalue_output(name + ".out", pool)  # the same buffer: scattered in place

    def ensure(self, blocks: int) -> None:
        """Commit the pool's memory for its first `blocks` blocks (the allocator hands out the lowest free
        block first, so the blocks in use stay at the front), at least doubling what is committed."""
        if blocks <= self.committed:
            return
        new = min(self.num_blocks, max(blocks, 2 * self.committed))
        lo, hi = self.committed * self.block_size, new * self.block_size
        for arr in (*self._host, *self._scales):
            arr[:, :, lo:hi] = 0
        self.committed = new

    @property
    def committed_bytes(self) -> int:
        """Bytes of K and V memory committed so far (the whole pool on a GPU), the tails' pages included."""
        pool = self.num_layers * (2 * self.layer_bytes + sum(self.scale_bytes)) * self.committed // self.num_blocks
        return pool + (len(self._tail_rows.live) * 2 * self._tail_block_bytes if self.tails else 0)

    @property
    def _tail_block_bytes(self) -> int:
        """Bytes of one block's rows of every layer and kv head in a tail (fp16)."""
        return self.num_layers * self.layer_shape[0] * self.block_size * self.head_dim * 2

    def bind_layers(self, io, num_layers: int) -> None:
        """Bind each layer's past.{i}.key / .value graph input to its slice of the pool."""
        for i in range(num_layers):
            for name, pool in ((C.past_key(i), self.keys), (C.past_value(i), self.values)):
                io.bind_input(name, self.device, 0, self.dtype, self.layer_shape, pool.data_ptr() + i * self.layer_bytes)
            for name, scales, w, size in zip((C.past_key_scale(i), C.past_value_scale(i)), self._scale_values,
                                             self.scale_widths, self.scale_bytes):
                io.bind_input(name, self.device, 0, np.float16, [*self.layer_shape[:3], w], scales.data_ptr() + i * size)
        for name, tail in zip((C.KV_TAIL_KEY, C.KV_TAIL_VALUE), self._tail_values):
            io.bind_ortvalue_input(name, tail)

    def write(self, present_key, present_value, kv_slots: list[int], batch=None) -> None:
        """Put a step's K/V ([layers, tokens, kv_heads, head_dim] OrtValues on the device) into the slots;
        with tails, `batch` (the step's StepBatch) says which rows are kept in the fp16 tails too."""
        if not self.device_writes:
            kept = self._tail_tokens(kv_slots, batch) if self.tails and batch is not None else []
            if self._native is not None:
                self._write_native((present_key, present_value), kv_slots, kept)
                return
            presents = (present_key.numpy(), present_value.numpy())  # [layers, tokens, kv_heads, head_dim]
            if kept:
                at = np.asarray([kv_slots[t] for t in kept], np.int64)
                for tail, present in zip(self._tails, presents):
                    tail[at // self.block_size, :, :, at % self.block_size] = present[:, kept].transpose(1, 0, 2, 3).astype(np.float16)
            first, n = kv_slots[0], len(kv_slots)
            if kv_slots[-1] - first == n - 1 and kv_slots == list(range(first, first + n)):
                slots = slice(first, first + n)  # one run of slots (every decode, most chunks): no fancy indexing
            else:
                slots = np.asarray(kv_slots, np.int64)
            for k, (pool, present) in enumerate(zip(self._host, presents)):
                rows = present.transpose(0, 2, 1, 3)
                if self.int8:
                    rows, scales = quantize_rows(rows)
                    self._scales[k][:, :, slots] = scales
                elif self.int4:
                    rows, scales = quantize_rows_int4(rows, self.int4_groups[k])
                    self._scales[k][:, :, slots] = scales
                pool[:, :, slots] = rows
            return
        io = self._io
        io.bind_ortvalue_input(C.PRESENT_KEY, present_key)
        io.bind_ortvalue_input(C.PRESENT_VALUE, present_value)
        io.bind_cpu_input(SLOTS, np.asarray(kv_slots, np.int64))
        self.writer.run_with_iobinding(io)

    def _write_native(self, presents, kv_slots: list[int], kept: list[int]) -> None:
        """Both kinds (the graph's present OrtValues, read in place) through ruvllm_kv_write_int8 or _int4
        (kernels/kv_write.h): quantize_rows's (quantize_rows_int4's) rounding bit for bit, and the kept
        tokens' rows copied into the tails, one pass each rather than numpy's dozen (a decode step's int8
        write: 0.44 -> ~0.1 ms)."""
        import ctypes

        slots = (ctypes.c_int64 * len(kv_slots))(*kv_slots)
        kept_at = (ctypes.c_int64 * len(kept))(*kept)
        layers, tokens, heads, dim = presents[0].shape()
        for k, (present, (pool, scales, tail)) in enumerate(zip(presents, self._pointers)):
            group = self.int4_groups[k] if self.int4 else self.scale_widths[k]  # int4: numbers a pair; int8: groups a row
            if self._native(present.data_ptr(), layers, tokens, heads, dim, slots, self.num_blocks * self.block_size,
                            group, pool, scales, tail if kept else None, kept_at, len(kept), self.block_size):
                raise ValueError("the KV pool's writer refused a step's rows (a slot outside the pool)")

    def _tail_tokens(self, kv_slots: list[int], batch) -> list[int]:
        """The step's tokens whose rows go into the tails too (kv_tails.TailBlocks.step), after giving back
        the tail pages of the blocks no step reads exact any more."""
        tokens, sealed = self._tail_rows.step(batch)
        if sealed:
            self._release_tails(sealed)
        return tokens

    def drop(self, blocks: list[int]) -> None:
        """Blocks no sequence holds any more (the scheduler's dropped blocks; before a step writes, since it
        may write them for a new holder): their tail pages go back."""
        gone = self._tail_rows.drop(blocks) if self.tails else set()
        if gone:
            self._release_tails(gone)

    def _release_tails(self, blocks: set[int]) -> None:
        import mmap

        size = self._tail_block_bytes
        if size % mmap.PAGESIZE:
            return  # a block's rows do not fill whole pages: they stay committed (reused by later blocks)
        ranges: list[list[int]] = []  # runs of consecutive blocks, one call each
        for b in sorted(blocks):
            if ranges and ranges[-1][1] == b:
                ranges[-1][1] = b + 1
            else:
                ranges.append([b, b + 1])
        for tail in self._tails:
            _release_pages(tail, [(lo * size, (hi - lo) * size) for lo, hi in ranges])

    # whole blocks in and out, as the pool stores them (a saved session: runtime/formats/kv_session.py)
    @property
    def block_arrays(self) -> list[str]:
        """The arrays a block's bytes hold, in order: its K and V rows (and their scales, quantized)."""
        return ["keys", "values", *(["key_scales", "value_scales"] if self.quantized else [])]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer and kv head, its rows' scales included."""
        return self.num_layers * (2 * self.layer_bytes + sum(self.scale_bytes)) // self.num_blocks

    def _block_views(self, block: int) -> list[np.ndarray]:
        if self.device != "cpu":
            raise RuntimeError(f"the KV pool lives on the {self.device} device: its blocks cannot be saved or restored")
        at = slice(block * self.block_size, (block + 1) * self.block_size)
        return [arr[:, :, at] for arr in (*self._host, *self._scales)]

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        """Each block's bytes: its arrays (block_arrays) one after another, each C-ordered."""
        return [b"".join(np.ascontiguousarray(v).tobytes() for v in self._block_views(b)) for b in blocks]

    def write_blocks(self, blocks: list[int], data: list[bytes]) -> None:
        """Put read_blocks' bytes back, into these blocks (of a pool of the same layout)."""
        if any(len(raw) != self.block_bytes for raw in data):
            raise ValueError(f"a block of this pool takes {self.block_bytes} bytes")
        if blocks:
            self.ensure(max(blocks) + 1)
        for block, raw in zip(blocks, data):
            at = 0
            for view in self._block_views(block):
                view[...] = np.frombuffer(raw, view.dtype, view.size, at).reshape(view.shape)
                at += view.nbytes

    def host_view(self) -> tuple[np.ndarray, np.ndarray]:
        """The pools as numpy arrays [layers, kv_heads, blocks, block_size, head_dim] sharing their memory
        (CPU only: for tests and for restoring saved blocks); commits the whole pool."""
        if self.device != "cpu":
            raise RuntimeError("the KV pool lives on the GPU: it has no host view")
        if self.quantized:
            raise RuntimeError("a quantized KV pool has no fp32 view")
        self.ensure(self.num_blocks)  # a writer through the view may touch any block: commit them all first
        shape = (self._host[0].shape[0], *self.layer_shape)
        return self._host[0].reshape(shape), self._host[1].reshape(shape)
