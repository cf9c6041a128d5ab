"""Which rows of a two-tier KV pool are also kept exact (its tails), for the native pool and the page's step.

A quantized pool (int8, int4) keeps the rows of the blocks sequences are still writing in fp16
too, and a query reads its own block and the TAIL_BLOCKS - 1 blocks before it exact, from its row's floor
on (StepBatch.exact_from). This module decides, step by step, which of a step's tokens must be kept exact
(a later step may still read them so) and which blocks' exact copies nothing will read again; where the
copies live is the backend's (the native pool's tail pages, the page's tail slots).
"""

from __future__ import annotations

# A query reads the positions of its own block and of the TAIL_BLOCKS - 1 blocks before it exact (from the
# tails, or this step's rows), every earlier block as stored; ruvllm.PagedAttention (attribute tail_blocks)
# and the page's step read with the same number. The blocks before its own it reads exact only from its
# row's floor on (StepBatch.exact_from, kv_blocks.exact_floor: from the block before the prompt's last): a
# prefix-cache hit ends at the new request's floor, so no cached block (whose tail is gone) is ever read
# exact, and the scheduler shares only blocks computed below floors. Two rather than one: SmolLM2 in fp32,
# greedy text on 20 chat prompts equal to the fp32 pool's on 18 rather than 16 (docs/PERFORMANCE.md).
TAIL_BLOCKS = 2
# A row of up to this many tokens may be a decode with drafts: its next step may start right after its
# first token, so its tail keeps rows from that position's block on (longer rows: from their end's)
DRAFT_ROWS = 16


class TailBlocks:
    """The blocks whose exact rows are live, updated a step at a time."""

    def __init__(self, block_size: int, tail_blocks: int = TAIL_BLOCKS) -> None:
        self.block_size, self.tail_blocks = block_size, tail_blocks
        self.live: set[int] = set()

    def step(self, batch) -> tuple[list[int], set[int]]:
        """A StepBatch's tokens whose rows go into the tails too (those of each row's blocks that a later step
        may still read exact: its own block, and the tail_blocks - 1 before it from the row's floor on, the
        readers' rule), and the blocks whose exact rows no step reads any more: whole and computed once this
        step is, they are read as stored from now on. Only the row's own blocks are sealed: those before its
        own_from are prefix-cache hits, whose tails another sequence may still read exact."""
        bs, sealed, tokens = self.block_size, set(), []
        for row, table, floor, own_start in zip(batch.query_index, batch.block_tables, batch.exact_from, batch.own_from):
            first = row[0]
            start, count = batch.position_ids[first], row[-1] - first + 1
            resume = start + 1 if count <= DRAFT_ROWS else start + count  # where the next step may start
            own = resume - resume % bs
            keep = min(own, max(floor, own - (self.tail_blocks - 1) * bs))  # the next step's first exact position
            tokens.extend(range(first + max(0, keep - start), first + count))
            # the row's earlier steps kept rows from at most DRAFT_ROWS (and tail_blocks - 1 blocks) before
            # this one's start on
            earliest = max(own_start // bs, (start - DRAFT_ROWS) // bs - (self.tail_blocks - 1))
            sealed.update(b for b in table[earliest:keep // bs] if b in self.live)
        self.live -= sealed
        self.live.update(batch.kv_slots[t] // bs for t in tokens)
        return tokens, sealed

    def drop(self, blocks: list[int]) -> set[int]:
        """Blocks no sequence holds any more (the scheduler's dropped blocks, before a step writes, since it
        may write them for a new holder): those that had exact rows."""
        gone = self.live.intersection(blocks)
        self.live -= gone
        return gone


class TailSlots(TailBlocks):
    """TailBlocks whose exact rows live in numbered slots of one block each (the page's step, whose memory
    cannot give pages back): a live block holds a slot, freed slots are taken again lowest first, so the
    slots in use stay about the blocks the running sequences write."""

    def __init__(self, block_size: int, tail_blocks: int = TAIL_BLOCKS) -> None:
        super().__init__(block_size, tail_blocks)
        self.slot_of: dict[int, int] = {}
        self._free: list[int] = []
        self._sealed: set[int] = set()  # sealed by the last step, which still read them: freed at the next
        self.slots = 0  # slots ever handed out: the memory they take

    def step_slots(self, batch) -> tuple[list[int], list[tuple[int, int]]]:
        """The tokens of a StepBatch to keep exact, and the changes to the block -> slot map to make before it
        runs, as (block, slot) pairs, slot -1 for a block that no longer has one: the slots of the blocks
        dropped since the last step and of those the last step sealed (it still read them exact), then a slot
        for each block this step starts keeping."""
        released = self.drop(batch.dropped_blocks) | self._sealed
        changes = [(b, -1) for b in self._release(released)]
        tokens, self._sealed = self.step(batch)
        for block in sorted(self.live.difference(self.slot_of)):
            if self._free:
                slot = min(self._free)
                self._free.remove(slot)
            else:
                slot, self.slots = self.slots, self.slots + 1
            self.slot_of[block] = slot
            changes.append((block, slot))
        return tokens, changes

    def _release(self, blocks: set[int]) -> list[int]:
        for b in blocks:
            self._free.append(self.slot_of.pop(b))
        return sorted(blocks)
