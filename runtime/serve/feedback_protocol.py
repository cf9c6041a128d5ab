"""A feedback body of per-user adaptation (issue 51), as the server's POST /v1/feedback and the page's
engine.feedback() take it: parsed and checked here, with the standard library only (it runs in Pyodide).

A body is {"user", optional "model", and one of}:
    "text": "..."                                   learn from this text (the user's own writing)
    "messages": [...], "preferred": "..."           the answer the user wanted to this conversation
    "messages": [...], "completion": "...", "rating": r in [-1, 1]   an answer, rated
"""

from __future__ import annotations

import math

from runtime.serve import openai_protocol as P

FEEDBACK_FIELDS = ("model", "user", "text", "messages", "preferred", "completion", "rating")
MAX_USER_CHARS = 256


def check_user(user) -> str:
    if not isinstance(user, str) or not user or len(user) > MAX_USER_CHARS:
        raise P.ProtocolError(f"'user' must be a non-empty string of at most {MAX_USER_CHARS} characters", "user")
    return user


def parse_feedback(body, default_user: str | None = None) -> tuple[str, str | None, dict]:
    """(user, model, what to learn) from a feedback body (its user, else `default_user`: the page's own);
    ProtocolError names the field at fault."""
    if not isinstance(body, dict):
        raise P.ProtocolError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(FEEDBACK_FIELDS))
    if unknown:
        raise P.ProtocolError(f"unknown field {unknown[0]!r} (feedback takes {', '.join(FEEDBACK_FIELDS)})",
                              unknown[0])
    user = check_user(body.get("user", default_user))
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
