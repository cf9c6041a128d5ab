"""One request's OpenAI-shaped results, streamed or whole: shared by the HTTP server and the page.

Both front ends hand a queued request to these helpers and only differ in transport (SSE bytes
on a socket, or objects posted from the Web Worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from runtime.core.async_engine import AsyncEngine
from runtime.core.sequence import RequestOutput
from runtime.serve import openai_protocol as P
from runtime.serve import openai_responses as R
from runtime.text.reasoning import ReasoningSplitter


def splitters(parsed: P.ParsedRequest, n: int) -> list[ReasoningSplitter] | None:
    """A reasoning model's chat: each choice's splitter of its thinking from its answer; else None."""
    if parsed.reasoning is None:
        return None
    tags, state = parsed.reasoning
    return [ReasoningSplitter(tags, state) for _ in range(n)]


async def merged(aengine: AsyncEngine, rids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a request's choices as they come, each with its choice index. Leaving early
    (or an error) aborts the choices still running."""
    if len(rids) == 1:
        async with contextlib.aclosing(aengine.stream(rids[0])) as outs:
            async for out in outs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, rid: str) -> None:
        try:
            async with contextlib.aclosing(aengine.stream(rid)) as outs:
                async for out in outs:
                    queue.put_nowait((index, out))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, rid)) for i, rid in enumerate(rids)]
    try:
        running = len(rids)
        while running:
            index, out = await queue.get()
            if out is None:
                running -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()
        for rid in rids:  # a no-op for the finished ones
            aengine.release(rid)


