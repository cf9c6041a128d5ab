"""Sampling parameters and the final choice of a token among the graph's top-K candidates.

The graph applies penalties, logit bias and temperature and returns the top-K log-probabilities
normalized over the whole vocabulary, so top-k / top-p / min-p here are exact whenever the
candidates cover the nucleus (their mass is known); otherwise sampling is within the candidates.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from runtime.errors import RequestError

DEFAULT_CANDIDATES = 256


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many alternatives per token
    include_stop_str_in_output: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"invalid {name}: {why}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be a positive integer")
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            raise bad("temperature", "must be between 0 and 100")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise bad(name, "must be between -2 and 2")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be between 0 and 20")
        for tid in self.logit_bias:
            if vocab_size is not None and not (0 <= int(tid) < vocab_size):
                raise bad("logit_bias", f"token id {tid} is outside the vocabulary")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

    def candidates(self, vocab_size: int) -> int:
        """How many top-K candidates to ask the graph for."""
        want = 1 if self.greedy else (self.top_k or DEFAULT_CANDIDATES)
        want = max(want, (self.logprobs or 0) + 1)
        return max(1, min(want, vocab_size))


def make_rng(seed: int | None) -> random.Random:
    return random.Random(seed) if seed is not None else random.Random()


def choose(ids: list[int], logprobs: list[float], params: SamplingParams, rng: random.Random) -> int:
    """Pick one token from sorted candidates (best first)."""
    if params.greedy or len(ids) == 1:
        return ids[0]
    n = len(ids)
    if params.top_k:
        n = min(n, params.top_k)
    probs = [math.exp(lp) for lp in logprobs[:n]]
    if params.min_p > 0.0:
        floor = params.min_p * probs[0]
        n = max(1, sum(1 for p in probs if p >= floor))
        probs = probs[:n]
    if params.top_p < 1.0:
        total, cut = 0.0, n
        for i, p in enumerate(probs):
            total += p
            if total >= params.top_p:
                cut = i + 1
                break
        probs = probs[:cut]
    r = rng.random() * sum(probs)
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if r < acc:
            return ids[i]
    return ids[len(probs) - 1]
