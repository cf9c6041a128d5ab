"""llama.cpp's slot save and restore on the server: `POST /slots/{id}?action=save|restore|erase` and `GET /slots`,
on with `ruvllm serve --slot-save-path DIR` (llama-server's flag).

A model's slot 0 is its last finished request (its prompt and answer, as far as computed). Saving writes the
cached K/V blocks that begin it to DIR/filename (runtime/core/kv_sessions.py); restoring reads such a file into
the prefix cache, so a later request that begins with the same tokens skips their prefill, after a restart
too. A file saved from another package or KV pool is refused by name. `?model=` picks the model when the
server has several (the first otherwise).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.errors import RequestError
from runtime.serve import openai_protocol as P

FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # one plain file name: no folders, no hidden files


class SlotRoutes:
    def __init__(self, models: dict, folder: str | Path, read_json) -> None:
        self.models, self.folder, self.read_json = models, Path(folder), read_json
        self.folder.mkdir(parents=True, exist_ok=True)

    def mount(self, app) -> None:
        app.get("/slots")(self.slots)
        app.post("/slots/{id_slot}")(self.action)

    def _model(self, name: str | None):
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise P.model_not_found(name)
        return self.models[name]

    async def slots(self, model: str | None = None):
        """The slot of each model (or of `model`): its last finished request's tokens."""
        try:
            served = [self._model(model)] if model is not None else list(self.models.values())
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return [{"id": 0, "model": m.name, "n_ctx": m.engine.prompts.max_context,
                 "n_tokens": len(m.engine.slot_tokens())} for m in served]

    async def action(self, id_slot: int, request: Request, action: str = "", model: str | None = None):
        try:
            if id_slot != 0:
                raise P.ProtocolError(f"slot {id_slot} does not exist: each model has one slot, 0, its last "
                                      "finished request", param="id_slot")
            served = self._model(model)
            if action == "erase":
                return {"id_slot": 0, "n_erased": served.engine.erase_slot()}
            if action not in ("save", "restore"):
                raise P.ProtocolError(f"action must be save, restore or erase, not {action!r}", param="action")
            body = await self.read_json(request)
            name = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(name, str) or not FILENAME.fullmatch(name):
                raise P.ProtocolError("filename must be a plain file name (letters, digits, '_', '-', '.')",
                                      param="filename")
            path = self.folder / name
            if action == "save":
                done = await asyncio.to_thread(served.engine.save_session, path)
                return {"id_slot": 0, "filename": name, "n_saved": done["tokens"], "n_written": done["bytes"],
                        "timings": {"save_ms": round(1000 * done["seconds"], 3)}}
            if not path.is_file():
                raise P.ProtocolError(f"no saved session named {name!r}", param="filename")
            done = await asyncio.to_thread(served.engine.restore_session, path)
            return {"id_slot": 0, "filename": name, "n_restored": done["tokens"], "n_read": done["bytes"],
                    "timings": {"restore_ms": round(1000 * done["seconds"], 3)}}
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except RequestError as err:
            return JSONResponse(P.ProtocolError(str(err)).body(), status_code=400)
