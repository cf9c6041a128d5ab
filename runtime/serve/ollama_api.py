"""Ollama's API on the server, beside OpenAI's (`ruvllm serve --no-ollama-api` leaves it out): /api/chat,
/api/generate, /api/tags, /api/show, /api/ps, /api/version. Each request runs as the OpenAI request it means
(ollama_protocol.py), through the same parser, queue, keys, limits, adapters and users; streams are NDJSON.
"""

from __future__ import annotations

import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from runtime.errors import ContextLengthError, RequestError
from runtime.serve import ollama_protocol as O
from runtime.serve import openai_protocol as P
from runtime.serve.openai_stream import ChunkStream, collect

# the Ollama API version this one follows (docs/api.md of Ollama 0.12); clients read it to pick features
OLLAMA_VERSION = "0.12.0"


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class OllamaRoutes:
    def __init__(self, models: dict, completions, read_json) -> None:
        self.models, self.completions, self.read_json = models, completions, read_json

    def mount(self, app) -> None:
        app.post("/api/chat")(self.chat)
        app.post("/api/generate")(self.generate)
        app.get("/api/tags")(self.tags)
        app.get("/api/ps")(self.ps)
        app.post("/api/show")(self.show)
        app.get("/api/version")(self.version)

    def _names(self) -> dict[str, object]:
        """Every name a request may use: each served model, and its adapters (not users': those are picked by
        `user`, never named) -> the served model."""
        names = {}
        for served in self.models.values():
            names[served.name] = served
            for adapter in served.engine.adapter_paths():
                if not adapter.startswith("user:"):
                    names[adapter] = served
        return names

    async def _body(self, request: Request) -> dict:
        try:
            body = await self.read_json(request)
        except P.ProtocolError as err:
            raise O.OllamaError(err.message) from None
        if not isinstance(body, dict):
            raise O.OllamaError("the request body must be a JSON object")
        return body

    async def chat(self, request: Request):
        try:
            body = await self._body(request)
            model = O.served_name(body.get("model"), self._names())
            if not body.get("messages"):  # Ollama's way to load (or, keep_alive 0, unload) a model
                return self._loaded(model, body, {"message": {"role": "assistant", "content": ""}})
            return await self._run(request, O.chat_body(body, model), model, chat=True, as_chat=True)
        except O.OllamaError as err:
            return _error(err.message, err.status)

    async def generate(self, request: Request):
        try:
            body = await self._body(request)
            names = self._names()
            model = O.served_name(body.get("model"), names)
            if not body.get("prompt"):
                return self._loaded(model, body, {"response": ""})
            templated = names[model].engine.prompts.chat_template is not None
            openai, chat = O.generate_body(body, model, templated)
            return await self._run(request, openai, model, chat=chat, as_chat=False)
        except O.OllamaError as err:
            return _error(err.message, err.status)

    @staticmethod
    def _loaded(model: str, body: dict, empty: dict) -> dict:
        reason = "unload" if body.get("keep_alive") in (0, "0", "0s") else "load"
        return {"model": model, "created_at": O.now_iso(), **empty, "done": True, "done_reason": reason}

    async def _run(self, request: Request, openai: dict, model: str, chat: bool, as_chat: bool):
        started = time.monotonic()
        try:
            served, parsed, rids = await self.completions.start(request, openai, chat)
        except P.ProtocolError as err:
            return _error(err.message, err.status)
        except (ContextLengthError, RequestError) as err:
            return _error(str(err))
        if not parsed.stream:
            resp, lasts, first = await collect(served.engine, rids, parsed, served.name, chat)
            if lasts is None:
                return _error(resp["error"]["message"], 400 if resp["error"]["type"] == "invalid_request_error" else 503)
            self.completions.observe(served.name, lasts, started, first, parsed.n)
            return O.whole(resp, model, chat, as_chat, started, first)

        async def lines():
            chunks = ChunkStream(served.engine, rids, parsed, served.name, chat)
            out = O.StreamLines(model, as_chat, started)
            async for payload in chunks:  # leaving early (a disconnect) aborts the request
                for obj in out.feed(payload):
                    yield json.dumps(obj, ensure_ascii=False) + "\n"
            if chunks.complete:
                self.completions.observe(served.name, chunks.lasts, started, chunks.first, parsed.n)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def _cards(self, running: bool) -> list[dict]:
        out = []
        for name, served in self._names().items():
            manifest = served.engine.manifest
            card = {"name": O.listed_name(name), "model": O.listed_name(name),
                    "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(served.created)),
                    "size": O.package_size(manifest), "digest": O.package_digest(manifest),
                    "details": O.package_details(manifest)}
            if running:  # every served model stays loaded while the server runs
                card.update(expires_at="2999-01-01T00:00:00Z", size_vram=0)
            out.append(card)
        return out

    async def tags(self):
        return {"models": self._cards(running=False)}

    async def ps(self):
        return {"models": self._cards(running=True)}

    async def show(self, request: Request):
        try:
            body = await self._body(request)
            names = self._names()
            model = O.served_name(body.get("model") or body.get("name"), names)
        except O.OllamaError as err:
            return _error(err.message, err.status)
        served = names[model]
        manifest, prompts = served.engine.manifest, served.engine.prompts
        arch = manifest.get("architecture", "")
        capabilities = ["completion"]
        if prompts.chat_template is not None and prompts.chat_template.takes_tools:
            capabilities.append("tools")
        if prompts.think is not None:
            capabilities.append("thinking")
        defaults = served.engine.sampling_defaults
        return {"modelfile": "", "license": "", "template": prompts.chat_template.source if prompts.chat_template else "",
                "parameters": "\n".join(f"{k} {v}" for k, v in defaults.items()),
                "details": O.package_details(manifest), "capabilities": capabilities,
                "model_info": {"general.architecture": arch,
                               "general.parameter_count": (manifest.get("config") or {}).get("num_parameters"),
                               f"{arch}.context_length": prompts.max_context},
                "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(served.created))}

    async def version(self):
        return {"version": OLLAMA_VERSION}
