"""Drives a backend step by step with explicit chunks, for logits-level tests against transformers."""

from __future__ import annotations

from runtime.core.kv_blocks import BlockAllocator
from runtime.core.step_batch import Chunk, build_step


class Stepper:
    """Minimal block bookkeeping around a backend: sequences by slot, no scheduling."""

    def __init__(self, backend, block_size: int = 4, num_blocks: int = 256) -> None:
        self.backend = backend
        self.bs = block_size
        self.alloc = BlockAllocator(num_blocks, block_size)
        backend.allocate(num_blocks, block_size)
        self.blocks: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]], extra_inputs=None):
        """chunks: slot -> new tokens. Returns full logits [rows, vocab], one row per slot in order."""
        plan = []
        for slot, tokens in chunks.items():
            start = self.length.get(slot, 0)
            blocks = self.blocks.setdefault(slot, [])
            while len(blocks) * self.bs < start + len(tokens):
                blocks.append(self.alloc.allocate())
            plan.append(Chunk(tokens=tokens, start=start, block_table=blocks,
                              kv_slots=[blocks[t // self.bs] * self.bs + t % self.bs
                                        for t in range(start, start + len(tokens))],
                              want_logits=True, top_k=5))
            self.length[slot] = start + len(tokens)
        result = self.backend.run(build_step(plan, self.bs, want_full_logits=True), extra_inputs=extra_inputs)
        return result
