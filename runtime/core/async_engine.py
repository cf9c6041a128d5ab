"""asyncio front of the engine: per-request streams of deltas while one loop steps the batch.

Natively each step runs on a single worker thread so the event loop stays free to accept and
stream requests; under Pyodide (no threads) the backend's `run_async` (onnxruntime-web) is awaited
between Engine.prepare_step and finish_step. A consumer that
stops iterating (a client that disconnects) has its request aborted and its KV freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import RequestOutput
from runtime.errors import RequestError


class AsyncEngine:
    def __init__(self, engine: Engine, use_thread: bool | None = None) -> None:
        self.engine = engine
        self._use_thread = (sys.platform != "emscripten") if use_thread is None else use_thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ruvllm-step") if self._use_thread else None
        self._lock = threading.Lock()  # engine state is touched by the step thread and the event loop
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.step_error: BaseException | None = None

    def backend_info(self):
        """The engine's backend's runtime.core.backend.BackendInfo (the server's model cards read it)."""
        return self.engine.backend.info()

    # ---- lifecycle ----
    def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop: let in-flight requests finish (drain) or abort them, then stop the step loop."""
        if drain and self._task is not None:
            try:
                await asyncio.wait_for(self._drained(), timeout)
            except TimeoutError:
                pass
        with self._lock:
            for rid in list(self.engine.seqs):
                self.engine.abort(rid)
                self._push(RequestOutput(rid, "", [], True, "abort", 0, 0, error="the server is shutting down"))
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def _drained(self) -> None:
        while self.engine.has_unfinished():
            await asyncio.sleep(0.01)

    # ---- the step loop ----
    def _step(self) -> list[RequestOutput]:
        with self._lock:
            return self.engine.step()

    async def _step_async(self) -> list[RequestOutput]:
        """A step whose backend is awaited: requests may be added or aborted while it runs."""
        prepared = self.engine.prepare_step()
        if prepared is None:
            return []
        result = await self.engine.backend.run_async(prepared.batch)
        return self.engine.finish_step(prepared, result)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                if self._executor is not None:
                    outputs = await loop.run_in_executor(self._executor, self._step)
                else:
                    outputs = await self._step_async()
                    await asyncio.sleep(0)
            except Exception as err:  # a backend failure ends every request in flight, loudly
                self.step_error = err
                with self._lock:
                    for rid in list(self.engine.seqs):
                        self.engine.abort(rid)
                        self._push(RequestOutput(rid, "", [], True, "error", 0, 0, error=f"engine step failed: {err}"))
                continue
            for out in outputs:
                self._push(out)

    def _push(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)

    # ---- requests ----
    def add_request(self, prompt=None, params: SamplingParams | None = None, *, messages=None,
                    request_id: str | None = None, adapter: str | None = None) -> str:
        """Validate and queue a request; raises RequestError for a bad one (nothing is queued then)."""
        if self._closed:
            raise RequestError("the engine is shutting down")
        self.start()
        prepared = self.engine.prepare_request(prompt, params, messages=messages, adapter=adapter)  # no lock needed
        with self._lock:
            rid = self.engine.submit(prepared, request_id)
            self._queues[rid] = asyncio.Queue()
        self._wakeup.set()
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; leaving early aborts it."""
        q = self._queues[request_id]
        finished = False
        try:
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def release(self, request_id: str) -> None:
        """Abort the request if it still runs and drop its stream, whether or not it was ever read."""
        self.abort(request_id)
        self._queues.pop(request_id, None)

    async def generate(self, prompt=None, params: SamplingParams | None = None, *, messages=None,
                       request_id: str | None = None, adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        rid = self.add_request(prompt, params, messages=messages, request_id=request_id, adapter=adapter)
        async with contextlib.aclosing(self.stream(rid)) as outputs:  # leaving early aborts at once
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> bool:
        with self._lock:
            done = self.engine.abort(request_id)
        if done:
            self._push(RequestOutput(request_id, "", [], True, "abort", 0, 0))
        return done

    def add_adapter(self, name: str, path, experts: dict | None = None):
        """Register an adapter (or an X-LoRA, with `experts` overriding its config's expert folders) while
        requests run (blocking: call it off the event loop)."""
        with self._lock:
            return self.engine.adapters.add(name, path, experts)

    def remove_adapter(self, name: str) -> bool:
        with self._lock:
            return self.engine.adapters.remove(name)

    def save_session(self, path, tokens: list[int] | None = None) -> dict:
        """Engine.save_session between steps (blocking: call it off the event loop)."""
        with self._lock:
            return self.engine.save_session(path, tokens)

    def restore_session(self, path) -> dict:
        """Engine.restore_session between steps (blocking: call it off the event loop)."""
        with self._lock:
            return self.engine.restore_session(path)

    def slot_tokens(self) -> list[int]:
        """The tokens a save_session without tokens saves: the last finished request's (or restored session's)."""
        return list(self.engine.scheduler.recent_tokens[0])

    def erase_slot(self) -> int:
        """Forget slot_tokens (their blocks stay in the prefix cache, shared); returns how many there were."""
        with self._lock:
            n = len(self.engine.scheduler.recent_tokens[0])
            self.engine.scheduler.recent_tokens = ([], None)
            return n

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats_snapshot()

    # ---- what a front end asks (the HTTP server and the page; a Ray Serve client answers the same) ----
    @property
    def prompts(self):
        """The package's PromptEncoder: the front end tokenizes and fits max_tokens before queueing."""
        return self.engine.prompts

    @property
    def manifest(self) -> dict:
        """The package's manifest (what /v1/models and Ollama's /api/tags and /api/show describe)."""
        return self.engine.pkg.manifest

    @property
    def sampling_defaults(self) -> dict:
        """What requests that leave a sampling field out get (Engine.sampling_defaults)."""
        return self.engine.sampling_defaults

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    def has_adapter(self, name: str) -> bool:
        return name in self.engine.adapters

    def adapter_paths(self) -> dict[str, str]:
        """Each loaded adapter's folder, by the name requests use."""
        return {info.name: str(info.path) for info in self.engine.adapters}
