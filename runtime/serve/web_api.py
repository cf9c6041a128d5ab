"""The engine as the page sees it: what web/src/worker.js calls inside Pyodide.

The model worker (web/src/ort_worker.js) fetches the package and keeps the graphs in onnxruntime-web;
the engine worker writes the small files (manifest, tokenizer, chat template) into Pyodide's file
system. Requests and results cross the worker boundary as JSON text, shaped like OpenAI's
chat/completions.
"""

from __future__ import annotations

import json

from runtime.backends.web import WebBackend
from runtime.core.async_engine import AsyncEngine
from runtime.core.config import EngineConfig
from runtime.core.engine import Engine
from runtime.errors import ContextLengthError, RequestError
from runtime.package import load_package
from runtime.serve import openai_protocol as P
from runtime.serve.feedback_protocol import check_user, parse_feedback
from runtime.serve.openai_stream import ChunkStream, collect, queue_request
from runtime.serve.personalization import ADAPTER_PREFIX
from runtime.serve.request_limits import default_max_request_bytes, too_large_body
from runtime.serve.web_personal import PageUsers


class WebEngine:
    def __init__(self, package_dir: str, runner, graph_files: list[str], model_name: str,
                 kv_memory_mb: int | None = None, kv_dtype: str = "fp32", max_request_bytes: int | None = None,
                 user: str | None = None, stepper: str = "onnxruntime", **engine_options) -> None:
        """engine_options: EngineConfig fields the page's caller chose; the rest are EngineConfig.web()'s.
        kv_dtype: the KV pool's numbers, "fp32", "int8" or "int4" (WebBackend); stepper: what runs the model
        worker's steps, "onnxruntime" or "wasm-step" (web/src/ort_worker.js's choice). max_request_bytes: the largest
        request (its JSON in UTF-8) taken, by default the server's rule for this context. user: the page's
        user (createEngine's `user`): their adapter serves requests that name no other user, and feedback
        that names none teaches them (runtime/serve/web_personal.py)."""
        pkg = load_package(package_dir, elsewhere=tuple(graph_files))
        self.model_name = model_name
        if kv_memory_mb is not None:
            engine_options["kv_memory"] = int(kv_memory_mb) << 20
        engine = Engine(pkg, WebBackend(pkg, runner, kv_dtype, stepper), EngineConfig.web(**engine_options))
        self.aengine = AsyncEngine(engine, use_thread=False)
        self.max_request_bytes = int(max_request_bytes or default_max_request_bytes(engine.prompts.max_context))
        self._jobs: dict[str, list[str]] = {}  # the page's request id -> the engine's (one per choice)
        self.user = check_user(user) if user is not None else None
        self.users = PageUsers(self.aengine, runner)

    async def create(self, job: str, body_json: str, emit, kind: str = "chat") -> None:
        """Run one chat.completions.create (kind "chat") or completions.create ("completion": a text prompt,
        as a base model without a chat template needs); emit(kind, json_text) with kind chunk | response |
        error."""
        chat = kind != "completion"
        if len(body_json) > self.max_request_bytes or len(body_json.encode("utf-8")) > self.max_request_bytes:
            emit("error", self.too_large())
            return
        try:
            body = P.parse_body(body_json)
            if isinstance(body, dict):
                body.setdefault("model", self.model_name)
            parsed = (P.parse_chat if chat else P.parse_completion)(body, self.aengine.sampling_defaults)
            adapter = self._adapter(body.get("model"))
            if adapter is None and (parsed.user or self.user):
                adapter = await self.users.adapter_for(check_user(parsed.user or self.user))
            rids = queue_request(self.aengine, parsed, adapter)
        except P.ProtocolError as err:
            emit("error", json.dumps(err.body()))
            return
        except ContextLengthError as err:
            emit("error", json.dumps(P.error_body(str(err), param="messages" if chat else "prompt",
                                                  code="context_length_exceeded")))
            return
        except RequestError as err:
            emit("error", json.dumps(P.error_body(str(err), param=err.param)))
            return
        self._jobs[job] = rids
        try:
            if parsed.stream:
                async for payload in ChunkStream(self.aengine, rids, parsed, self.model_name, chat=chat):
                    emit("error" if "error" in payload else "chunk", json.dumps(payload, ensure_ascii=False))
            else:
                body, lasts, _ = await collect(self.aengine, rids, parsed, self.model_name, chat=chat)
                emit("error" if lasts is None else "response", json.dumps(body, ensure_ascii=False))
        finally:
            self._jobs.pop(job, None)

    def too_large(self) -> str:
        """The error JSON of a request over max_request_bytes (the worker refuses one before copying it here)."""
        return json.dumps(too_large_body(self.max_request_bytes, "createEngine's maxRequestBytes"))

    def _adapter(self, model) -> str | None:
        """A request's `model`: this package (or no name), or an adapter loaded under that name."""
        if model in (None, self.model_name):
            return None
        if self.aengine.has_adapter(model) and not str(model).startswith(ADAPTER_PREFIX):  # users' are hidden
            return model
        raise P.model_not_found(str(model))

    # adapters: web/src/worker.js writes an adapter's files into Pyodide's file system, then adds it here
    def add_adapter(self, name: str, path: str, experts_json: str | None = None) -> str:
        """JSON {name, kind, rank, targets} of the adapter (or X-LoRA: experts_json names its experts'
        folders) now served under `name`; AdapterError says why not."""
        info = self.aengine.add_adapter(name, path, json.loads(experts_json) if experts_json else None)
        experts = getattr(info, "experts", None)
        targets = sorted({t for e in experts for t in e.targets}) if experts else list(info.targets)
        return json.dumps({"name": info.name, "kind": info.kind, "rank": info.rank, "targets": targets,
                           "experts": [e.name for e in experts] if experts else None})

    def remove_adapter(self, name: str) -> bool:
        """New requests can no longer name it; those running on it finish."""
        return self.aengine.remove_adapter(name)

    # per-user adaptation: engine.feedback / forget / userState in the page
    async def feedback(self, body_json: str) -> str:
        """Learn from one feedback body (runtime/serve/feedback_protocol.py; its user, else the page's):
        JSON of what was learned, or {"error": ...}."""
        async def learn():
            user, model, what = parse_feedback(P.parse_body(body_json), self.user)
            if model not in (None, self.model_name):
                raise P.ProtocolError(f"feedback teaches this page's model {self.model_name!r}, not {model!r}", "model")
            return {**await self.users.feedback(user, what), "model": self.model_name}
        return await _answer(learn)

    async def forget(self, user: str | None = None) -> str:
        """Reset a user (else the page's): JSON {"deleted": bool} or {"error": ...}."""
        async def forget():
            return {"deleted": await self.users.forget(check_user(user or self.user))}
        return await _answer(forget)

    async def user_state(self, user: str | None = None) -> str:
        """A user's (else the page's) stored state: version, feedbacks, tokens; or {"error": ...}."""
        async def state():
            return await self.users.state(check_user(user or self.user))
        return await _answer(state)

    async def user_adapter(self, user: str | None = None) -> str:
        """JSON {"path": the PEFT folder of a user's (else the page's) adapter, or null}, or {"error": ...}."""
        async def folder():
            path = await self.users.folder(check_user(user or self.user))
            return {"path": str(path) if path else None}
        return await _answer(folder)

    def abort(self, job: str) -> bool:
        rids = self._jobs.get(job) or []
        return any([self.aengine.abort(rid) for rid in rids])

    # the page saves the last prompt's cached K/V blocks and restores them after a reload
    def recent_prompt_blocks(self, max_blocks: int) -> str:
        """JSON [[key hex, block], ...]: what the model worker should save."""
        blocks = self.aengine.engine.scheduler.recent_prompt_blocks(int(max_blocks))
        return json.dumps([[key.hex(), block] for key, block in blocks])

    def restore_prompt_blocks(self, keys_json: str) -> str:
        """JSON [block, ...] for saved keys (hex): the model worker writes their K/V there next."""
        keys = [bytes.fromhex(k) for k in json.loads(keys_json)]
        return json.dumps(self.aengine.engine.scheduler.restore_prompt_blocks(keys))

    def forget_prompt_blocks(self, blocks_json: str) -> None:
        self.aengine.engine.scheduler.forget_prompt_blocks(json.loads(blocks_json))

    def stats(self) -> str:
        return json.dumps(self.aengine.stats())

    def sampling_defaults(self) -> str:
        """What a request that leaves a sampling field out gets (the model's settings, else chat defaults)."""
        return json.dumps(self.aengine.sampling_defaults)

    async def unload(self) -> None:
        await self.aengine.shutdown(drain=False)


async def _answer(work) -> str:
    """JSON of what `work` returns, or of the error a bad request gets."""
    try:
        return json.dumps(await work())
    except P.ProtocolError as err:
        return json.dumps(err.body())
    except RequestError as err:
        return json.dumps(P.error_body(str(err), param=err.param))
