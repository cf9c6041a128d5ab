"""vLLM's tokenizer endpoints on the server: GET /tokenizer_info, POST /tokenize and /detokenize.

Clients that score a served model by its own tokens use them instead of a local copy of the tokenizer:
lm-evaluation-harness's `local-completions` turns to them by itself when /tokenizer_info and /tokenize answer
(its `tokenizer_backend="auto"`), so an evaluation needs no Hugging Face tokenizer and no network.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.errors import ContextLengthError, RequestError
from runtime.serve import openai_protocol as P


class TokenizerRoutes:
    def __init__(self, models: dict, read_json) -> None:
        self.models, self.read_json = models, read_json

    def mount(self, app) -> None:
        app.get("/tokenizer_info")(self.info)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)

    def _model(self, name) -> object:
        """The served model a body names (the first one when it names none)."""
        if name is None:
            return next(iter(self.models.values()))
        if not isinstance(name, str) or name not in self.models:
            raise P.model_not_found(str(name))
        return self.models[name]

    async def info(self, model: str | None = None):
        """The tokenizer's special tokens, its chat template and the context length."""
        try:
            served = self._model(model)
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        prompts = served.engine.prompts
        tok = prompts.tokenizer
        return {"tokenizer_class": "ruvllm", "model_max_length": prompts.max_context,
                "eos_token": tok.meta.get("eos_token"), "bos_token": tok.meta.get("bos_token"),
                "pad_token": tok.meta.get("pad_token"), "add_bos_token": tok.add_bos,
                "chat_template": prompts.chat_template.source if prompts.chat_template else None}

    async def _request(self, request: Request) -> tuple[dict, object]:
        """(the JSON object body, the PromptEncoder of the model it names)."""
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise P.ProtocolError("the request body must be a JSON object")
        return body, self._model(body.get("model")).engine.prompts

    async def tokenize(self, request: Request):
        """{prompt, add_special_tokens} or {messages, add_generation_prompt}: {tokens, count, max_model_len}."""
        try:
            body, prompts = await self._request(request)
            special = P._get(body, "add_special_tokens", (bool,), True)
            if "messages" in body:
                if prompts.chat_template is None:
                    raise P.ProtocolError("this model has no chat template", "messages")
                text = prompts.chat_template.render(P.parse_messages(body),
                                                    P._get(body, "add_generation_prompt", (bool,), True))
                ids = prompts.tokenizer.encode(text, add_bos=False)
            else:
                text = P._get(body, "prompt", (str,))
                if text is None:
                    raise P.ProtocolError("'prompt' (a string) or 'messages' is required", "prompt")
                ids = prompts.tokenizer.encode(text, add_bos=None if special else False)
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except (RequestError, ContextLengthError) as err:
            return JSONResponse(P.error_body(str(err), param=getattr(err, "param", None)), status_code=400)
        return {"tokens": ids, "count": len(ids), "max_model_len": prompts.max_context}

    async def detokenize(self, request: Request):
        """{tokens}: {prompt}, the text of those token ids."""
        try:
            body, prompts = await self._request(request)
            ids = P._get(body, "tokens", (list,))
            if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < prompts.vocab_size
                                      for t in ids):
                raise P.ProtocolError("'tokens' must be an array of this vocabulary's token ids", "tokens")
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return {"prompt": prompts.tokenizer.decode(ids)}
