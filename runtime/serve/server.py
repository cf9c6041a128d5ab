"""`ruvllm serve`: an OpenAI-compatible HTTP server on FastAPI + uvicorn over the AsyncEngine.

Native only (FastAPI, uvicorn, prometheus_client). Requests are parsed from the raw body so every
client mistake gets a 4xx in OpenAI's error shape naming the field, never a 500. A streaming
client that disconnects has its request aborted, which frees its KV blocks within a step.
No request can stall the others: bodies are bounded before they are read (request_limits), a
prompt past the context is refused before it is tokenized, and templates and tokenizing run off
the event loop. Keys have names (api_keys); adapters load at run time only from named folders
(adapter_roots).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.core.adapters import UnknownAdapterError
from runtime.core.async_engine import AsyncEngine
from runtime.errors import ContextLengthError, RequestError
from runtime.serve import openai_protocol as P
from runtime.serve import openai_responses as R
from runtime.serve.adapter_api import AdapterRoutes
from runtime.serve.adapter_roots import AdapterRoots
from runtime.serve.api_keys import ANONYMOUS, ApiKeys, access_warnings
from runtime.serve.feedback_api import FeedbackRoutes, key_name
from runtime.serve.feedback_protocol import check_user
from runtime.serve.ollama_api import OllamaRoutes
from runtime.serve.openai_stream import ChunkStream, collect, encode_request, queue_request
from runtime.serve.personalization import ADAPTER_PREFIX, personalization_for
from runtime.serve.request_limits import BodyLimit, default_max_request_bytes
from runtime.serve.slots_api import SlotRoutes
from runtime.serve.tokenizer_api import TokenizerRoutes


@dataclass
class ServedModel:
    name: str
    engine: AsyncEngine
    created: int
    personal: object = None  # personalization.Personalization when `--personalize` is on


# /metrics from each engine's stats(): metric -> (stats key, help)
ENGINE_GAUGES = {
    "ruvllm_requests_running": ("running", "Requests being generated"),
    "ruvllm_requests_waiting": ("waiting", "Requests queued for admission"),
    "ruvllm_kv_blocks_used": ("kv_blocks_used", "KV blocks held by requests"),
    "ruvllm_kv_blocks_total": ("kv_blocks_total", "KV blocks in the pool"),
    "ruvllm_prefix_cache_blocks": ("prefix_cache_blocks", "Blocks in the prefix cache"),
}
ENGINE_COUNTERS = {
    "ruvllm_prefix_cache_queries": ("prefix_cache_queries", "Prompt blocks looked up"),
    "ruvllm_prefix_cache_hits": ("prefix_cache_hits", "Prompt blocks found in the prefix cache"),
    "ruvllm_preemptions": ("preemptions", "Sequences preempted for KV space"),
    "ruvllm_requests_aborted": ("aborted", "Requests aborted (client gone, shutdown)"),
    "ruvllm_spec_draft_tokens": ("draft_tokens", "Tokens drafted by prompt lookup"),
    "ruvllm_spec_accepted_tokens": ("accepted_draft_tokens", "Drafted tokens verified and emitted"),
    "ruvllm_requests_retried": ("retried", "Requests run again on another replica after theirs failed (Ray Serve)"),
}


class Metrics:
    """Prometheus metrics in a registry of the app's own (several apps can live in one process)."""

    def __init__(self, models: dict[str, ServedModel]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = CollectorRegistry()
        self.requests = Counter("ruvllm_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("ruvllm_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model"], registry=self.registry)
        self.generation_tokens = Counter("ruvllm_generation_tokens", "Generated tokens of finished requests",
                                         ["model"], registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("ruvllm_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=buckets, registry=self.registry)
        self.latency = Histogram("ruvllm_request_latency_seconds", "Request latency, end to end", ["model"],
                                 buckets=buckets + (120, 300), registry=self.registry)
        self.key_requests = Counter("ruvllm_key_requests", "Authenticated /v1 requests by API key name and status",
                                    ["key", "status"], registry=self.registry)

        class EngineCollector:
            def collect(self):
                stats = {name: m.engine.stats() for name, m in models.items()}
                for metric, (key, doc) in ENGINE_GAUGES.items():
                    g = GaugeMetricFamily(metric, doc, labels=["model"])
                    for name, s in stats.items():
                        g.add_metric([name], s.get(key, 0))
                    yield g
                for metric, (key, doc) in ENGINE_COUNTERS.items():
                    c = CounterMetricFamily(metric, doc, labels=["model"])
                    for name, s in stats.items():
                        c.add_metric([name], s.get(key, 0))
                    yield c

        self.registry.register(EngineCollector())

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    return JSONResponse(P.error_body(message, kind, param, code), status_code=status)


async def read_json(request: Request):
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise P.ProtocolError("the request body is not valid UTF-8") from None
    return P.parse_body(text)


class Completions:
    """POST /v1/chat/completions and /v1/completions: parse, queue, then stream or collect."""

    def __init__(self, models: dict[str, ServedModel], metrics: Metrics, max_queue: int | None,
                 defaults: dict | None) -> None:
        self.models, self.metrics, self.max_queue, self.defaults = models, metrics, max_queue, defaults

    def _parse(self, body, chat: bool) -> tuple[ServedModel, object, str | None]:
        # the model the body names, looked up first for its sampling defaults (`serve`'s flags over them); a
        # body that names none or an unknown one is parsed with the flags alone, and says what is wrong
        name = body.get("model") if isinstance(body, dict) else None
        served = adapter = None
        if isinstance(name, str):
            with contextlib.suppress(P.ProtocolError):
                served, adapter = resolve_model(self.models, name)
        defaults = {**served.engine.sampling_defaults, **(self.defaults or {})} if served else self.defaults
        parsed = P.parse_chat(body, defaults) if chat else P.parse_completion(body, defaults)
        if served is None:
            served, adapter = resolve_model(self.models, parsed.model)
        if self.max_queue is not None and served.engine.num_waiting() >= self.max_queue:
            raise P.ProtocolError("the server is busy: the request queue is full, retry later", status=429,
                                  kind="rate_limit_exceeded", code="queue_full")
        return served, parsed, adapter

    async def start(self, request: Request, body, chat: bool) -> tuple[ServedModel, object, list[str]]:
        """Parse a body, pick the user's adapter, tokenize off the loop and queue: (served, parsed, engine ids).
        Raises ProtocolError, ContextLengthError, RequestError (Ollama's API starts its requests here too)."""
        served, parsed, adapter = self._parse(body, chat)
        if adapter is None and parsed.user and served.personal is not None:  # the user's own adapter
            check_user(parsed.user)
            adapter = await asyncio.to_thread(served.personal.adapter_for, key_name(request), parsed.user)
        # the template and the tokenizer run off the loop: a long prompt never delays the others' steps
        ids = await asyncio.to_thread(encode_request, served.engine.prompts, parsed)
        try:
            return served, parsed, queue_request(served.engine, parsed, adapter, ids)
        except UnknownAdapterError:  # unloaded since resolve_model looked
            raise P.model_not_found(parsed.model) from None

    async def handle(self, request: Request, chat: bool):
        try:
            served, parsed, rids = await self.start(request, await read_json(request), chat)
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except ContextLengthError as err:
            return error_response(400, str(err), param="messages" if chat else "prompt", code="context_length_exceeded")
        except RequestError as err:
            return error_response(400, str(err), param=err.param)
        started = time.monotonic()
        if parsed.stream:
            return StreamingResponse(self._events(served, rids, parsed, chat, started), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, served, rids, parsed, chat, started)

    async def _complete(self, request: Request, served: ServedModel, rids: list[str], parsed, chat: bool,
                        started: float):
        watcher = asyncio.create_task(_abort_on_disconnect(request, served.engine, rids))
        try:
            body, lasts, first = await collect(served.engine, rids, parsed, served.name, chat)
        finally:
            watcher.cancel()
        if lasts is None:  # the request's own fault (400), or the engine's (503)
            return JSONResponse(body, status_code=400 if body["error"]["type"] == "invalid_request_error" else 503)
        self.observe(served.name, lasts, started, first, parsed.n)
        return body

    async def _events(self, served: ServedModel, rids: list[str], parsed, chat: bool, started: float):
        chunks = ChunkStream(served.engine, rids, parsed, served.name, chat)
        async for payload in chunks:  # leaving this loop early (disconnect) aborts the request
            yield f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
        if chunks.complete:
            self.observe(served.name, chunks.lasts, started, chunks.first, parsed.n)
        yield "data: [DONE]\n\n"

    def observe(self, model: str, lasts, started: float, first: float | None, n: int = 1) -> None:
        m = self.metrics
        m.prompt_tokens.labels(model).inc(R.usage(lasts, per_prompt=n)["prompt_tokens"])
        m.generation_tokens.labels(model).inc(sum(o.completion_tokens for o in lasts))
        if first is not None:
            m.ttft.labels(model).observe(first - started)
        m.latency.labels(model).observe(time.monotonic() - started)


def resolve_model(models: dict[str, ServedModel], name: str) -> tuple[ServedModel, str | None]:
    """A request's `model`: a served package, or one of its LoRA adapters (then the adapter's name)."""
    served = models.get(name)
    if served is not None:
        return served, None
    if name.startswith(ADAPTER_PREFIX):  # a user's adapter is theirs: picked by `user`, never named
        raise P.model_not_found(name)
    for served in models.values():
        if served.engine.has_adapter(name):
            return served, name
    raise P.model_not_found(name)


def model_cards(models: dict[str, ServedModel]) -> list[dict]:
    """GET /v1/models: each package, then its adapters with their `parent` (as vLLM lists them)."""
    cards = []
    for m in models.values():
        info = m.engine.backend_info()  # a local engine's backend; Ray's replicas': unknown (None)
        why = info.batch_invariance if info is not None else None
        cards.append({"id": m.name, "object": "model", "created": m.created, "owned_by": "ruvllm", "root": m.name,
                      "parent": None, "batch_invariant": None if why is None else not why,
                      **({"batch_invariance": why} if why else {}),
                      "personalization": m.personal.state() if m.personal is not None else {"enabled": False}})
        for name, path in m.engine.adapter_paths().items():
            if name.startswith(ADAPTER_PREFIX):
                continue
            cards.append({"id": name, "object": "model", "created": m.created, "owned_by": "ruvllm",
                          "root": path, "parent": m.name})
    return cards


def create_app(models: dict[str, ServedModel], api_key: str | None = None, max_queue: int | None = None,
               shutdown_timeout: float = 30.0, defaults: dict | None = None, *, keys: ApiKeys | None = None,
               max_request_bytes: int | None = None, lora_roots: list[str] | None = None, ollama_api: bool = True,
               slot_save_path: str | None = None):
    """ollama_api: Ollama's API beside OpenAI's (runtime/serve/ollama_api.py); slot_save_path: llama.cpp's slot
    save and restore into this folder (slots_api.py). defaults: sampling values for requests that leave a field out.
    keys: named API keys (api_key: one key named "default"); max_request_bytes: the body limit (default
    from the longest context served); lora_roots: runtime adapter loading from these folders (None: off)."""
    metrics = Metrics(models)
    handler = Completions(models, metrics, max_queue, defaults)
    keys = keys if keys is not None else ApiKeys.load(api_key)
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(max(m.engine.prompts.max_context for m in models.values()))
    roots = AdapterRoots(lora_roots) if lora_roots is not None else None

    @asynccontextmanager
    async def lifespan(_app):
        for m in models.values():
            m.engine.start()
        yield
        await asyncio.gather(*(m.engine.shutdown(drain=True, timeout=shutdown_timeout) for m in models.values()))

    app = FastAPI(title="RuvLLM", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.models = models
    app.state.metrics = metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        if request.url.path.startswith("/api/"):  # Ollama's API answers in Ollama's shape
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc):
        return error_response(400, str(exc))

    in_flight: dict[str, int] = {}  # per key name, for its max_concurrent
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(AuthAndCount, keys=keys, metrics=metrics, routes=app.routes, in_flight=in_flight)

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(models)}

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": model_cards(models)}

    @app.get("/v1/me")
    async def me(request: Request):
        """The key this request was made with (its name, never another's) and its quota."""
        key = getattr(request.state, "api_key", None)
        return {"object": "api_key", "name": key.name if key else ANONYMOUS,
                "max_concurrent": key.max_concurrent if key else None,
                "in_flight": in_flight.get(key.name, 0) if key else None}

    if any(m.personal is not None for m in models.values()):
        feedback = FeedbackRoutes(models, read_json)
        app.post("/v1/feedback")(feedback.feedback)
        app.get("/v1/users/{user}")(feedback.get_user)
        app.delete("/v1/users/{user}")(feedback.delete_user)

    TokenizerRoutes(models, read_json).mount(app)  # vLLM's: lm-eval scores by the server's own tokens with them
    if ollama_api:
        OllamaRoutes(models, handler, read_json).mount(app)
    if slot_save_path is not None:
        SlotRoutes(models, slot_save_path, read_json).mount(app)

    if roots is not None:
        adapters = AdapterRoutes(models, roots, read_json, resolve_model)
        app.post("/v1/load_lora_adapter")(adapters.load)
        app.post("/v1/unload_lora_adapter")(adapters.unload)

    def body_schema(chat: bool) -> dict:  # published for clients and fuzzers; parsing stays openai_protocol's
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": P.request_schema(chat, list(models))}}}}

    @app.post("/v1/chat/completions", openapi_extra=body_schema(True))
    async def chat_completions(request: Request):
        return await handler.handle(request, chat=True)

    @app.post("/v1/completions", openapi_extra=body_schema(False))
    async def completions(request: Request):
        return await handler.handle(request, chat=False)

    return app


KEYED = ("/v1/", "/api/", "/slots", "/tokenize", "/detokenize", "/tokenizer_info")  # what needs a key when keys are set


class AuthAndCount:
    """Pure ASGI middleware (BaseHTTPMiddleware interferes with streaming): API keys, per-key concurrency,
    request counts.

    /v1 requests need a key when the server has keys; the key found is `request.state.api_key`. A key's
    POST requests in flight (a stream until its last chunk) are counted against its max_concurrent.
    Counts are labelled by route template, and every path no route serves shares one label, so
    random URLs cannot grow the metrics without bound.
    """

    UNMATCHED = "unmatched"

    def __init__(self, app, keys: ApiKeys, metrics: Metrics, routes: list, in_flight: dict[str, int]) -> None:
        self.app, self.keys, self.metrics, self.routes, self.in_flight = app, keys, metrics, routes, in_flight

    def endpoint(self, scope) -> str:
        from starlette.routing import Match

        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:  # PARTIAL: the path with another method (405)
                return route.path
        return self.UNMATCHED

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = self.endpoint(scope)
        key = None
        if self.keys and scope["path"].startswith(KEYED):
            key = self.keys.identify(dict(scope.get("headers") or []).get(b"authorization"))
            if key is None:
                return await self._refuse(scope, receive, send, path, 401, P.error_body(
                    "Incorrect or missing API key", code="invalid_api_key"))
            scope.setdefault("state", {})["api_key"] = key
        limited = key is not None and key.max_concurrent is not None and scope["method"] == "POST"
        if limited:
            if self.in_flight.get(key.name, 0) >= key.max_concurrent:
                return await self._refuse(scope, receive, send, path, 429, P.error_body(
                    f"this API key may have {key.max_concurrent} requests in flight at once; retry when one ends",
                    "rate_limit_exceeded", code="concurrency_limit_exceeded"), key)
            self.in_flight[key.name] = self.in_flight.get(key.name, 0) + 1
        status = {"code": 500, "held": limited}

        def release() -> None:  # once the last byte is on its way: a client may send its next request then
            if status["held"]:
                status["held"] = False
                self.in_flight[key.name] -= 1

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                release()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            release()
            self._count(path, status["code"], key)

    async def _refuse(self, scope, receive, send, path: str, status: int, body: dict, key=None) -> None:
        self._count(path, status, key)
        if scope["path"].startswith("/api/"):  # Ollama's API answers in Ollama's shape
            body = {"error": body["error"]["message"]}
        await JSONResponse(body, status_code=status)(scope, receive, send)

    def _count(self, path: str, status: int, key) -> None:
        self.metrics.requests.labels(path, str(status)).inc()
        if key is not None:
            self.metrics.key_requests.labels(key.name, str(status)).inc()


async def _abort_on_disconnect(request, aengine: AsyncEngine, rids: list[str]) -> None:
    """For non-streaming requests: a client that goes away stops its generation (every choice)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for rid in rids:
                aengine.abort(rid)
            return


def load_models(packages: list[str], device: str, max_concurrent: int, engine_kwargs: dict,
                lora_modules: dict[str, str] | None = None, threads: int | None = None, personalize=None,
                state_dir: str | None = None) -> dict[str, ServedModel]:
    """One engine per package; --lora-modules are the first package's adapters. personalize: a
    PersonalSettings to give each package its users' adapters (under state_dir, default the cache's)."""
    from runtime.core.engine import Engine

    models: dict[str, ServedModel] = {}
    for path in packages:
        engine = Engine.from_package(path, device=device, threads=threads, max_num_seqs=max_concurrent, **engine_kwargs)
        name = engine.pkg.name
        if name in models:
            name = f"{name}-{len(models)}"
        if not models:
            for adapter, folder in (lora_modules or {}).items():
                engine.adapters.add(adapter, folder)
        aengine = AsyncEngine(engine)
        personal = None
        if personalize is not None:
            personal = personalization_for(engine, personalize, state_dir, aengine.add_adapter, aengine.remove_adapter)
        models[name] = ServedModel(name, aengine, int(time.time()), personal)
    return models


def serve(models: dict[str, ServedModel], host: str, port: int, log_level: str = "info", **app_options) -> None:
    """uvicorn on create_app(models, **app_options), warning first where others can reach it with no key."""
    import sys

    import uvicorn

    for line in access_warnings(host, app_options.get("keys"), app_options.get("lora_roots")):
        print(f"warning: {line}", file=sys.stderr)
    uvicorn.run(create_app(models, **app_options), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=30)
