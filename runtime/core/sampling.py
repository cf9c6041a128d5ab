"""Sampling parameters and the final choice of a token among the graph's top-K candidates.

The graph applies penalties, logit bias and temperature and returns the top-K log-probabilities
normalized over the whole vocabulary, so top-k / top-p / min-p here are exact whenever the
candidates cover the nucleus (their mass is known); otherwise sampling is within the candidates.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from runtime.core.dry import DEFAULT_BREAKERS
from runtime.core.request_fields import SAMPLING_FIELDS
from runtime.errors import RequestError

DEFAULT_CANDIDATES = 256
# Temperatures below this sample greedily (as vLLM does): dividing float32 logits by less overflows.
GREEDY_BELOW = 1e-5

# The one range of each sampling parameter: (lowest, highest, lowest excluded), None for no bound. The
# Python API, the CLI, the HTTP server (and its published request schema) and the page all check these.
# the scalar sampling fields' ranges (runtime/core/request_fields.py), and the other fields'
RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "max_tokens": (0, None, False),  # 0: the prompt is computed (and scored, with prompt_logprobs), nothing generated
    **{f.name: f.range for f in SAMPLING_FIELDS if f.range is not None},
    "logprobs": (0, 20, False),
    "prompt_logprobs": (0, 20, False),
    "logit_bias": (-100.0, 100.0, False),  # each bias value
    "thinking_budget": (0, None, False),  # a reasoning model's tokens inside its thinking block, at most
}
_D = {f.name: f.default for f in SAMPLING_FIELDS}
DRY_CANDIDATES = 64  # candidates asked for when DRY may demote the likeliest (even a greedy request's)


def range_text(name: str) -> str:
    lo, hi, open_lo = RANGES[name]
    if hi is None:
        return f"must be {'>' if open_lo else '>='} {lo}"
    return f"must be in {'(' if open_lo else '['}{lo:g}, {hi:g}]"


def check_range(name: str, value) -> None:
    """RequestError naming `name` unless value is a finite number inside its range."""
    lo, hi, open_lo = RANGES[name]
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > lo if open_lo else value >= lo) and (hi is None or value <= hi))
    if not ok:
        raise RequestError(f"invalid {name}: {range_text(name)}, got {value!r}", name)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = _D["temperature"]
    top_k: int = _D["top_k"]  # 0 (or -1): no top-k limit
    top_p: float = _D["top_p"]
    min_p: float = _D["min_p"]
    repetition_penalty: float = _D["repetition_penalty"]
    presence_penalty: float = _D["presence_penalty"]
    frequency_penalty: float = _D["frequency_penalty"]
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = _D["seed"]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many alternatives per token
    # score the prompt: each prompt token's logprob given those before it, with this many alternatives (vLLM's);
    # its rows are computed in the prompt's own prefill (no prefix-cache hit), at temperature 1, unprocessed
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    dry_multiplier: float = _D["dry_multiplier"]  # DRY (runtime/core/dry.py): off at 0
    dry_base: float = _D["dry_base"]
    dry_allowed_length: int = _D["dry_allowed_length"]
    dry_penalty_last_n: int = _D["dry_penalty_last_n"]
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DEFAULT_BREAKERS))
    constraint: object = None  # structured output: a runtime.core.constraints.Constraint the text must match
    thinking_budget: int | None = None  # a reasoning model closes its thinking block after this many tokens in it

    def validate(self, vocab_size: int | None = None) -> None:
        integers = ("max_tokens", *(f.name for f in SAMPLING_FIELDS if f.kind == "integer" and f.range))
        for name in integers:
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise RequestError(f"invalid {name}: must be an integer", name)
        for name in ("max_tokens", *(f.name for f in SAMPLING_FIELDS if f.range)):
            check_range(name, getattr(self, name))
        if (not isinstance(self.dry_sequence_breakers, list)
                or any(not isinstance(s, str) or not s for s in self.dry_sequence_breakers)):
            raise RequestError("invalid dry_sequence_breakers: must be a list of non-empty strings",
                               "dry_sequence_breakers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise RequestError(f"invalid {name}: must be an integer", name)
                check_range(name, value)
        if self.thinking_budget is not None:
            if not isinstance(self.thinking_budget, int) or isinstance(self.thinking_budget, bool):
                raise RequestError("invalid thinking_budget: must be an integer", "thinking_budget")
            check_range("thinking_budget", self.thinking_budget)
        for tid, value in self.logit_bias.items():
            check_range("logit_bias", value)
            if vocab_size is not None and not (0 <= int(tid) < vocab_size):
                raise RequestError(f"invalid logit_bias: token id {tid} is outside the vocabulary", "logit_bias")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("invalid stop: stop strings must be non-empty strings", "stop")
        for tid in self.stop_token_ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise RequestError(f"invalid stop_token_ids: {tid!r} is not a token id of this vocabulary",
                                   "stop_token_ids")

    @property
    def top_k_limit(self) -> int:
        return max(0, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def logits_temperature(self) -> float:
        """The temperature the graph divides the logits by: 1 for a greedy request (its order is all that counts)."""
        return 1.0 if self.greedy else self.temperature

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

    def candidates(self, vocab_size: int) -> int:
        """How many top-K candidates to ask the graph for."""
        want = 1 if self.greedy else (self.top_k_limit or DEFAULT_CANDIDATES)
        if self.dry:  # the penalized likeliest make room: more than top-k, or than greedy's one
            want = max(want, DRY_CANDIDATES)
        want = max(want, (self.logprobs or 0) + 1)
        return max(1, min(want, vocab_size))


def make_rng(seed: int | None) -> random.Random:
    return random.Random(seed) if seed is not None else random.Random()


def choose(ids: list[int], logprobs: list[float], params: SamplingParams, rng: random.Random) -> int:
    """Pick one token from sorted candidates (best first)."""
    if params.greedy or len(ids) == 1:
        return ids[0]
    n = len(ids)
    if params.top_k_limit:
        n = min(n, params.top_k_limit)
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