class ChunkStream:
    """Iterates the chunk dicts of a streamed request; `first` and `lasts` are kept for metrics.

    With n choices their chunks interleave as they come, each carrying its choice index. An engine
    failure yields one error body and ends the stream. Leaving the iteration early aborts the request
    (every choice).
    """

    def __init__(self, aengine: AsyncEngine, rids: list[str], parsed: P.ParsedRequest, model: str,
                 chat: bool) -> None:
        self.aengine, self.rids, self.parsed, self.model, self.chat = aengine, rids, parsed, model, chat
        self.oid = R.new_id("chatcmpl" if chat else "cmpl")
        self.first: float | None = None  # time.monotonic() of the first output
        self.lasts: list[RequestOutput | None] = [None] * len(rids)  # each choice's latest output
        self.split = splitters(parsed, len(rids)) if chat else None  # a reasoning model's: thinking apart

    async def __aiter__(self) -> AsyncIterator[dict]:
        decode = self.aengine.prompts.tokenizer.decode_token
        created = int(time.time())
        oid, model, chat, want_lp = self.oid, self.model, self.chat, self.parsed.logprobs is not None
        if chat:
            for i in range(len(self.rids)):
                yield R.chat_chunk(oid, model, created, {"role": "assistant", "content": ""}, index=i)
        held = [ToolCallStream(self, i, created) for i in range(len(self.rids))] if self.parsed.tools else []
        echoed_already = [False] * len(self.rids)
        async with contextlib.aclosing(merged(self.aengine, self.rids)) as outs:
            async for i, out in outs:
                if self.first is None:
                    self.first = time.monotonic()
                self.lasts[i] = out
                if out.error:
                    yield output_error(out)
                    return
                reason = out.finish_reason if out.finished else None
                ids = out.token_ids if self.parsed.return_token_ids else None
                thought = ""
                if self.split is not None:  # the thinking goes out as reasoning deltas, the rest as the reply
                    thought, answer = self.split[i].feed(out.delta, out.token_ids)
                    out = dataclasses.replace(out, delta=answer)
                    if thought:
                        lp = R.chat_logprobs([out], decode) if want_lp else None
                        yield R.chat_chunk(oid, model, created, {"reasoning": thought, "reasoning_content": thought},
                                           None, lp, index=i)
                if chat and self.parsed.tools is not None:
                    for chunk in held[i].feed(out):
                        yield chunk
                    continue
                if chat:
                    lp = R.chat_logprobs([out], decode) if want_lp and not thought else None
                    delta = {"content": out.delta} if out.delta or not (out.finished or thought) else {}
                    if thought and not delta and not out.finished:
                        continue
                    chunk = R.chat_chunk(oid, model, created, delta, reason, lp, index=i)
                else:
                    lp = R.completion_logprobs([out], decode) if want_lp else None
                    text = out.delta
                    if self.parsed.echo and not echoed_already[i]:  # the prompt first, in the choice's first chunk
                        echoed_already[i] = True
                        head, head_lp = echoed(self.parsed, i, out, decode, self.aengine.prompts.tokenizer)
                        text, lp = head + text, R.joined_logprobs(head_lp, lp)
                    chunk = R.completion_chunk(oid, model, created, text, reason, lp, index=i)
                    if self.parsed.prompt_logprobs is not None and out.prompt_logprobs is not None:
                        chunk["choices"][0]["prompt_logprobs"] = R.prompt_logprobs(
                            self.parsed.prompt_ids[i // self.parsed.n], out.prompt_logprobs, decode)
                R.with_token_ids(chunk["choices"][0], ids)
                yield chunk
        if self.complete and self.parsed.include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield R.usage_chunk(oid, model, created, obj, self.lasts, self.reasoning_tokens, self.parsed.n)

    @property
    def reasoning_tokens(self) -> int | None:
        """The choices' tokens inside their thinking blocks (a reasoning model's chat), else None."""
        return None if self.split is None else sum(s.reasoning_tokens for s in self.split)

    @property
    def complete(self) -> bool:
        """Every choice reached its end without an error."""
        return all(o is not None and o.finished and not o.error for o in self.lasts)


class ToolCallStream:
    """One choice's chunks when tools are offered: text streams until it may be a `<tool_call>` block,
    which is held to the end and sent as tool_calls deltas (OpenAI's shape: index, id, name, then the
    arguments), with finish_reason "tool_calls"."""

    def __init__(self, stream: ChunkStream, index: int, created: int) -> None:
        self.s, self.index, self.created = stream, index, created
        self.text, self.sent, self.ids = "", 0, []

    def _chunk(self, delta: dict, reason: str | None = None) -> dict:
        s = self.s
        return R.chat_chunk(s.oid, s.model, self.created, delta, reason, index=self.index)

    def feed(self, out: RequestOutput) -> list[dict]:
        from runtime.serve.tools import CALL_OPEN, parse_calls

        self.text += out.delta
        self.ids.extend(out.token_ids)
        chunks = []
        if not out.finished:
            start = self.text.find(CALL_OPEN, self.sent)
            cut = start if start >= 0 else len(self.text) - _partial_suffix(self.text, CALL_OPEN)
            if cut > self.sent:
                chunks.append(self._chunk({"content": self.text[self.sent:cut]}))
                self.sent = cut
            return chunks
        content, calls = parse_calls(self.text[self.sent:], self.s.parsed.tools)
        if content:
            chunks.append(self._chunk({"content": content}))
        for k, call in enumerate(calls):
            fn = call["function"]
            chunks.append(self._chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                       "function": {"name": fn["name"], "arguments": ""}}]}))
            chunks.append(self._chunk({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]}))
        last = self._chunk({}, "tool_calls" if calls else out.finish_reason)
        R.with_token_ids(last["choices"][0], self.ids if self.s.parsed.return_token_ids else None)
        return chunks + [last]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held: it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def output_error(out: RequestOutput) -> dict:
    """The error body of a request that ended in error: its own field's fault (error_param), or the engine's."""
    if out.error_param:
        return P.error_body(out.error, param=out.error_param)
    return P.error_body(out.error, "server_error", code="unavailable")


