"""Typed settings of an engine and of the model it serves, validated once where they are made.

The page's defaults (a smaller KV pool and batch: one user, a tab's memory) are a profile here,
so the JS side passes only what a caller chose.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from runtime.core.speculative import PromptLookup

DEFAULT_KV_MEMORY = 512 * 1024 * 1024

# At most this many prompt-lookup drafts per decode step (how many, and when a sequence pauses, is
# PromptLookup's policy, with its measurements), and the most running sequences that still draft. One
# sequence's step with 1/2/3 drafts costs ~1.1-1.25/1.25-1.4/1.45-1.5 plain steps natively (host-dependent)
# and 1.15/1.23/1.49 in onnxruntime-web; at 2 streams drafting still gained ~5%, from 4 on it loses (a batch
# step is compute-bound), hence the cap. Sampled requests draft up to SPECULATIVE_MAX_TEMPERATURE: replaying
# 60 sampled SmolLM2 answers through those costs, drafting gained 5-10% at temperature 0.3 (SmolLM2's card
# suggests 0.2), -5% to +3% at 0.7-1.0, where a sampled token rarely repeats what came before.
SPECULATIVE_TOKENS = 3
SPECULATIVE_MAX_BATCH = 2
SPECULATIVE_MAX_TEMPERATURE = 0.5
# SmolLM2 Q4_1, 2 threads, 16 chat streams while long prompts of ~1,090 tokens arrive (benchmarks/serving.py's
# mixed load, docs/performance-log/2026-12.md): the streams' inter-token p99 48 ms alone, 122 ms beside the long
# prompts at 32 (their prefill 552 tokens a second), 104 ms at 16 (326 a second); uncapped, a step's whole budget
# of prompt tokens stalled them for about a second (benchmarks/mixed_load.py: p99 1,198 ms)
LONG_PREFILL_TOKENS = 32


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know of the model, read from the package manifest."""

    max_context: int
    vocab_size: int
    block_size: int  # the package's KV block size (an engine may choose another)
    eos_ids: frozenset[int]

    @classmethod
    def from_manifest(cls, manifest: dict) -> ModelConfig:
        cfg = manifest["config"]
        eos = manifest.get("special_tokens", {}).get("eos_token_ids", [])
        return cls(int(cfg["max_positions"]), int(cfg["vocab_size"]), int(manifest["kv_cache"]["block_size"]),
                   frozenset(eos))


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int | None = None  # KV pool size in blocks; None: as many as kv_memory holds
    kv_memory: int | None = None  # KV pool budget in bytes; None: DEFAULT_KV_MEMORY
    block_size: int | None = None  # None: the package's
    max_num_seqs: int = 64
    max_batch_tokens: int = 512
    # while some sequence decodes, a longer prompt computes this many tokens a step, one such prompt a step, and
    # a shorter one whole (vLLM's long_prefill_token_threshold, max_long_partial_prefills 1): a long prompt's
    # prefill does not stall the streams running beside it, nor a chat's prompt queue behind it; 0: off
    long_prefill_tokens: int = LONG_PREFILL_TOKENS
    enable_prefix_cache: bool = True
    speculative_tokens: int = SPECULATIVE_TOKENS
    speculative_max_batch: int = SPECULATIVE_MAX_BATCH
    ngram: tuple[int, int] = (1, 3)
    max_loras: int = 4  # adapters one step can mix (the LoRA graph's slots after slot 0)
    max_lora_rank: int = 16  # the largest adapter rank served (smaller ones are zero-padded)
    max_cpu_loras: int | None = None  # adapters' weights kept in memory (default: max_loras)
    # a request's tokens must not depend on its batch: where the backend's kernels do not promise that, one
    # request at a time, no prefix cache, no drafts (the path every request's solo run takes)
    batch_invariant: bool = False

    def invariant_for(self, why: str) -> EngineConfig:
        """This config for a backend whose batches may change a row's numbers for `why` ("": they do not)."""
        if not self.batch_invariant or not why:
            return self
        return replace(self, max_num_seqs=1, enable_prefix_cache=False, speculative_tokens=0)

    def __post_init__(self) -> None:
        if self.speculative_tokens < 0 or self.speculative_max_batch < 0:
            raise ValueError("speculative_tokens and speculative_max_batch must be >= 0")
        if self.long_prefill_tokens < 0:
            raise ValueError("long_prefill_tokens must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        for name in ("num_blocks", "kv_memory", "block_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive")
        PromptLookup(*self.ngram)  # validates the n-gram sizes
        object.__setattr__(self, "max_batch_tokens", max(1, self.max_batch_tokens))

    @classmethod
    def web(cls, **overrides) -> EngineConfig:
        """The page's profile: one user in a browser tab, whose memory is tighter than a server's."""
        return dataclasses.replace(cls(kv_memory=256 << 20, max_num_seqs=16, max_batch_tokens=256), **overrides)

    def pool_blocks(self, block_size: int, kv_bytes_per_token: int, max_context: int) -> int:
        """Blocks in the KV pool: num_blocks, or what kv_memory holds, never more than every sequence
        at full context needs."""
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = block_size * kv_bytes_per_token
        ceiling = self.max_num_seqs * -(-max_context // block_size)
        return max(1, min((self.kv_memory or DEFAULT_KV_MEMORY) // per_block, ceiling))
