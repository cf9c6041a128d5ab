"""One engine replica of the Ray Serve application: an AsyncEngine on one package.

Requests arrive tokenized (`RemoteRequest`) and stream their RequestOutputs back. A request that names
an adapter this replica has not loaded loads it first, so adapters loaded through the ingress reach
every replica, including ones started later by autoscaling or after a failure.
"""

from __future__ import annotations

import asyncio
import contextlib

from runtime.core.async_engine import AsyncEngine
from runtime.core.engine import Engine
from runtime.errors import RequestError
from runtime.serve.scaleout.remote_request import RemoteRequest


class EngineReplica:
    def __init__(self, package: str, device: str = "cpu", threads: int | None = None,
                 engine_options: dict | None = None, adapters: dict[str, str] | None = None) -> None:
        engine = Engine.from_package(package, device=device, threads=threads, **(engine_options or {}))
        for name, path in (adapters or {}).items():
            engine.adapters.add(name, path)
        self.aengine = AsyncEngine(engine)
        self._adapter_lock = asyncio.Lock()

    async def generate(self, request: RemoteRequest):
        """The request's outputs as the engine makes them. A cancelled call (the client went away, or
        the ingress gave up on it) aborts the request and frees its blocks."""
        if request.adapter is not None:
            await self._ensure_adapter(request)
        rid = self.aengine.add_request(request.ids, request.params, adapter=request.adapter)
        async with contextlib.aclosing(self.aengine.stream(rid)) as outs:
            async for out in outs:
                yield out

    async def _ensure_adapter(self, request: RemoteRequest) -> None:
        async with self._adapter_lock:
            registry = self.aengine.engine.adapters
            info = registry.by_name.get(request.adapter)
            if info is not None and info.id == request.adapter_id:
                return
            info = await asyncio.to_thread(self.aengine.add_adapter, request.adapter, request.adapter_path)
            if info.id != request.adapter_id:
                registry.remove(request.adapter)
                raise RequestError(f"the adapter {request.adapter!r} at {request.adapter_path} changed on disk "
                                   "since it was loaded; load it again", "model")

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this for the router; the ingress sums it for /metrics."""
        return self.aengine.stats()

    def check_health(self) -> None:
        """A replica whose step failed is unhealthy: Ray Serve replaces it."""
        if self.aengine.step_error is not None:
            raise RuntimeError(f"engine step failed: {self.aengine.step_error}")
