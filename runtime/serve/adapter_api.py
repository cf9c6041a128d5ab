"""vLLM's run-time adapter loading on the server: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, only
with `ruvllm serve --allow-runtime-lora-updating`, from folders under the `--lora-root` ones (adapter_roots.py)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.core.adapters import AdapterError
from runtime.serve import openai_protocol as P
from runtime.serve.adapter_roots import AdapterNotFound, AdapterRoots


class AdapterRoutes:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), while requests stream; served only
    when loading at run time is allowed, from adapters under the roots."""

    def __init__(self, models: dict, roots: AdapterRoots, read_json, resolve_model) -> None:
        self.models, self.roots, self.read_json, self.resolve_model = models, roots, read_json, resolve_model

    async def _body(self, request: Request, *fields: str) -> dict:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise P.ProtocolError("the request body must be a JSON object")
        for f in fields:
            if not isinstance(body.get(f), str) or not body[f]:
                raise P.ProtocolError(f"{f!r} is required (a non-empty string)", f)
        return body

    async def load(self, request: Request):
        try:
            body = await self._body(request, "lora_name", "lora_path")
            name, base = body["lora_name"], body.get("base_model_name")
            try:
                self.resolve_model(self.models, name)
                raise P.ProtocolError(f"the adapter '{name}' is already loaded", "lora_name")
            except P.ProtocolError as err:
                if err.status != 404:
                    raise
            served = self.models.get(base) if base else next(iter(self.models.values()))
            if served is None:
                raise P.model_not_found(base)
            path = self.roots.confine(body["lora_path"])
            await asyncio.to_thread(served.engine.add_adapter, name, path)
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except AdapterNotFound as err:
            return JSONResponse(P.error_body(str(err), param="lora_path", code="adapter_not_found"), status_code=400)
        except AdapterError as err:
            return JSONResponse(P.error_body(str(err), param="lora_path"), status_code=400)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload(self, request: Request):
        try:
            name = (await self._body(request, "lora_name"))["lora_name"]
            if not any(m.engine.remove_adapter(name) for m in self.models.values()):
                raise P.ProtocolError(f"no LoRA adapter named '{name}' is loaded", "lora_name", status=404,
                                      code="model_not_found")
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
