"""Structured output natively: llguidance compiles a request's constraint against the package's tokenizer
and computes each step's token mask (a bitmask, expanded here into the logits_mask row).

The tokenizer tables llguidance builds (~0.3 s for a 49k vocabulary) are made once per package, on
the first constrained request; compiled grammars are cached by the constraint's text, so n choices or
repeated requests with one schema compile once.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

from runtime.core.constraints import JSON_LAYOUT, Constraint
from runtime.errors import RequestError

_GRAMMARS = 64  # compiled grammars kept


class Guide:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)
        self._grammars: OrderedDict[str, str] = OrderedDict()

    def grammar(self, c: Constraint) -> str:
        """llguidance's grammar for the constraint; RequestError naming what is wrong with it."""
        key = c.key()
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        M = self._llg.LLMatcher
        try:
            if c.kind == "json_schema":
                grammar = M.grammar_from_json_schema(c.value, defaults=JSON_LAYOUT)
            elif c.kind == "json_object":
                grammar = M.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            elif c.kind == "regex":
                grammar = M.grammar_from_regex(c.value)
            elif c.kind == "choice":
                grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in c.value))
            else:
                grammar = M.grammar_from_lark(c.value)
        except (ValueError, TypeError) as err:
            raise RequestError(f"invalid {c.kind}: {err}", "response_format") from None
        error = M.validate_grammar(grammar, self.tokenizer)
        if error:
            raise RequestError(f"invalid {c.kind}: {error}", "response_format")
        self._grammars[key] = grammar
        while len(self._grammars) > _GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def matcher(self, c: Constraint) -> LlgMatcher:
        m = self._llg.LLMatcher(self.tokenizer, self.grammar(c), log_level=0)
        if m.is_error():
            raise RequestError(f"invalid {c.kind}: {m.get_error()}", "response_format")
        return LlgMatcher(m, self.vocab_size)


class LlgMatcher:
    """One request's llguidance matcher (runtime.core.constraints.Matcher)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.m = matcher
        self.vocab_size = vocab_size
        self._bits = np.empty((vocab_size + 31) // 32, np.int32)

    def allowed_bits(self) -> np.ndarray:
        self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return self._bits

    def consume(self, token: int) -> bool:
        return bool(self.m.consume_token(token))

    def is_stopped(self) -> bool:
        return bool(self.m.is_stopped())
