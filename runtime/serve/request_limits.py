"""How large a request may be: a body-size limit no honest request reaches, enforced before parsing.

The limit follows the context: a prompt can hold at most `max_context` tokens, and no token of any
vocabulary here spells more than a few hundred bytes even JSON-escaped (SmolLM2's longest is 81), so
1 KiB a token plus 1 MiB for the rest of the body (tools, logit_bias, stop strings) leaves room for
every prompt that fits. Anything larger is refused with a 413 before its bytes are read (the client's
Content-Length) or as soon as they pass the limit (a chunked body), so a 100 MB body costs neither
memory nor a parse. Standard library only: the page's API uses the same rule.
"""

from __future__ import annotations

import json

BYTES_PER_TOKEN = 1024
BODY_OVERHEAD = 1 << 20


def default_max_request_bytes(max_context: int) -> int:
    return max_context * BYTES_PER_TOKEN + BODY_OVERHEAD


def too_large_body(limit: int, setting: str = "--max-request-bytes") -> dict:
    """OpenAI's error shape for a body over the limit (setting: where the limit is set)."""
    return {"error": {"message": f"the request body is larger than this server accepts ({limit} bytes; "
                                 f"{setting})", "type": "invalid_request_error", "param": None,
                      "code": "request_too_large"}}


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over `limit` bytes, before the app reads any of it.

    A declared length over the limit is answered at once, without reading the body (a client that
    sent `Expect: 100-continue` never sends it). A chunked body is buffered up to the limit and
    replayed to the app; past it, the request gets the 413 and the rest is never read.
    """

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = self.limit + 1
            if declared > self.limit:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, for handlers that watch for it

        return await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        payload = json.dumps(too_large_body(self.limit)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
