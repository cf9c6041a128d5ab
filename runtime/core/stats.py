"""The engine's counters, shared by the scheduler (steps, KV, drafts) and the output processor (tokens)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    preemptions: int = 0
    aborted: int = 0
    peak_running: int = 0  # most sequences in one step
    draft_tokens: int = 0  # tokens proposed by prompt lookup
    accepted_draft_tokens: int = 0  # of which verified (each saves a step)
    started: float = field(default_factory=time.monotonic)

    def snapshot(self, scheduler) -> dict:
        a = scheduler.allocator
        elapsed = max(1e-9, time.monotonic() - self.started)
        return {
            "running": len(scheduler.running), "waiting": len(scheduler.waiting),
            "kv_blocks_total": a.num_blocks, "kv_blocks_used": a.num_used, "kv_blocks_free": a.num_free,
            "kv_block_size": scheduler.block_size, "prefix_cache_blocks": a.num_cached,
            "prefix_cache_queries": a.stats.queries, "prefix_cache_hits": a.stats.hits,
            "prefix_cache_hit_rate": round(a.stats.hit_rate, 4), "prefix_cache_evictions": a.stats.evictions,
            "prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated_tokens, "steps": self.steps,
            "preemptions": self.preemptions, "aborted": self.aborted, "peak_running": self.peak_running,
            "draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens,
            "generated_tokens_per_s": round(self.generated_tokens / elapsed, 2),
        }
