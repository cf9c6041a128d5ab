"""One request's OpenAI-shaped results, streamed or whole: shared by the HTTP server and the page.

Both front ends hand a queued request to these helpers and only differ in transport (SSE bytes
on a socket, or objects posted from the Web Worker).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from runtime import openai_protocol as P
from runtime.async_engine import AsyncEngine
from runtime.engine import RequestOutput


class ChunkStream:
    """Iterates the chunk dicts of a streamed request; `first` and `last` are kept for metrics.

    An engine failure yields one error body and ends the stream. Leaving the iteration early
    aborts the request (the engine's stream does that).
    """

    def __init__(self, aengine: AsyncEngine, rid: str, parsed: P.ParsedRequest, model: str, chat: bool) -> None:
        self.aengine, self.rid, self.parsed, self.model, self.chat = aengine, rid, parsed, model, chat
        self.oid = P.new_id("chatcmpl" if chat else "cmpl")
        self.first: float | None = None  # time.monotonic() of the first output
        self.last: RequestOutput | None = None

    async def __aiter__(self) -> AsyncIterator[dict]:
        decode = self.aengine.engine.tokenizer.decode_token
        created = int(time.time())
        oid, model, chat, want_lp = self.oid, self.model, self.chat, self.parsed.logprobs is not None
        if chat:
            yield P.chat_chunk(oid, model, created, {"role": "assistant", "content": ""})
        async for out in self.aengine.stream(self.rid):
            if self.first is None:
                self.first = time.monotonic()
            self.last = out
            if out.error:
                yield P.error_body(out.error, "server_error", code="unavailable")
                return
            reason = out.finish_reason if out.finished else None
            ids = out.token_ids if self.parsed.return_token_ids else None
            if chat:
                lp = P.chat_logprobs([out], decode) if want_lp else None
                delta = {"content": out.delta} if out.delta or not out.finished else {}
                yield P.with_token_ids(P.chat_chunk(oid, model, created, delta, reason, lp), ids)
            else:
                lp = P.completion_logprobs([out], decode) if want_lp else None
                yield P.with_token_ids(P.completion_chunk(oid, model, created, out.delta, reason, lp), ids)
        if self.last is not None and self.parsed.include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield P.usage_chunk(oid, model, created, obj, self.last)


async def collect(aengine: AsyncEngine, rid: str, parsed: P.ParsedRequest, model: str,
                  chat: bool) -> tuple[dict, list[RequestOutput], float | None]:
    """The whole response of a request: (body, outputs, time of the first output).

    The body is an error body when the engine failed mid-request (outputs[-1].error is set).
    """
    outs: list[RequestOutput] = []
    first = None
    async for out in aengine.stream(rid):
        if first is None:
            first = time.monotonic()
        outs.append(out)
    last = outs[-1]
    if last.error:
        return P.error_body(last.error, "server_error", code="unavailable"), outs, first
    text = "".join(o.delta for o in outs)
    decode = aengine.engine.tokenizer.decode_token
    oid = P.new_id("chatcmpl" if chat else "cmpl")
    ids = [t for o in outs for t in o.token_ids] if parsed.return_token_ids else None
    if chat:
        lp = P.chat_logprobs(outs, decode) if parsed.logprobs is not None else None
        return P.with_token_ids(P.chat_response(oid, model, text, last, lp), ids), outs, first
    lp = P.completion_logprobs(outs, decode) if parsed.logprobs is not None else None
    return P.with_token_ids(P.completion_response(oid, model, text, last, lp), ids), outs, first


def queue_request(aengine: AsyncEngine, parsed: P.ParsedRequest) -> str:
    """Tokenize, fit max_tokens into the context and queue; raises ProtocolError/ContextLengthError."""
    engine = aengine.engine
    ids = engine.encode_prompt(parsed.prompt, parsed.messages)
    room = max(1, engine.max_context - len(ids))  # the engine refuses a prompt that leaves no room
    params = parsed.params
    params.max_tokens = min(params.max_tokens, room) if parsed.max_tokens_given else room
    return aengine.add_request(ids, params)
