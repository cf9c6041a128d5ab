"""A reply on the terminal with a reasoning model's thinking dimmed (ANSI faint on a terminal; elsewhere the thinking
ends in a blank line) and kept apart from the answer, for `ruvllm generate` and `ruvllm chat`."""

from __future__ import annotations

import sys

from runtime.text.reasoning import ReasoningSplitter, prompt_state

DIM, PLAIN = "\033[2m", "\033[0m"


class ReplyPrinter:
    """Writes one reply's outputs as they come; `answer` and `thought` hold what was written of each."""

    def __init__(self, engine, prompt_ids: list[int], out=None, write: bool = True) -> None:
        self.out, self.write = out or sys.stdout, write
        tags = engine.prompts.think
        self.split = ReasoningSplitter(tags, prompt_state(prompt_ids, tags, engine.tokenizer.decode)) if tags else None
        self.tty = getattr(self.out, "isatty", lambda: False)()
        self.thinking = False
        self.answer: list[str] = []
        self.thought: list[str] = []

    def feed(self, delta: str, token_ids: list[int]) -> None:
        thought, answer = self.split.feed(delta, token_ids) if self.split else ("", delta)
        if thought:
            self.thought.append(thought)
            if not self.thinking:
                self._put(DIM if self.tty else "")
                self.thinking = True
            self._put(thought)
        if answer:
            self.answer.append(answer)
            self._end_thinking()
            self._put(answer)

    def _end_thinking(self) -> None:
        if self.thinking:
            self._put(PLAIN + "\n\n" if self.tty else "\n\n")
            self.thinking = False

    def close(self) -> None:
        if self.thinking:
            self._put(PLAIN if self.tty else "")
            self.thinking = False

    def _put(self, text: str) -> None:
        if self.write and text:
            self.out.write(text)
            self.out.flush()
