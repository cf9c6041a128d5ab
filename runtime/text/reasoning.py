"""A reasoning model's thinking block (`<think>` ... `</think>`: DeepSeek-R1's distills, Qwen3): which tokens open
and close it, whether a prompt leaves it open (R1's template opens it in the generation prompt) or closed
(Qwen3's with enable_thinking false), and one reply split into its reasoning and its answer as it streams.

Standard library: the server, the page and the CLI share it. A model has a thinking block when both tags are
tokens of their own in its vocabulary; the split follows those tokens, so a tag that the text merely spells
out is content.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTokens:
    open_id: int
    close_id: int


def think_tokens(tokenizer) -> ThinkTokens | None:
    """The model's thinking tags as single tokens of its vocabulary, or None (not a reasoning model)."""
    ids = {tokenizer.id_to_token.get(i): i for i in tokenizer.added_ids}  # the added tokens only, not the vocabulary
    if OPEN in ids and CLOSE in ids:
        return ThinkTokens(ids[OPEN], ids[CLOSE])
    return None


def prompt_state(prompt_ids: list[int], tags: ThinkTokens, decode) -> str:
    """Where a reply to this prompt starts: "open" (the prompt opened a block the reply continues: R1's
    template), "closed" (the prompt ends with an empty block: thinking turned off) or "free" (the reply may
    open one: Qwen3). decode(ids) -> text."""
    last_open = max((i for i, t in enumerate(prompt_ids) if t == tags.open_id), default=-1)
    last_close = max((i for i, t in enumerate(prompt_ids) if t == tags.close_id), default=-1)
    if last_open > last_close:
        return "open"
    if last_close >= 0 and not decode(prompt_ids[last_close + 1:]).strip():
        return "closed"
    return "free"


class ThinkingBudget:
    """The engine's side of a thinking budget (a request's thinking_budget_tokens): a reply that has thought for
    `budget` tokens inside its block gets the closing tag as its next token, whatever it sampled. A block opens
    in the prompt or as the reply's first token (prompt_state)."""

    def __init__(self, tags: ThinkTokens, budget: int, state: str) -> None:
        self.tags, self.budget = tags, budget
        self.open, self.done, self.used, self.first = state == "open", state == "closed", 0, True

    def next(self, token: int) -> int:
        """The token the reply takes, given the one sampled."""
        first, self.first = self.first, False
        if self.open:
            if token != self.tags.close_id and self.used >= self.budget:
                token = self.tags.close_id
            if token == self.tags.close_id:
                self.open, self.done = False, True
            else:
                self.used += 1
        elif first and not self.done and token == self.tags.open_id:
            self.open = True
        else:
            self.done = True
        return token


class ReasoningSplitter:
    """One reply's text, output by output, as (reasoning, content) deltas: what lies inside the thinking block
    is reasoning, the rest content; the tags' own text is in neither (a stray tag token is dropped too), and
    whitespace that starts either is dropped. `reasoning_tokens` counts the block's tokens, its tags included."""

    def __init__(self, tags: ThinkTokens, state: str) -> None:
        self.tags = tags
        self.inside, self.done = state == "open", state == "closed"
        self.reasoning_tokens, self.first = 0, True
        self._trim = {"reasoning": True, "content": True}

    def _emit(self, kind: str, text: str) -> str:
        if self._trim[kind]:
            text = text.lstrip()
            self._trim[kind] = not text
        return text

    def feed(self, delta: str, token_ids: list[int]) -> tuple[str, str]:
        parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        text = delta
        for token in token_ids:
            first, self.first = self.first, False
            was_inside = self.inside
            if self.inside:
                self.reasoning_tokens += 1
                if token == self.tags.close_id:
                    self.inside, self.done = False, True
            elif first and not self.done and token == self.tags.open_id:  # a block opens the reply or never
                self.inside = True
                self.reasoning_tokens += 1
            else:
                self.done = True
            if token in (self.tags.open_id, self.tags.close_id):  # the text before the tag is the state's it ends
                tag = OPEN if token == self.tags.open_id else CLOSE
                at = text.find(tag)  # -1: a tag that decodes to nothing (special)
                parts["reasoning" if was_inside else "content"].append(text if at < 0 else text[:at])
                text = "" if at < 0 else text[at + len(tag):]
        parts["reasoning" if self.inside else "content"].append(text)
        return self._emit("reasoning", "".join(parts["reasoning"])), self._emit("content", "".join(parts["content"]))
