"""The ingress's engine: the interface the OpenAI server drives (AsyncEngine's), over Ray Serve.

Prompts are tokenized here, with the package's own tokenizer and template, so the router gets the
prompt's prefix-cache keys and a bad request is refused before anything is sent. Each request streams
from one replica. If that replica dies mid-request, the request runs again on another one and the
tokens already sent are checked and skipped: greedy and seeded requests repeat exactly, and a
sampled request without a seed gets one here so that it does too. A retry that comes out different
ends the request with an error rather than a spliced text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
from collections.abc import AsyncIterator

from runtime.core.adapters import AdapterRegistry, UnknownAdapterError
from runtime.core.config import EngineConfig, ModelConfig
from runtime.core.generation_defaults import package_defaults
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import RequestOutput
from runtime.errors import RequestError
from runtime.package import load_package
from runtime.serve.scaleout.remote_request import RemoteRequest
from runtime.serve.scaleout.routing import prompt_block_keys
from runtime.text.prompt import PromptEncoder


def replica_lost_errors() -> tuple[type[BaseException], ...]:
    """Failures of the replica, not of the request: the request is worth running elsewhere."""
    import ray.exceptions as rx
    import ray.serve.exceptions as sx

    return (rx.RayActorError, rx.NodeDiedError, rx.WorkerCrashedError, rx.ObjectLostError,
            sx.ReplicaUnavailableError, sx.BackPressureError)


@dataclasses.dataclass
class _Flight:
    request: RemoteRequest
    call: object = None  # the replica call streaming it now (a DeploymentResponseGenerator)
    aborted: bool = False


class RemoteEngine:
    def __init__(self, handle, package: str, engine_options: dict | None = None, max_attempts: int = 4,
                 route_blocks: int = 32) -> None:
        pkg = load_package(package, verify_hashes=False)  # the replicas verify; this side reads JSON only
        model = ModelConfig.from_manifest(pkg.manifest)
        options = {k: v for k, v in (engine_options or {}).items() if k in EngineConfig.__dataclass_fields__}
        self.config = EngineConfig(**options)
        self.block_size = self.config.block_size or model.block_size
        self.prompts = PromptEncoder.from_package(pkg, model.vocab_size, model.max_context)
        self.model_name = pkg.name
        self.manifest = pkg.manifest
        self.sampling_defaults = package_defaults(pkg)  # as the replicas'
        self.registry = AdapterRegistry(pkg, None, self.config)  # validation only: read(), never add()
        self.handle, self.max_attempts, self.route_blocks = handle, max_attempts, route_blocks
        self._adapters: dict[str, tuple[str, str]] = {}  # name -> (folder, content id)
        self._flights: dict[str, _Flight] = {}
        self._ids = itertools.count()
        self._lost = replica_lost_errors()
        from ray.exceptions import RayTaskError

        self._task_error = (RayTaskError, RequestError)
        self.retries = 0  # requests moved to another replica after theirs failed

    def backend_info(self) -> None:
        """None: the replicas' backends are theirs (each may differ); the model cards say so by omission."""
        return None

    # ---- lifecycle (the server's lifespan calls these) ----
    def start(self) -> None:
        pass

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        if drain:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained(), timeout)
        for rid in list(self._flights):
            self.release(rid)

    async def _drained(self) -> None:
        while self._flights:
            await asyncio.sleep(0.05)

    # ---- requests ----
    def add_request(self, prompt=None, params: SamplingParams | None = None, *, messages=None,
                    request_id: str | None = None, adapter: str | None = None) -> str:
        """Validate (the engine's checks that need no replica) and register a request; it is sent when
        its stream is read."""
        params = dataclasses.replace(params or SamplingParams(**self.sampling_defaults))
        params.validate(self.prompts.vocab_size)
        ids = self.prompts.request_ids(prompt, messages)
        path = adapter_id = None
        if adapter is not None:
            if adapter not in self._adapters:
                raise UnknownAdapterError(f"no adapter named {adapter!r} is loaded", "adapter")
            path, adapter_id = self._adapters[adapter]
        if params.temperature > 0 and params.seed is None:
            params.seed = random.getrandbits(62)  # a retry on another replica then samples the same tokens
        keys = prompt_block_keys(ids, self.block_size, adapter_id, self.route_blocks)
        rid = request_id or f"remote-{next(self._ids)}"
        if rid in self._flights:
            raise RequestError(f"request id {rid!r} is already in use")
        self._flights[rid] = _Flight(RemoteRequest(list(ids), params, adapter, path, adapter_id, keys))
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; leaving early cancels it on its replica."""
        flight = self._flights[request_id]
        sent_ids: list[int] = []
        sent_text = ""
        try:
            for attempt in range(self.max_attempts):
                replay_ids: list[int] = []
                replay_text = ""
                try:
                    flight.call = self.handle.options(stream=True).generate.remote(flight.request)
                    async for out in flight.call:
                        out = dataclasses.replace(out, request_id=request_id)
                        if attempt == 0:
                            sent_ids += out.token_ids
                            sent_text += out.delta
                            yield out
                        else:  # a retry: check and skip what the client already has
                            replay_ids += out.token_ids
                            replay_text += out.delta
                            fresh = _after(out, sent_ids, sent_text, replay_ids, replay_text)
                            if fresh is None:
                                continue
                            sent_ids += fresh.token_ids
                            sent_text += fresh.delta
                            yield fresh
                        if out.finished:
                            return
                    return
                except self._lost as err:
                    if flight.aborted:
                        return
                    self.retries += 1
                    failure = err
                    await asyncio.sleep(min(0.2 * 2 ** attempt, 2.0))
                except self._task_error as err:  # raised in the replica
                    cause = getattr(err, "cause", None) or err
                    if isinstance(cause, RequestError):  # the request's own fault (a 400)
                        yield _error(request_id, str(cause), getattr(cause, "param", None) or "prompt")
                    else:
                        yield _error(request_id, f"the replica failed this request: {cause}")
                    return
                except _Diverged:
                    yield _error(request_id, "the replica serving this request failed, and its retry on "
                                 "another replica did not repeat the tokens already sent")
                    return
            yield _error(request_id, f"the request failed on {self.max_attempts} replicas; last: {failure}")
        finally:
            self.release(request_id)

    def release(self, request_id: str) -> None:
        """Cancel the request on its replica if it still runs, and forget it."""
        flight = self._flights.pop(request_id, None)
        if flight is not None and flight.call is not None:
            flight.aborted = True
            flight.call.cancel()

    def abort(self, request_id: str) -> bool:
        flight = self._flights.get(request_id)
        if flight is None:
            return False
        self.release(request_id)
        return True

    # ---- adapters: checked here, loaded by each replica on its first request for them ----
    def add_adapter(self, name: str, path, experts: dict | None = None):
        if experts:
            raise RequestError("X-LoRA experts given by name are not supported across replicas: use the "
                               "folders named in its config")
        info = self.registry.read(name, path)
        self._adapters[name] = (str(path), info.id)
        return info

    def remove_adapter(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    def adapter_paths(self) -> dict[str, str]:
        return {name: path for name, (path, _) in self._adapters.items()}

    # ---- what the server reports ----
    def num_waiting(self) -> int:
        return sum(s.get("waiting", 0) for s in self._replica_stats())

    def stats(self) -> dict:
        """The replicas' engine stats that /metrics reports, summed, as they last reported them to the router."""
        from runtime.serve.server import ENGINE_COUNTERS, ENGINE_GAUGES

        keys = [key for key, _ in (*ENGINE_GAUGES.values(), *ENGINE_COUNTERS.values())]
        total = dict.fromkeys(keys, 0)
        for s in self._replica_stats():
            for key in keys:
                total[key] += s.get(key, 0) or 0
        total["retried"] = self.retries
        return total

    def _replica_stats(self) -> list[dict]:
        from runtime.serve.scaleout.routing import LIVE_ROUTERS

        router = LIVE_ROUTERS.get(self.handle.deployment_name)
        return router.replica_stats() if router is not None else []


class _Diverged(Exception):
    pass


def _after(out: RequestOutput, sent_ids: list[int], sent_text: str, replay_ids: list[int],
           replay_text: str) -> RequestOutput | None:
    """The part of a retried request's output the client has not seen (None: all of it was seen);
    raises _Diverged when the retry differs from what was sent."""
    n = min(len(sent_ids), len(replay_ids))
    if replay_ids[:n] != sent_ids[:n] or not (replay_text.startswith(sent_text) or sent_text.startswith(replay_text)):
        raise _Diverged
    new = len(replay_ids) - len(sent_ids)
    if new <= 0 and not out.finished:
        return None
    new = max(new, 0)
    lp = out.logprobs[len(out.logprobs) - new:] if new and out.logprobs else []
    return dataclasses.replace(out, delta=replay_text[len(sent_text):] if len(replay_text) > len(sent_text) else "",
                               token_ids=out.token_ids[len(out.token_ids) - new:] if new else [], logprobs=lp)


def _error(request_id: str, message: str, param: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, "", [], True, "error", 0, 0, error=message, error_param=param)
