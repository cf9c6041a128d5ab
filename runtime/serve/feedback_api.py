"""POST /v1/feedback and GET / DELETE /v1/users/{user}: the HTTP side of per-user adaptation
(runtime/serve/personalization.py), served when `ruvllm serve --personalize` is on.

Why a route of its own rather than a field on the completion request: feedback comes after the answer has
been read (a rating, a correction), often in another request than the one that made it, and learning
takes a second or more, which must never hold a completion's response or its stream.

A body is {"user", optional "model", and one of}:
    "text": "..."                                   learn from this text (the user's own writing)
    "messages": [...], "preferred": "..."           the answer the user wanted to this conversation
    "messages": [...], "completion": "...", "rating": r in [-1, 1]   an answer, rated
"""

from __future__ import annotations

import asyncio
import math

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.errors import RequestError
from runtime.serve import openai_protocol as P
from runtime.serve.api_keys import ANONYMOUS
from runtime.serve.personalization import tokenize_feedback

FEEDBACK_FIELDS = ("model", "user", "text", "messages", "preferred", "completion", "rating")
MAX_USER_CHARS = 256


def key_name(request: Request) -> str:
    key = getattr(request.state, "api_key", None)
    return key.name if key is not None else ANONYMOUS


def check_user(user) -> str:
    if not isinstance(user, str) or not user or len(user) > MAX_USER_CHARS:
        raise P.ProtocolError(f"'user' must be a non-empty string of at most {MAX_USER_CHARS} characters", "user")
    return user


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

    @staticmethod
    def parse(body) -> tuple[str, str | None, dict]:
        """(user, model, what to learn) from a feedback body; ProtocolError names the field at fault."""
        if not isinstance(body, dict):
            raise P.ProtocolError("the request body must be a JSON object")
        unknown = sorted(set(body) - set(FEEDBACK_FIELDS))
        if unknown:
            raise P.ProtocolError(f"unknown field {unknown[0]!r} (feedback takes {', '.join(FEEDBACK_FIELDS)})",
                                  unknown[0])
        user = check_user(body.get("user"))
        given = [f for f in ("text", "preferred", "rating") if body.get(f) is not None]
        if len(given) != 1:
            raise P.ProtocolError("feedback takes one of 'text', 'preferred' (with 'messages') or 'rating' (with "
                                  "'messages' and 'completion')", given[1] if len(given) > 1 else "text")
        kind = given[0]
        if kind == "text":
            for f in ("messages", "completion"):
                if f in body:
                    raise P.ProtocolError(f"'{f}' goes with 'preferred' or 'rating', not 'text'", f)
            if not isinstance(body["text"], str) or not body["text"].strip():
                raise P.ProtocolError("'text' must be a non-empty string", "text")
            return user, body.get("model"), {"kind": kind, "text": body["text"]}
        messages = P.parse_messages(body)
        if kind == "preferred":
            answer = body["preferred"]
            if "completion" in body:
                raise P.ProtocolError("'completion' goes with 'rating'; 'preferred' is the answer itself", "completion")
        else:
            rating, answer = body["rating"], body.get("completion")
            if isinstance(rating, bool) or not isinstance(rating, (int, float)) or not math.isfinite(rating) \
                    or not -1 <= rating <= 1:
                raise P.ProtocolError("'rating' must be a number from -1 (bad) to 1 (good)", "rating")
        if not isinstance(answer, str) or not answer.strip():
            field = "preferred" if kind == "preferred" else "completion"
            raise P.ProtocolError(f"'{field}' must be a non-empty string (the answer)", field)
        out = {"kind": kind, "messages": messages, "answer": answer}
        if kind == "rating":
            out["rating"] = float(rating)
        return user, body.get("model"), out

    async def feedback(self, request: Request):
        try:
            user, model, what = self.parse(await self.read_json(request))
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
        personal = served.personal
        params = personal.reference_params()
        prompt = await asyncio.to_thread(served.engine.prompts.encode, None, personal.reference_prompt())
        tokens: list[int] = []
        async for out in served.engine.generate(prompt, params):
            tokens += out.token_ids
        personal.set_reference(prompt + tokens)

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

