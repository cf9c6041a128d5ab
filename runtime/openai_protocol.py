"""OpenAI's chat/completions wire format: validating requests and shaping responses (standard library).

Every bad field becomes a ProtocolError naming the field, which the server turns into a 400 in
OpenAI's error shape. The same module can shape the browser API's chunks.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from runtime.engine import RequestOutput
from runtime.sampling import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 128  # OpenAI's limit on n


class ProtocolError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    logprobs: int | None = None  # alternatives per token, None when not asked for
    max_tokens_given: bool = False
    return_token_ids: bool = False  # extension (as vLLM's): each choice also carries its token ids
    n: int = 1  # choices: n requests on one prompt (computed once: the engine shares its blocks)


def _get(body: dict, name: str, types: tuple, default=None, allow_none: bool = True):
    if name not in body or (body[name] is None and allow_none):
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in types:  # bool is an int in Python; not in JSON
        raise ProtocolError(f"'{name}' must be of type {_type_names(types)}", name)
    if not isinstance(value, types):
        raise ProtocolError(f"'{name}' must be of type {_type_names(types)}, not {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"'{name}' must be a finite number", name)
    return value


def _type_names(types: tuple) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return " or ".join(names.get(t, t.__name__) for t in types if not (t is int and float in types))


def _range(name: str, value, lo=None, hi=None, lo_open: bool = False):
    if value is None:
        return None
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ProtocolError(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ProtocolError(f"'{name}' must be <= {hi}, got {value}", name)
    return value


def _sampling(body: dict, logprobs: int | None) -> tuple[SamplingParams, bool, int]:
    num = (int, float)
    max_tokens = _get(body, "max_completion_tokens", (int,))
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
        name = "max_tokens"
    else:
        name = "max_completion_tokens"
    _range(name, max_tokens, 1)
    temperature = _range("temperature", _get(body, "temperature", num, 1.0), 0, 2)
    top_p = _range("top_p", _get(body, "top_p", num, 1.0), 0, 1, lo_open=True)
    top_k = _get(body, "top_k", (int,), 0)
    if top_k < -1:
        raise ProtocolError("'top_k' must be -1 (off), 0 (off) or positive", "top_k")
    min_p = _range("min_p", _get(body, "min_p", num, 0.0), 0, 1)
    presence = _range("presence_penalty", _get(body, "presence_penalty", num, 0.0), -2, 2)
    frequency = _range("frequency_penalty", _get(body, "frequency_penalty", num, 0.0), -2, 2)
    repetition = _range("repetition_penalty", _get(body, "repetition_penalty", num, 1.0), 0, 10, lo_open=True)
    seed = _get(body, "seed", (int,))
    stop = _get(body, "stop", (str, list), [])
    if isinstance(stop, str):
        stop = [stop]
    if any(not isinstance(s, str) or not s for s in stop):
        raise ProtocolError("'stop' must be a string or an array of non-empty strings", "stop")
    bias_in = _get(body, "logit_bias", (dict,), {})
    bias = {}
    for key, value in bias_in.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ProtocolError(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ProtocolError("'logit_bias' values must be numbers between -100 and 100", "logit_bias")
        bias[token] = float(value)
    n = _range("n", _get(body, "n", (int,), 1), 1, MAX_CHOICES)
    _get(body, "user", (str,))
    params = SamplingParams(
        max_tokens=max_tokens or 1, temperature=float(temperature), top_k=max(0, top_k), top_p=float(top_p),
        min_p=float(min_p), presence_penalty=float(presence), frequency_penalty=float(frequency),
        repetition_penalty=float(repetition), seed=seed, stop=list(stop), logit_bias=bias, logprobs=logprobs,
    )
    return params, max_tokens is not None, n


def _common(body) -> tuple[str, bool, bool]:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = _get(body, "model", (str,))
    if not model:
        raise ProtocolError("'model' is required", "model")
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ProtocolError("'stream_options.include_usage' must be a boolean", "stream_options")
    return model, stream, include_usage


def parse_chat(body) -> ParsedRequest:
    model, stream, include_usage = _common(body)
    messages = _get(body, "messages", (list,))
    if not messages:
        raise ProtocolError("'messages' must be a non-empty array", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ProtocolError(f"'messages[{i}].role' must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(f"'messages[{i}].content' supports only text parts", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ProtocolError(f"'messages[{i}].content' must be a string", f"messages[{i}].content")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    want_logprobs = _get(body, "logprobs", (bool,), False)
    top = _range("top_logprobs", _get(body, "top_logprobs", (int,)), 0, 20)
    if top is not None and not want_logprobs:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    params, given, n = _sampling(body, logprobs)
    return ParsedRequest(model, params, stream, include_usage, messages=clean, logprobs=logprobs,
                         max_tokens_given=given, return_token_ids=_get(body, "return_token_ids", (bool,), False), n=n)


def parse_completion(body) -> ParsedRequest:
    model, stream, include_usage = _common(body)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ProtocolError("'prompt' must be a string or an array of token ids (one prompt per request)",
                                "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise ProtocolError("'prompt' must be a non-empty string", "prompt")
    logprobs = _range("logprobs", _get(body, "logprobs", (int,)), 0, 20)
    if _get(body, "echo", (bool,), False):
        raise ProtocolError("'echo' is not supported", "echo")
    params, given, n = _sampling(body, logprobs)
    return ParsedRequest(model, params, stream, include_usage, prompt=prompt, logprobs=logprobs,
                         max_tokens_given=given, return_token_ids=_get(body, "return_token_ids", (bool,), False), n=n)


# ---- responses ----
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(lasts: list[RequestOutput]) -> dict:
    """One usage for the choices' final outputs: the prompt counted once (as OpenAI does), their
    completions summed; cached_tokens is the most any choice read from the prefix cache."""
    prompt, completion = lasts[0].prompt_tokens, sum(o.completion_tokens for o in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max(o.cached_tokens for o in lasts)}}


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def chat_logprobs(outs: list[RequestOutput], decode) -> dict | None:
    items = []
    for out in outs:
        for lp in out.logprobs:
            tok = decode(lp.token_id)
            items.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8")),
                          "top_logprobs": [{"token": decode(t), "logprob": v, "bytes": list(decode(t).encode("utf-8"))}
                                           for t, v in lp.top]})
    return {"content": items} if items else None


def completion_logprobs(outs: list[RequestOutput], decode) -> dict | None:
    tokens, lps, tops = [], [], []
    for out in outs:
        for lp in out.logprobs:
            tokens.append(decode(lp.token_id))
            lps.append(lp.logprob)
            tops.append({decode(t): v for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []} if tokens else None


def with_token_ids(choice: dict, token_ids: list[int] | None) -> dict:
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(index: int, text: str, last: RequestOutput, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs, "finish_reason": finish_reason(last.finish_reason)}


def completion_choice(index: int, text: str, last: RequestOutput, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(last.finish_reason)}


def response(rid: str, model: str, chat: bool, choices: list[dict], lasts: list[RequestOutput]) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(lasts), "system_fingerprint": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict, reason: str | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}]}


def completion_chunk(rid: str, model: str, created: int, text: str, reason: str | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, lasts: list[RequestOutput]) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage(lasts)}
