"""Prefix-aware replica choice: send a prompt where its leading KV blocks are most likely cached.

The keys are the engine's own prefix-cache keys (`kv_blocks.block_key`: a chain over the prompt's full
blocks and the adapter's content id), so "replica R holds key k" means R's prefix cache can serve that
block. The router cannot see the replicas' caches; it remembers where it sent each key, keeping for
every replica about as many keys as its pool holds, least recently routed first out. A replica that
holds a longer prefix wins unless its queue is longer than the shortest by more than `imbalance`;
with no holder the caller falls back to power of two choices, which balances load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from runtime.core.kv_blocks import prefix_keys

LIVE_ROUTERS: dict[str, object] = {}  # this process's Ray Serve routers by deployment name (router.py registers)


def prompt_block_keys(ids: Sequence[int], block_size: int, adapter_id: str | None = None,
                      max_blocks: int = 32) -> list[bytes]:
    """The prefix-cache keys of the prompt's first full blocks (at most max_blocks: enough to tell
    shared system prompts apart, cheap to hash)."""
    return prefix_keys(ids, block_size, adapter_id, upto=min(len(ids), max_blocks * block_size))


class PrefixAffinity:
    """Where each prompt block was routed, per replica: the router's model of the replicas' caches."""

    def __init__(self, capacity_blocks: int = 1 << 16, imbalance: int = 8) -> None:
        self.capacity, self.imbalance = capacity_blocks, imbalance
        self._held: dict[Hashable, OrderedDict[bytes, None]] = {}

    def matched(self, replica: Hashable, keys: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks the replica holds (a chain: the first miss ends it)."""
        held = self._held.get(replica)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def choose(self, replicas: Sequence[Hashable], keys: Sequence[bytes],
               queue_len: Mapping[Hashable, int] | None = None) -> list[Hashable]:
        """The replicas to try first, best first: those holding the longest prefix among the ones not
        overloaded, shortest queue first. Empty: no replica holds any of it, or every holder is
        overloaded; use the default policy."""
        if not keys or not replicas:
            return []
        queue_len = queue_len or {}
        queues = {r: queue_len.get(r) or 0 for r in replicas}
        shortest = min(queues.values())
        scores = {r: self.matched(r, keys) for r in replicas if queues[r] - shortest <= self.imbalance}
        best = max(scores.values(), default=0)
        if best == 0:
            return []
        return sorted((r for r, s in scores.items() if s == best), key=queues.__getitem__)

    def record(self, replica: Hashable, keys: Sequence[bytes]) -> None:
        """The prompt went to `replica`: it will hold these blocks (most recently used last)."""
        held = self._held.setdefault(replica, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """The replica is gone (or was replaced): its cache went with it."""
        self._held.pop(replica, None)

    def replicas(self) -> list[Hashable]:
        return list(self._held)
