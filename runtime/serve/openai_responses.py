"""OpenAI's response bodies and stream chunks, as vLLM writes them: choices, logprobs, usage (with reasoning
tokens), ids. Standard library only: the server and the page's engine (web_api.py) alike.
"""

from __future__ import annotations

import time
import uuid

from runtime.core.sequence import RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(lasts: list[RequestOutput], reasoning_tokens: int | None = None, per_prompt: int | None = None) -> dict:
    """One usage for the choices' final outputs: each prompt counted once (as OpenAI does; `per_prompt`
    choices share one, by default all of them), their completions summed; cached_tokens is the most any
    choice read from the prefix cache; reasoning_tokens (a reasoning model's): the choices' tokens inside
    their thinking blocks."""
    prompt = sum(o.prompt_tokens for o in lasts[::per_prompt or len(lasts)])
    completion = sum(o.completion_tokens for o in lasts)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": max(o.cached_tokens for o in lasts)}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


LOGPROB_FLOOR = -9999.0  # what OpenAI (and vLLM) report for an impossible token; JSON has no -inf


def _lp(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


def chat_logprobs(outs: list[RequestOutput], decode) -> dict | None:
    items = []
    for out in outs:
        for lp in out.logprobs:
            tok = decode(lp.token_id)
            items.append({"token": tok, "logprob": _lp(lp.logprob), "bytes": list(tok.encode("utf-8")),
                          "top_logprobs": [{"token": decode(t), "logprob": _lp(v), "bytes": list(decode(t).encode("utf-8"))}
                                           for t, v in lp.top]})
    return {"content": items} if items else None


def completion_logprobs(outs: list[RequestOutput], decode) -> dict | None:
    tokens, lps, tops = [], [], []
    for out in outs:
        for lp in out.logprobs:
            tokens.append(decode(lp.token_id))
            lps.append(_lp(lp.logprob))
            tops.append({decode(t): _lp(v) for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []} if tokens else None


def text_offsets(tokens: list[str], at: int = 0) -> list[int]:
    """Where each token's text starts, the first at `at` (legacy logprobs' text_offset)."""
    out = []
    for text in tokens:
        out.append(at)
        at += len(text)
    return out


def echo_logprobs(prompt_ids: list[int], scores: list | None, decode) -> dict:
    """The legacy logprobs of an echoed choice's prompt: its tokens, the first with null (as OpenAI's legacy
    API gives it: nothing precedes it), and each token's start in the text."""
    scores = scores or []
    tokens = [decode(t) for t in prompt_ids]
    return {"tokens": tokens, "token_logprobs": [None] + [_lp(s.logprob) for s in scores],
            "top_logprobs": [None] + [{decode(t): _lp(v) for t, v in s.top} for s in scores],
            "text_offset": text_offsets(tokens)}


def joined_logprobs(head: dict | None, tail: dict | None) -> dict | None:
    """Legacy logprobs of the prompt followed by those of the generated tokens (text_offset running on)."""
    if head is None or tail is None:
        return head or tail
    at = head["text_offset"][-1] + len(head["tokens"][-1]) if head["tokens"] else 0
    return {"tokens": head["tokens"] + tail["tokens"], "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + text_offsets(tail["tokens"], at)}


def prompt_logprobs(prompt_ids: list[int], scores: list, decode) -> list:
    """vLLM's prompt_logprobs: None for the first token, then per token {token id: {logprob, rank where known,
    decoded_token}} for the token itself and its likeliest alternatives."""
    out: list = [None]
    for s in scores:
        entry = {}
        for rank, (t, v) in enumerate(s.top, start=1):
            entry[str(t)] = {"logprob": _lp(v), "rank": rank, "decoded_token": decode(t)}
        if str(s.token_id) not in entry:
            entry[str(s.token_id)] = {"logprob": _lp(s.logprob), "decoded_token": decode(s.token_id)}
        out.append(entry)
    return out[:len(prompt_ids)]


def with_token_ids(choice: dict, token_ids: list[int] | None) -> dict:
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(index: int, text: str, last: RequestOutput, logprobs: dict | None, tools=None,
                reasoning: str | None | bool = False) -> dict:
    """One chat choice; with tools offered, the `<tool_call>` blocks of the text become its tool_calls. A
    reasoning model's choice (`reasoning` not False) carries its thinking as `reasoning` and, vLLM's older
    name that clients still read, `reasoning_content` (None where it did not think)."""
    message = {"role": "assistant", "content": text, "refusal": None}
    if reasoning is not False:
        message.update(reasoning=reasoning or None, reasoning_content=reasoning or None)
    reason = finish_reason(last.finish_reason)
    if tools is not None:
        from runtime.serve.tools import parse_calls

        content, calls = parse_calls(text, tools)
        if calls:
            message.update(content=content, tool_calls=calls)
            reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def completion_choice(index: int, text: str, last: RequestOutput, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(last.finish_reason)}


def response(rid: str, model: str, chat: bool, choices: list[dict], lasts: list[RequestOutput],
             reasoning_tokens: int | None = None, per_prompt: int | None = None) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(lasts, reasoning_tokens, per_prompt),
            "system_fingerprint": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict, reason: str | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}]}


def completion_chunk(rid: str, model: str, created: int, text: str, reason: str | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, lasts: list[RequestOutput],
                reasoning_tokens: int | None = None, per_prompt: int | None = None) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage(lasts, reasoning_tokens, per_prompt)}
