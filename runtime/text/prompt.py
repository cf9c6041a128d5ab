"""A package's prompt side: text, chat messages or token ids into the ids a request runs on.

It needs no model, so a front end that only routes requests (the Ray Serve ingress) tokenizes
exactly as the engine would, and computes the same prefix-cache keys from the ids.
"""

from __future__ import annotations

from runtime.errors import ContextLengthError, RequestError
from runtime.text.chat_template import ChatTemplate
from runtime.text.reasoning import think_tokens
from runtime.text.tokenizer import Tokenizer


def package_tokenizer(package) -> Tokenizer:
    meta = package.manifest["tokenizer"]
    return Tokenizer.from_file(package.file(meta["file"]), meta)


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None, vocab_size: int,
                 max_context: int) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.vocab_size, self.max_context = vocab_size, max_context
        self.think = think_tokens(tokenizer)  # a reasoning model's thinking tags (runtime/text/reasoning.py), or None

    @classmethod
    def from_package(cls, package, vocab_size: int, max_context: int, tokenizer: Tokenizer | None = None) -> PromptEncoder:
        meta = package.manifest["tokenizer"]
        tokenizer = tokenizer or package_tokenizer(package)
        tmpl = package.chat_template
        template = ChatTemplate(tmpl, meta.get("bos_token"), meta.get("eos_token")) if tmpl else None
        return cls(tokenizer, template, vocab_size, max_context)

    def encode(self, prompt=None, messages: list[dict] | None = None, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> list[int]:
        """The request's token ids: a chat rendered through the template (with `tools` for a template that
        takes them, and `template_kwargs` as its variables: Qwen3's enable_thinking), text encoded, or ids
        checked. A text that cannot fit the context whatever it says (the tokenizer's floor) is refused before
        it is tokenized."""
        if messages is not None:
            if self.chat_template is None:
                raise RequestError("this model package has no chat template")
            extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
            text = self.chat_template.render(messages, add_generation_prompt=True, **extra)
            self._check_floor(text)
            return self.tokenizer.encode(text, add_bos=False)
        if isinstance(prompt, str):
            self._check_floor(prompt)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and len(prompt) >= self.max_context:
            raise self._too_long(len(prompt), "")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary")
            return list(prompt)
        raise RequestError("a request needs a prompt (text or token ids) or chat messages")

    def request_ids(self, prompt=None, messages: list[dict] | None = None) -> list[int]:
        """encode(), refusing a prompt that is empty or leaves no room in the context: the checks a request
        gets wherever it is tokenized (the engine, or the Ray Serve ingress before routing)."""
        ids = self.encode(prompt, messages)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise self._too_long(len(ids), "")
        return ids

    def _check_floor(self, text: str) -> None:
        floor = self.tokenizer.min_tokens(text)
        if floor is not None and floor >= self.max_context:
            raise self._too_long(floor, "at least ")

    def _too_long(self, n: int, bound: str) -> ContextLengthError:
        return ContextLengthError(f"the prompt has {bound}{n} tokens; this model's context is {self.max_context} tokens")
