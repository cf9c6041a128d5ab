"""A request as the step sees it, and what each step hands back for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.core.sampling import SamplingParams
from runtime.core.speculative import PromptLookup
from runtime.core.step_batch import PenaltyState
from runtime.core.stop import StopChecker
from runtime.text.tokenizer import IncrementalDecoder


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    request_id: str
    delta: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error_param: str | None = None  # with error: the request's own field at fault (a 400), not the engine
    # with prompt_logprobs, on the request's first output: per prompt token after the first, its logprob given
    # the tokens before it and the likeliest alternatives there (the first token has none: nothing precedes it)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(eq=False)  # identity: the scheduler's list lookups compare sequences, not their token lists
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    adapter: str | None = None  # the adapter's id (a digest of its weights): prefix-cache keys include it
    finished: bool = False
    # the scheduler's: KV blocks, what of the tokens they hold, prefix-cache keys, drafts
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of its computed full blocks
    prefix_keys: tuple[int, list[bytes], list[bytes]] | None = None  # (token count, keys, shadow keys) while waiting
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    computed_from: int = 0  # the first position it computed itself into its blocks (past its prefix-cache hit)
    lookup: PromptLookup | None = None  # n-gram index for drafting (speculative decoding)
    draft: list[int] = field(default_factory=list)  # tokens drafted for the step being run
    penalties: PenaltyState | None = None  # the graph's penalty inputs, kept incrementally
    dry_breakers: object = None  # DRY's BreakerTable (runtime/core/dry.py), when the request asks for DRY
    adapter_slot: int = -1  # the LoRA graph's slot holding its adapter while it runs (0: none)
    xlora: object = None  # an X-LoRA (runtime.core.xlora.XLoraInfo): its experts mixed per token
    expert_slots: list[int] = field(default_factory=list)  # X-LoRA: the slots holding its experts
    shadow_blocks: list[int] = field(default_factory=list)  # X-LoRA: the scaling pass's KV blocks
    shadow_keys: list[bytes] = field(default_factory=list)  # X-LoRA: prefix keys of its computed shadow blocks
    matcher: object = None  # structured output: its grammar's matcher (runtime.core.constraints.Matcher)
    thinking: object = None  # a thinking budget (runtime.text.reasoning.ThinkingBudget): closes the block in time
    prompt_scores: list[TokenLogprob | None] = field(default_factory=list)  # prompt_logprobs: by position - 1
    prompt_scores_sent: bool = False
    # the output processor's: sampling, detokenizing, stop strings
    rng: object = None
    decoder: IncrementalDecoder | None = None
    stopper: StopChecker | None = None

    @property
    def kv_passes(self) -> int:
        """KV blocks per block of tokens: 2 for an X-LoRA sequence (its scaling pass keeps its own)."""
        return 2 if self.xlora else 1

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt rows are still to be scored (prompt_logprobs, not all computed yet)."""
        return self.params.prompt_logprobs is not None and not self.prompt_scores_sent

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)
