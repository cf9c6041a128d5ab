"""Prompt-lookup drafting for speculative decoding: no draft model, only the sequence's own text.

A decode step that carries k drafted tokens after the real one computes k + 1 positions in one
pass; when a step's cost is the weights' memory traffic (fp32 in onnxruntime-web), verifying 2–3
tokens costs ~1.2 steps. Drafts come from the most recent earlier occurrence of the sequence's
last n tokens (n from `max_ngram` down to `min_ngram`), the method of vLLM's `ngram` proposer
and llama.cpp's lookup decoding. Verification is exact (the engine accepts a draft token only if
it is the token it would have chosen), so output is unchanged; it only pays when text repeats
(lists, code, names, a model's own loops).
"""

from __future__ import annotations


class PromptLookup:
    """Incremental n-gram index over one sequence: an update per token, a lookup per step."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self._done = 0  # tokens[:_done] are indexed as continuations

    def _catch_up(self, tokens: list[int]) -> None:
        # an n-gram is indexed once its next token exists, so the sequence's own tail never finds itself
        for p in range(max(self._done, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, p) + 1):
                self._index[tuple(tokens[p - n:p])] = p
        self._done = max(self._done, len(tokens))

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching tail: at most k tokens,
        and at most one more than the tail's length (a one-token match is weak evidence; on SmolLM2's
        greedy text this drafts as well as a fixed 2 where little repeats and as a fixed 3 where much does)."""
        if k <= 0:
            return []
        self._catch_up(tokens)
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            p = self._index.get(tuple(tokens[-n:]))
            if p is not None:
                return tokens[p:p + min(k, n + 1)]
        return []
