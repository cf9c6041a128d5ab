"""The KV block pool's bookkeeping: which blocks are free and who holds each one.

Blocks are reference counted so that sequences can share full blocks (prefix caching
builds on this in the engine).
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = deque(range(num_blocks))
        self.refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("KV block pool exhausted")
        block = self._free.popleft()
        self.refcount[block] = 1
        return block

    def retain(self, block: int) -> None:
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
        elif self.refcount[block] < 0:
            raise RuntimeError(f"block {block} released more often than retained")
