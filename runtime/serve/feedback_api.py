"""POST /v1/feedback and GET / DELETE /v1/users/{user}: the HTTP side of per-user adaptation
(runtime/serve/personalization.py), served when `ruvllm serve --personalize` is on.

Why a route of its own rather than a field on the completion request: feedback comes after the answer has
been read (a rating, a correction), often in another request than the one that made it, and learning
takes a second or more, which must never hold a completion's response or its stream.

A body is runtime/serve/feedback_protocol.py's (the page's engine.feedback() takes the same).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.errors import RequestError
from runtime.serve import openai_protocol as P
from runtime.serve.api_keys import ANONYMOUS
from runtime.serve.feedback_protocol import check_user, parse_feedback
from runtime.serve.personalization import sample_reference, tokenize_feedback


def key_name(request: Request) -> str:
    key = getattr(request.state, "api_key", None)
    return key.name if key is not None else ANONYMOUS


class FeedbackRoutes:
    def __init__(self, models: dict, read_json) -> None:
        self.models, self.read_json = models, read_json  # read_json: the server's body reader

    def _served(self, name):
        """The personalized model a body names, or the first one."""
        if name is None:
            served = next((m for m in self.models.values() if m.personal is not None), None)
        else:
            if not isinstance(name, str):
                raise P.ProtocolError("'model' must be a string", "model")
            served = self.models.get(name)
            if served is None:
                raise P.model_not_found(name)
        if served is None or served.personal is None:
            raise P.ProtocolError(f"the model {served.name!r} is not personalized (ruvllm serve --personalize)"
                                  if served else "no model is personalized (ruvllm serve --personalize)", "model",
                                  code="personalization_off")
        return served

    async def feedback(self, request: Request):
        try:
            user, model, what = parse_feedback(await self.read_json(request))
            served = self._served(model)
            personal = served.personal
            fb = await asyncio.to_thread(tokenize_feedback, served.engine.prompts, what)
            if personal.needs_reference:
                await self._reference(served)
            result = await asyncio.to_thread(personal.feedback, key_name(request), user, fb)
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except RequestError as err:
            return JSONResponse(P.error_body(str(err), param=err.param), status_code=400)
        return {**result, "model": served.name}

    async def _reference(self, served) -> None:
        """The model's own text for EWC++, sampled once by the served engine (then kept on disk)."""
        served.personal.set_reference(await sample_reference(served.engine, served.personal.settings))

    async def get_user(self, request: Request, user: str):
        try:
            check_user(user)
            served = self._served(request.query_params.get("model"))
            state = served.personal.user_state(key_name(request), user)
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except RequestError as err:
            return JSONResponse(P.error_body(str(err), param=err.param), status_code=400)
        if state is None:
            return JSONResponse(P.error_body(f"no user {user!r} has learned anything here", param="user",
                                             code="user_not_found"), status_code=404)
        return {**state, "model": served.name}

    async def delete_user(self, request: Request, user: str):
        """Reset the user: their adapter is no longer served, their stored state is deleted."""
        try:
            check_user(user)
            served = self._served(request.query_params.get("model"))
            deleted = await asyncio.to_thread(served.personal.forget, key_name(request), user)
        except P.ProtocolError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return {"object": "user", "user": user, "deleted": deleted, "model": served.name}

