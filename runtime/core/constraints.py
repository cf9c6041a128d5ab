"""Structured output: what a request's text must match, and the matcher that enforces it token by token.

A Constraint says what (a JSON schema, any JSON object, a regex, one of some strings, a Lark grammar);
the backend's guide (natively runtime/backends/guidance.py, on llguidance; in the page
runtime/core/token_guide.py, pure Python) compiles it into a Matcher per request. Each step the
matcher gives its next-token mask as a bitmask, which the backend turns into the step's logits_mask
row (0 for an allowed token, -inf for a forbidden one; the graph adds it before the temperature, so
sampling and log-probabilities see only allowed tokens), and consumes the token chosen. Pure standard
library: the engine only holds the matcher and asks it these three things.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from runtime.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it: one space after ',' and ':', none elsewhere (llguidance's compile options;
# a schema's x-guidance overrides them). Flexible whitespace let small models fill their budget with newlines
# between tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    value: object = None  # the schema (a dict), the regex, the choices (strings), the Lark grammar

    def __post_init__(self) -> None:
        kind, value = self.kind, self.value
        if kind not in KINDS:
            raise RequestError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})", "response_format")
        ok = {"json_schema": isinstance(value, (dict, bool)), "json_object": value is None,
              "regex": isinstance(value, str) and bool(value), "grammar": isinstance(value, str) and bool(value),
              "choice": isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)}
        if not ok[kind]:
            what = {"json_schema": "a JSON schema object", "json_object": "nothing", "regex": "a non-empty string",
                    "grammar": "a non-empty Lark grammar", "choice": "a non-empty list of strings"}[kind]
            raise RequestError(f"invalid {kind} constraint: expected {what}", "response_format")

    def key(self) -> str:
        """A stable text of the constraint (a cache key for its compiled grammar)."""
        return json.dumps([self.kind, self.value], sort_keys=True)


class Matcher(Protocol):
    def allowed_bits(self):
        """The next token's mask: a little-endian bitmask over the vocabulary (bit i set: token i allowed),
        as bytes or any buffer of them."""
        ...

    def consume(self, token: int) -> bool:
        """Advance by the chosen token; False if the grammar does not allow it."""
        ...

    def is_stopped(self) -> bool:
        """Whether the text is complete: the grammar allows nothing more but the end."""
        ...
