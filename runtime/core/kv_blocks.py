"""The KV block pool's bookkeeping: free blocks, reference counts and the prefix cache.

A full block can be shared by every sequence whose tokens up to and including that block are
equal (and that uses the same adapter). Its key is a chained digest of (parent key, block tokens,
adapter id), so equal keys mean equal prefixes. A released block that holds a cached prefix is not
freed but parked in an LRU list; it is reused on a hit, or evicted when the free list runs dry.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from dataclasses import dataclass
from struct import pack


def block_key(parent: bytes | None, tokens: list[int] | tuple[int, ...], adapter: str | None = None) -> bytes:
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(pack(f"<{len(tokens)}q", *tokens))
    if adapter:
        h.update(b"\0adapter\0" + adapter.encode("utf-8"))
    return h.digest()


def prefix_keys(tokens, block_size: int, adapter: str | None = None, known: list[bytes] | tuple = (),
                upto: int | None = None) -> list[bytes]:
    """Chained keys of the full blocks within tokens[:upto], after the `known` first ones (continuing their chain)."""
    parent = known[-1] if known else None
    keys = []
    for j in range(len(known), (len(tokens) if upto is None else upto) // block_size):
        parent = block_key(parent, tokens[j * block_size:(j + 1) * block_size], adapter)
        keys.append(parent)
    return keys


def kv_group(head_dim: int) -> int:
    """Numbers per int8 scale in a KV row: 32, or the whole row where 32 does not divide it."""
    return 32 if head_dim % 32 == 0 else head_dim


def kv_int4_groups(head_dim: int) -> tuple[int, int]:
    """Numbers per (scale, minimum) pair in an int4 pool's key and value rows: keys 32, values 64 where 64
    divides the row (Hadamard-rotated asymmetric int4, SmolLM2 at 2,048 tokens: KL 0.0079 at 0.59 bytes a
    number, against 0.0098 with 64 for both; docs/PERFORMANCE.md)."""
    if head_dim % 32:
        raise ValueError(f"an int4 KV pool needs head_dim a multiple of 32, not {head_dim}")
    return 32, 64 if head_dim % 64 == 0 else 32


def kv_scale_widths(head_dim: int, kv_dtype: str) -> tuple[int, int]:
    """fp16 numbers a key row's and a value row's scales take: int8, one per group; int4, a (scale,
    minimum) pair per group; fp32, none."""
    if kv_dtype == "int8":
        return (head_dim // kv_group(head_dim),) * 2
    if kv_dtype == "int4":
        return tuple(2 * head_dim // g for g in kv_int4_groups(head_dim))
    return 0, 0


def kv_row_bytes(head_dim: int, kv_dtype: str, kind: int = 0) -> int:
    """Bytes one token's kv head takes in a pool of kv_dtype for keys (kind 0) or values (1): its numbers
    (fp32, int8, or int4 two a byte) and its fp16 scales (kv_scale_widths)."""
    numbers = {"int8": head_dim, "int4": head_dim // 2}.get(kv_dtype, 4 * head_dim)
    return numbers + 2 * kv_scale_widths(head_dim, kv_dtype)[kind]


def kv_bytes_per_token(cfg: dict, kv_dtype: str = "fp32") -> int:
    """Bytes of K and V one token takes in the pool, over all layers: fp32 rows, or quantized rows and their
    scales."""
    row = kv_row_bytes(cfg["head_dim"], kv_dtype, 0) + kv_row_bytes(cfg["head_dim"], kv_dtype, 1)
    return cfg["num_layers"] * cfg["num_kv_heads"] * row


def kv_tail_bytes(cfg: dict, kv_dtype: str, block_size: int, tail_blocks: int) -> int:
    """Bytes the exact tails of a two-tier pool (int8, int4) hold a sequence at most, over all layers: its
    tail_blocks blocks' rows in fp16 (the native pool's; kv_pool.py); none for fp32."""
    if kv_dtype == "fp32":
        return 0
    return tail_blocks * block_size * cfg["num_layers"] * cfg["num_kv_heads"] * 2 * cfg["head_dim"] * 2


def exact_floor(prompt_len: int, block_size: int) -> int:
    """A sequence's floor on a two-tier pool that reads blocks before a query's own exact (kv_tails.TAIL_BLOCKS
    > 1): the first position such reads may reach, the start of the block before the one holding the
    prompt's last token. Below it a query reads its own block alone, as every other request computing
    those tokens does, so those blocks can be shared through the prefix cache; from it on (the prompt's
    end and every generated token) the recent context is read exact, which keeps greedy text on the fp32
    pool's (SmolLM2, 20 chat prompts: 18 equal rather than 16; docs/PERFORMANCE.md)."""
    return max(0, (prompt_len - 1) // block_size - 1) * block_size


@dataclass
class PrefixStats:
    queries: int = 0  # prompt blocks looked up
    hits: int = 0  # of which found in the cache
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        # lowest id first: live blocks stay packed at the front of the pool, which lets a backend
        # that copies the pool per step (onnxruntime-web) copy only the part in use
        self._free = list(range(num_blocks))
        self.refcount = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # block -> its prefix key, for full blocks in the cache
        self._block_of: dict[bytes, int] = {}  # prefix key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self._dropped: list[int] = []  # blocks the last holder let go of since take_dropped
        self.stats = PrefixStats()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.stats.evictions += 1
        else:
            raise MemoryError("KV block pool exhausted")
        self.refcount[block] = 1
        return block

    def retain(self, block: int) -> None:
        if self.refcount[block] == 0:
            self._evictable.pop(block, None)
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._dropped.append(block)
            if block in self._key_of:
                self._evictable[block] = None  # keep its prefix for later hits
            else:
                heapq.heappush(self._free, block)
        elif self.refcount[block] < 0:
            raise RuntimeError(f"block {block} released more often than retained")

    def take_dropped(self) -> list[int]:
        """Blocks whose last holder let go of them since the last call (free, or cached for later hits):
        nobody writes them any more, so a backend may drop what it keeps beside their rows."""
        dropped, self._dropped = self._dropped, []
        return dropped

    # ---- prefix cache ----
    def lookup(self, keys: list[bytes]) -> list[int]:
        """Longest run of cached blocks for these chained keys; each returned block is retained."""
        found: list[int] = []
        if not self.enable_prefix_cache:
            return found
        self.stats.queries += len(keys)
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            self.retain(block)
            found.append(block)
        self.stats.hits += len(found)
        return found

    def register(self, block: int, key: bytes) -> None:
        """Publish a block that now holds a full, computed block of tokens under its prefix key."""
        if not self.enable_prefix_cache or block in self._key_of:
            return
        if key in self._block_of:  # another sequence computed the same prefix first; keep that one
            return
        self._key_of[block] = key
        self._block_of[key] = block

    def cached_block(self, key: bytes) -> int | None:
        """The block holding this prefix key, if cached (without retaining it)."""
        return self._block_of.get(key)

    def restore(self, key: bytes, evict: bool = False) -> int | None:
        """Park a free block in the cache under `key`, for K/V restored from elsewhere (a page reload, a saved
        session); the caller fills it before any step runs. Only truly free blocks, unless evict: then a
        cached block nobody holds may go (the least recently used first)."""
        if not self.enable_prefix_cache or key in self._block_of or not (self._free or evict and self._evictable):
            return None
        block = self.allocate()
        self.register(block, key)
        self.release(block)
        return block

    def reset(self) -> int:
        """Forget every cached prefix (a benchmark's cold start, or K/V that no longer match the
        weights); blocks that sequences hold stay theirs. Returns how many prefixes were dropped."""
        dropped = len(self._block_of)
        for block in self._evictable:
            heapq.heappush(self._free, block)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        return dropped

    def forget(self, block: int) -> None:
        """Undo restore() for a block whose K/V never arrived: drop its key, free it."""
        if self.refcount[block] == 0 and block in self._key_of:
            self._evictable.pop(block, None)
            del self._block_of[self._key_of.pop(block)]
            heapq.heappush(self._free, block)
