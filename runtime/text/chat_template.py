"""Chat templates rendered with jinja2's sandboxed environment, natively and in Pyodide."""

from __future__ import annotations

from runtime.errors import RequestError


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self._error = TemplateError
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str):
            raise RequestError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        env.filters.setdefault("tojson", _tojson)
        self.template = env.from_string(source)
        self.source = source  # as the package has it (GET /tokenizer_info gives it to clients)
        # a template that reads `tools` renders them (and tool calls and results) in its model's own format
        self.takes_tools = "tools" in source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise RequestError("each message needs a 'role' and a 'content'")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except self._error as err:
            raise RequestError(f"chat template failed: {err}") from err


def _tojson(value, indent=None):
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)
