"""OpenAI's chat/completions wire format: validating requests and shaping responses (standard library).

Every bad field becomes a ProtocolError naming the field, which the server turns into a 400 in
OpenAI's error shape. The same module can shape the browser API's chunks, and it is the one place
the request fields are defined: the server publishes request_schema() in its OpenAPI document.

Field policy: a field that would change the output and is not implemented (tools, ...) is refused
with a 400 naming it, never ignored; informational fields (metadata, store) are accepted, and `user`
too (it picks the user's own adapter when the server personalizes: runtime/serve/personalization.py); a field OpenAI does not define and RuvLLM does not add is refused as OpenAI does.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from runtime.core.constraints import Constraint
from runtime.core.dry import DEFAULT_BREAKERS
from runtime.core.request_fields import SAMPLING_FIELDS
from runtime.core.sampling import RANGES, SamplingParams, check_range, range_text
from runtime.errors import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 128  # OpenAI's limit on n
MAX_TOP_LOGPROBS = int(RANGES["logprobs"][1])

# Fields that would change the output, not implemented yet: refused, never silently ignored.
UNSUPPORTED = ("functions", "function_call",
               "audio", "modalities", "prediction", "reasoning_effort", "web_search_options", "suffix", "best_of")
# Structured output: OpenAI's response_format; vLLM's structured_outputs and its older guided_* fields
STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
INFORMATIONAL = ("user", "metadata", "store", "service_tier")  # accepted; they change nothing generated


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
    tools: object = None  # chat: runtime.serve.tools.Tools, when the request offers functions
    user: str | None = None  # OpenAI's end-user id: their adapter, when the server personalizes
    template_kwargs: dict | None = None  # chat: chat_template_kwargs, the template's own variables (enable_thinking)
    reasoning: tuple | None = None  # chat with a reasoning model: (ThinkTokens, prompt_state), once queued
    # completions: every prompt (a list of them is one request: prompt k's choices are k * n .. k * n + n - 1)
    prompts: list | None = None
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    prompt_logprobs: int | None = None  # vLLM's: each choice also carries its prompt's log-probabilities
    prompt_ids: list[list[int]] | None = None  # each prompt's ids, once queued


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


def sampling_values(body: dict, defaults: dict | None = None, fields=SAMPLING_FIELDS) -> dict:
    """The request's declared scalar sampling fields (runtime/core/request_fields.py), each checked for its JSON
    type; one it leaves out is the server's default (`ruvllm serve --temperature ...`), else the field's."""
    d = defaults or {}
    return {f.name: _get(body, f.name, (int,) if f.kind == "integer" else (int, float), d.get(f.name, f.default))
            for f in fields}


def _sampling(body: dict, logprobs: int | None, defaults: dict | None = None) -> tuple[SamplingParams, bool, int]:
    """The request's sampling parameters (their ranges are sampling.RANGES'); defaults: the server's
    own defaults for fields the request leaves out (`ruvllm serve --temperature ...`)."""
    d = defaults or {}
    max_tokens = _get(body, "max_completion_tokens", (int,))
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
    given = max_tokens is not None
    stop = _get(body, "stop", (str, list), d.get("stop", []))
    if isinstance(stop, str):
        stop = [stop]
    if any(not isinstance(s, str) or not s for s in stop):
        raise ProtocolError("'stop' must be a string or an array of non-empty strings", "stop")
    bias = {}
    for key, value in _get(body, "logit_bias", (dict,), {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ProtocolError(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError("'logit_bias' values must be numbers", "logit_bias")
        bias[token] = float(value)
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ProtocolError(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n")
    params = SamplingParams(
        **sampling_values(body, d),
        max_tokens=max_tokens if given else d.get("max_tokens", 1), stop=list(stop), logit_bias=bias, logprobs=logprobs,
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", (bool,), False),
        stop_token_ids=_get(body, "stop_token_ids", (list,), []),
        constraint=constraint(body),
        dry_sequence_breakers=list(_get(body, "dry_sequence_breakers", (list,),
                                        d.get("dry_sequence_breakers", list(DEFAULT_BREAKERS)))),
    )
    try:
        params.validate()
    except RequestError as err:
        name = err.param
        if name == "max_tokens" and "max_completion_tokens" in body:
            name = "max_completion_tokens"
        raise ProtocolError(f"'{name}' {str(err).split(': ', 1)[1]}", name) from None
    return params, given or "max_tokens" in d, n


def constraint(body: dict) -> Constraint | None:
    """The request's structured output, from whichever one of STRUCTURED fields it sets (None: free text).
    Only the fields' shape is checked here; a schema or grammar the engine cannot compile is its 400."""
    given = [name for name in STRUCTURED if body.get(name) is not None]
    if len(given) > 1:
        raise ProtocolError(f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ProtocolError("'structured_outputs' must be an object", name)
            keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if value.get(k) is not None]
            unknown = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown or len(keys) != 1:
                raise ProtocolError("'structured_outputs' takes exactly one of json, regex, choice, grammar, "
                                    f"json_object{f' (unknown: {unknown})' if unknown else ''}", name)
            key = keys[0]
            if key == "json_object":
                if value[key] is not True:
                    raise ProtocolError("'structured_outputs.json_object' must be true", name)
                return Constraint("json_object")
            return _constraint_of({"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                                   "grammar": "guided_grammar"}[key], value[key])
        return _constraint_of(name, value)
    except RequestError as err:
        raise ProtocolError(f"'{name}': {err}", name) from None


def _constraint_of(field_name: str, value) -> Constraint:
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}[field_name]
    if kind == "json_schema" and isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RequestError(f"the schema is not valid JSON: {err.msg}") from None
    return Constraint(kind, value)


def _response_format(value) -> Constraint | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("'type' must be text, json_object or json_schema")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return Constraint("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError("json_schema needs an object with a 'name'")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError("json_schema.schema must be an object")
    return Constraint("json_schema", schema)


def _check_fields(body: dict, known: tuple[str, ...]) -> None:
    for name in body:
        if name in UNSUPPORTED and body[name] is not None:
            raise ProtocolError(f"'{name}' is not supported by this server yet; remove it from the request", name,
                                code="unsupported_parameter")
        if name not in known and name not in UNSUPPORTED:
            raise ProtocolError(f"Unrecognized request argument supplied: {name}", name,
                                code="unrecognized_parameter")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def parse_body(text: str):
    """The JSON of a request body, or a ProtocolError: malformed JSON, nesting too deep to parse, or a
    lone UTF-16 surrogate (legal JSON, but no Unicode text: nothing downstream could encode it)."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProtocolError(f"the request body is not valid JSON: {err.msg} at position {err.pos}") from None
    except RecursionError:
        raise ProtocolError("the request body is nested too deeply") from None
    if not _SURROGATE_ESCAPE.search(text):  # a lone surrogate can only come from a \uD800-\uDFFF escape
        return body
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError("the request body holds a lone UTF-16 surrogate (such as \\ud800), "
                            "which is not valid Unicode text") from None
    except RecursionError:
        raise ProtocolError("the request body is nested too deeply") from None
    return body


_COMMON = ("model", "stream", "stream_options", "max_tokens", "max_completion_tokens", *(f.name for f in SAMPLING_FIELDS),
           "stop", "logit_bias", "n", "return_token_ids", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
           "dry_sequence_breakers") + INFORMATIONAL + STRUCTURED
# chat_template_kwargs (vLLM's, Qwen3's enable_thinking) and thinking_budget_tokens (llama.cpp's)
REASONING_FIELDS = ("chat_template_kwargs", "thinking_budget_tokens")
# the template's own variables that a request may not set: the renderer's
RENDERER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
CHAT_FIELDS = (_COMMON + ("messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls")
               + REASONING_FIELDS)
COMPLETION_FIELDS = _COMMON + ("prompt", "logprobs", "echo", "prompt_logprobs")


def _common(body, known: tuple[str, ...]) -> tuple[str, bool, bool, str | None]:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _check_fields(body, known)
    model = _get(body, "model", (str,))
    if not model:
        raise ProtocolError("'model' is required", "model")
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ProtocolError("'stream_options.include_usage' must be a boolean", "stream_options")
    user = _get(body, "user", (str,))
    _get(body, "metadata", (dict,))
    return model, stream, include_usage, user


def _logprobs(body: dict, name: str) -> int | None:
    """`logprobs` (completions) or `top_logprobs` (chat), in sampling.RANGES' logprobs range."""
    value = _get(body, name, (int,))
    if value is not None:
        try:
            check_range("logprobs", value)
        except RequestError:
            raise ProtocolError(f"'{name}' {range_text('logprobs')}, got {value}", name) from None
    return value


def parse_messages(body: dict) -> list[dict]:
    """`messages`, checked and cleaned: text content only, `developer` as `system`."""
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
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ProtocolError(f"'messages[{i}].tool_call_id' must be a string", f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        clean.append(message)
    return clean


def parse_chat(body, defaults: dict | None = None) -> ParsedRequest:
    model, stream, include_usage, user = _common(body, CHAT_FIELDS)
    clean = parse_messages(body)
    want_logprobs = _get(body, "logprobs", (bool,), False)
    top = _logprobs(body, "top_logprobs")
    if top is not None and not want_logprobs:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    params, given, n = _sampling(body, logprobs, defaults)
    from runtime.serve import tools as T

    try:
        tools = T.parse_tools(body)
    except T.ToolError as err:
        raise ProtocolError(str(err), err.param) from None
    forced = T.constraint(tools) if tools is not None else None
    if forced is not None:
        if params.constraint is not None:
            raise ProtocolError("a required or named tool call constrains the reply already; drop the structured "
                                "output field", "tool_choice")
        params.constraint = forced
    budget = _get(body, "thinking_budget_tokens", (int,))
    if budget is not None:
        if budget < 0:
            raise ProtocolError(f"'thinking_budget_tokens' {range_text('thinking_budget')}, got {budget}",
                                "thinking_budget_tokens")
        params.thinking_budget = budget
    kwargs = _get(body, "chat_template_kwargs", (dict,))
    if kwargs and any(k in RENDERER_VARIABLES for k in kwargs):
        raise ProtocolError(f"'chat_template_kwargs' may not set {', '.join(k for k in kwargs if k in RENDERER_VARIABLES)}",
                            "chat_template_kwargs")
    return ParsedRequest(model, params, stream, include_usage, messages=clean, logprobs=logprobs,
                         max_tokens_given=given, return_token_ids=_get(body, "return_token_ids", (bool,), False), n=n,
                         tools=tools if tools is not None and tools.active else None, user=user,
                         template_kwargs=kwargs or None)


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's past tool calls, as OpenAI sends them back."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ProtocolError(f"'{where}' must be an array", where)
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", "{}"), str)):
            raise ProtocolError(f"'{where}' items must be {{'id', 'type': 'function', 'function': {{'name', "
                                "'arguments': a JSON string}}}}", where)
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


def parse_completion(body, defaults: dict | None = None) -> ParsedRequest:
    model, stream, include_usage, user = _common(body, COMPLETION_FIELDS)
    prompts = _prompts(body.get("prompt"))
    logprobs = _logprobs(body, "logprobs")
    echo = _get(body, "echo", (bool,), False)
    prompt_logprobs = _get(body, "prompt_logprobs", (int,))
    if prompt_logprobs is not None:
        _check(prompt_logprobs, "prompt_logprobs")
    params, given, n = _sampling(body, logprobs, defaults)
    if len(prompts) * n > MAX_CHOICES:
        raise ProtocolError(f"{len(prompts)} prompts of {n} choices each: at most {MAX_CHOICES} choices a request",
                            "prompt")
    # the prompt's rows are scored for echo's logprobs and for vLLM's prompt_logprobs alike
    scored = [v for v in (logprobs if echo else None, prompt_logprobs) if v is not None]
    params.prompt_logprobs = max(scored) if scored else None
    return ParsedRequest(model, params, stream, include_usage, prompt=prompts[0], logprobs=logprobs,
                         max_tokens_given=given, return_token_ids=_get(body, "return_token_ids", (bool,), False), n=n,
                         user=user, prompts=prompts, echo=echo, prompt_logprobs=prompt_logprobs)


def _prompts(raw) -> list:
    """A completion's prompts: a string, an array of token ids, or an array of either (a prompt each)."""
    def ids(p) -> bool:
        return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(raw, str) and raw:
        return [raw]
    if ids(raw):
        return [raw]
    if isinstance(raw, list) and raw and all((isinstance(p, str) and p) or ids(p) for p in raw):
        return list(raw)
    raise ProtocolError("'prompt' must be a non-empty string, an array of token ids, or an array of those (one "
                        "prompt each)", "prompt")


def _check(value, name: str) -> None:
    try:
        check_range(name, value)
    except RequestError as err:
        raise ProtocolError(str(err), name) from None


# ---- the published request schema (OpenAPI), from the same fields and ranges ----
def _ranged(name: str, kind: str = "number", bounds=None) -> dict:
    lo, hi, open_lo = bounds or RANGES[name]
    out: dict = {"type": kind, ("exclusiveMinimum" if open_lo else "minimum"): lo}
    if hi is not None:
        out["maximum"] = hi
    return out


def field_schema(f) -> dict:
    """A declared sampling field's schema (runtime/core/request_fields.py)."""
    out = _ranged(f.name, f.kind, f.range) if f.range else {"type": f.kind}
    return {**out, "description": f"{f.description} ({f.origin}'s field)"} if f.help else out


def request_schema(chat: bool, models: list[str] | None = None, fields=SAMPLING_FIELDS) -> dict:
    """JSON schema of a chat or completions request body: every field the parser accepts, no other;
    models: the names a server serves (any non-empty string when not given)."""
    text = {"type": "string", "minLength": 1}
    props: dict = {
        "model": {"enum": list(models)} if models else text,
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "max_tokens": _ranged("max_tokens", "integer"), "max_completion_tokens": _ranged("max_tokens", "integer"),
        **{f.name: field_schema(f) for f in fields},
        "stop": {"anyOf": [text, {"type": "array", "items": text}]},
        "logit_bias": {"type": "object", "additionalProperties": _ranged("logit_bias")},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
        "return_token_ids": {"type": "boolean", "description": "RuvLLM (as vLLM): each choice carries its token ids"},
        "ignore_eos": {"type": "boolean", "description": "as vLLM: generate past end-of-sequence tokens"},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                           "description": "as vLLM: token ids that end the choice"},
        "include_stop_str_in_output": {"type": "boolean", "description": "as vLLM: keep the matched stop string"},
        "dry_sequence_breakers": {"type": "array", "items": text},
        "user": {"type": "string"}, "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "store": {"type": "boolean"}, "service_tier": {"type": "string"},
        "response_format": {"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["name"], "properties": {
                    "name": text, "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]},
                    "description": {"type": "string"}}}}}]},
        "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1,
                               "description": "as vLLM: one of json (a schema), regex, choice, grammar (Lark), "
                                              "json_object (true)",
                               "properties": {"json": {"type": ["object", "string"]}, "regex": text,
                                              "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                                              "grammar": text, "json_object": {"const": True}},
                               "additionalProperties": False},
        "guided_json": {"type": ["object", "string"], "description": "vLLM's older name of structured_outputs.json"},
        "guided_regex": text, "guided_choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "guided_grammar": text,
    }
    top = {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
    if chat:
        part = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"]}
        message = {"type": "object", "required": ["role", "content"],
                   "properties": {"role": {"enum": list(ROLES)},
                                  "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}}}
        tool = {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
                "parameters": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}
        choice = {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object", "required": ["type", "function"],
                  "properties": {"type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                 "properties": {"name": {"type": "string"}}}}}]}
        props.update(messages={"type": "array", "minItems": 1, "items": message}, logprobs={"type": "boolean"},
                     top_logprobs=top, tools={"type": "array", "minItems": 1, "items": tool}, tool_choice=choice,
                     parallel_tool_calls={"type": "boolean"},
                     chat_template_kwargs={"type": "object", "not": {"anyOf": [{"required": [k]} for k in RENDERER_VARIABLES]},
                                           "description": "as vLLM: the chat template's own variables, such as "
                                                          "Qwen3's enable_thinking"},
                     thinking_budget_tokens={**_ranged("thinking_budget", "integer"),
                                             "description": "as llama.cpp's server: a reasoning model's thinking "
                                                            "block is closed after this many tokens"})
    else:
        ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
        props.update(prompt={"anyOf": [text, ids, {"type": "array", "minItems": 1, "items": text},
                                       {"type": "array", "minItems": 1, "items": ids}]},
                     logprobs=top, echo={"type": "boolean"},
                     prompt_logprobs={**_ranged("prompt_logprobs", "integer"),
                                      "description": "as vLLM: each prompt token's log-probability given the tokens "
                                                     "before it, with this many alternatives"})
    return {"type": "object", "required": ["model", "messages" if chat else "prompt"], "properties": props,
            "additionalProperties": False}


def model_not_found(name: str) -> ProtocolError:
    return ProtocolError(f"the model '{name}' does not exist; see GET /v1/models", "model", status=404,
                         code="model_not_found")
