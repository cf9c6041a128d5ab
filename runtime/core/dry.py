"""DRY ("don't repeat yourself"), the repetition sampler of koboldcpp and llama.cpp.

A token that would extend a stretch of text already seen (the text's last tokens, matched earlier and
then followed by that token) loses `multiplier * base ** (length - allowed_length)` of its logit, the
match length counted in tokens and broken by any token whose text holds a sequence breaker. Unlike a
repetition penalty it leaves single words alone and grows with the loop, so it stops the long verbatim
repeats small models fall into. It runs after the graph, on the step's top-K candidates (sampling.py):
a penalized token outside them was already unlikely and stays out.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MAX_MATCH = 50  # longer matches add nothing: base ** 48 already outweighs any logit
DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's


def match_penalties(tokens: list[int], multiplier: float, base: float, allowed_length: int, last_n: int,
                    is_breaker: Callable[[int], bool]) -> dict[int, float]:
    """Token id -> how much DRY takes off its logit as the next token after `tokens`."""
    n = len(tokens)
    start = 0 if last_n < 0 else max(0, n - last_n)
    if multiplier <= 0 or n - start < 2 or last_n == 0 or is_breaker(tokens[-1]):
        return {}
    last, longest = tokens[-1], {}
    for j in range(n - 2, start - 1, -1):  # each earlier place the last token was seen, and what followed it
        if tokens[j] != last:
            continue
        length = 1
        while (length < MAX_MATCH and j - length >= start and tokens[j - length] == tokens[n - 1 - length]
               and not is_breaker(tokens[j - length])):
            length += 1
        follower = tokens[j + 1]
        if length >= allowed_length and length > longest.get(follower, 0):
            longest[follower] = length
    return {t: multiplier * base ** (length - allowed_length) for t, length in longest.items()}


def penalize(ids: list[int], logprobs: list[float], penalties: dict[int, float],
             temperature: float) -> tuple[list[int], list[float]]:
    """The candidates (best first) with the penalties taken off their logits, renormalized and resorted.

    The graph's log-probabilities are logits / temperature over the whole vocabulary (temperature 1 when
    greedy), so a penalty p moves a candidate by -p / temperature, and the mass it loses leaves the total."""
    if not penalties or not any(t in penalties for t in ids):
        return ids, logprobs
    scale = 1.0 / temperature
    moved = [lp - penalties.get(t, 0.0) * scale for t, lp in zip(ids, logprobs)]
    lost = sum(math.exp(lp) - math.exp(m) for lp, m in zip(logprobs, moved))
    shift = -math.log(max(1e-30, 1.0 - lost))
    order = sorted(range(len(ids)), key=lambda i: -moved[i])
    return [ids[i] for i in order], [moved[i] + shift for i in order]


class BreakerTable:
    """Whether a token's text holds one of a set of sequence breakers, decoded as tokens are first met."""

    def __init__(self, decode: Callable[[int], str], breakers: tuple[str, ...]) -> None:
        self.decode, self.breakers, self.seen = decode, breakers, {}

    def __call__(self, token: int) -> bool:
        hit = self.seen.get(token)
        if hit is None:
            text = self.decode(token)
            hit = self.seen[token] = any(b in text for b in self.breakers)
        return hit