async def collect(aengine: AsyncEngine, rids: list[str], parsed: P.ParsedRequest, model: str,
                  chat: bool) -> tuple[dict, list[RequestOutput] | None, float | None]:
    """The whole response of a request: (body, each choice's final output, time of the first output).

    The body is an error body, and the outputs None, when the engine failed mid-request.
    """
    outs: list[list[RequestOutput]] = [[] for _ in rids]
    first = None
    async with contextlib.aclosing(merged(aengine, rids)) as stream:
        async for i, out in stream:
            if first is None:
                first = time.monotonic()
            if out.error:
                return output_error(out), None, first
            outs[i].append(out)
    decode = aengine.prompts.tokenizer.decode_token
    choices = []
    split = splitters(parsed, len(outs)) if chat else None
    for i, choice in enumerate(outs):
        text = "".join(o.delta for o in choice)
        ids = [t for o in choice for t in o.token_ids] if parsed.return_token_ids else None
        if chat:
            lp = R.chat_logprobs(choice, decode) if parsed.logprobs is not None else None
            thought: str | bool = False
            if split is not None:
                parts = [split[i].feed(o.delta, o.token_ids) for o in choice]
                thought, text = "".join(r for r, _ in parts), "".join(c for _, c in parts)
            choices.append(R.with_token_ids(R.chat_choice(i, text, choice[-1], lp, parsed.tools, thought), ids))
        else:
            lp = R.completion_logprobs(choice, decode) if parsed.logprobs is not None else None
            if parsed.echo:
                head, head_lp = echoed(parsed, i, choice[0], decode, aengine.prompts.tokenizer)
                text, lp = head + text, R.joined_logprobs(head_lp, lp)
            body = R.with_token_ids(R.completion_choice(i, text, choice[-1], lp), ids)
            if parsed.prompt_logprobs is not None:
                body["prompt_logprobs"] = R.prompt_logprobs(parsed.prompt_ids[i // parsed.n],
                                                            choice[0].prompt_logprobs, decode)
            choices.append(body)
    lasts = [choice[-1] for choice in outs]
    reasoning_tokens = None if split is None else sum(s.reasoning_tokens for s in split)
    return R.response(R.new_id("chatcmpl" if chat else "cmpl"), model, chat, choices, lasts, reasoning_tokens,
                      parsed.n), lasts, first


def encode_request(prompts, parsed: P.ParsedRequest) -> list[list[int]]:
    """The request's prompts' ids: messages rendered through the chat template (with tools), or each prompt.
    The slow part of a request (template and tokenizer; a prompt past the context is refused by the
    tokenizer's floor before it is tokenized), with no engine state: the server runs it off its loop."""
    messages, tools = parsed.messages, None
    if messages is not None:
        from runtime.serve.tools import render_messages

        takes = prompts.chat_template is not None and prompts.chat_template.takes_tools
        messages = render_messages(messages, parsed.tools, takes)
        if takes and parsed.tools is not None:
            tools = [{"type": "function", "function": f} for f in parsed.tools.functions]
    if messages is not None:
        return [prompts.encode(None, messages, tools, parsed.template_kwargs)]
    return [prompts.encode(p) for p in (parsed.prompts or [parsed.prompt])]


def queue_request(aengine: AsyncEngine, parsed: P.ParsedRequest, adapter: str | None = None,
                  ids: list[list[int]] | None = None) -> list[str]:
    """Fit max_tokens into the context and queue one engine request per choice of each prompt
    (encode_request's ids, made here when not given); returns their ids, prompt after prompt. Raises
    ProtocolError/ContextLengthError. With a seed, choice i samples with seed + i: the choices differ and each
    is reproducible."""
    prompts = aengine.prompts
    if ids is None:
        ids = encode_request(prompts, parsed)
    parsed.prompt_ids = ids
    if parsed.messages is not None and prompts.think is not None:  # where each reply starts: in a block or not
        from runtime.text.reasoning import prompt_state

        parsed.reasoning = (prompts.think, prompt_state(ids[0], prompts.think, prompts.tokenizer.decode))
    params = parsed.params
    rids: list[str] = []
    try:
        for k, prompt_ids in enumerate(ids):
            room = max(1, prompts.max_context - len(prompt_ids))  # the engine refuses a prompt that leaves no room
            max_tokens = min(params.max_tokens, room) if parsed.max_tokens_given else room
            if k == 0:
                params.max_tokens = max_tokens
            for i in range(parsed.n):
                choice = dataclasses.replace(params, max_tokens=max_tokens,
                                             seed=None if params.seed is None else params.seed + i)
                rids.append(aengine.add_request(prompt_ids, choice, adapter=adapter))
    except BaseException:
        for rid in rids:  # all or nothing
            aengine.release(rid)
        raise
    return rids


def echoed(parsed: P.ParsedRequest, index: int, first: RequestOutput, decode, tokenizer) -> tuple[str, dict | None]:
    """An echoed completion choice's start: its prompt's text, and with logprobs its prompt's legacy logprobs."""
    k = index // parsed.n
    prompt, ids = parsed.prompts[k], parsed.prompt_ids[k]
    text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    lp = R.echo_logprobs(ids, first.prompt_logprobs, decode) if parsed.logprobs is not None else None
    return text, lp
