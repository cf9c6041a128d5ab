"""Structured output in the page: the pure-Python guide (runtime/core/token_guide.py) drives
onnxruntime-web's logits_mask. 10 of the 50 native schemas, each valid by jsonschema and token for token
what the native engine writes on the same browser package with the same guide; streamed equal to whole;
OpenAI tool calls; what the page cannot enforce is a clear error and the page keeps serving."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.runtime.test_structured_output import PROMPT, schemas
from tests.web.conftest import CHAT, LOAD_ENGINE, STREAM, dump, stream_ids

pytestmark = pytest.mark.slow

SMOL = "/models/smollm2-135m/"
PICKED = (0, 1, 3, 4, 7, 8, 9, 16, 19, 39)  # objects, enums, nesting, arrays, anyOf, $defs, pattern, numbers


def request(schema, **extra) -> dict:
    return {"messages": PROMPT, "max_tokens": 120, "temperature": 0, "return_token_ids": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}, **extra}


@pytest.fixture(scope="module")
def native(web_bundle):
    """The same browser package natively, with the page's pure-Python guide."""
    import os

    from runtime.core.engine import Engine

    os.environ["RUVLLM_GUIDE"] = "python"
    try:
        yield Engine.from_package(web_bundle / "models" / "smollm2-135m", max_batch_tokens=256, speculative_tokens=0)
    finally:
        os.environ.pop("RUVLLM_GUIDE", None)


def native_ids(engine, schema) -> list[int]:
    from runtime.core.constraints import Constraint
    from runtime.core.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=120, constraint=Constraint("json_schema", schema))
    return [t for o in engine.generate(messages=PROMPT, params=params) for t in o.token_ids]


def test_ten_schemas_in_the_page_are_valid_and_equal_native(offline_page, native):
    p = offline_page()
    p.api()
    p.evaluate(LOAD_ENGINE, [SMOL, {"device": "wasm", "speculativeTokens": 0, "backend": "onnxruntime"}])
    every = schemas()
    picked = [every[i] for i in PICKED]
    # all ten at once, batched in the page
    replies = p.evaluate("async (reqs) => Promise.all(reqs.map((r) => engine.chat.completions.create(r)))",
                         [request(s) for s in picked])
    for schema, reply in zip(picked, replies):
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", dump(reply)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        assert choice["token_ids"] == native_ids(native, schema), (schema, choice["message"]["content"])
    # streamed: the same tokens as whole
    chunks = p.evaluate(STREAM, request(picked[0]))
    assert stream_ids(chunks) == replies[0]["choices"][0]["token_ids"]


def test_tool_calls_in_the_page_and_what_it_cannot_enforce(offline_page):
    """A required weather call (the tool-call grammar, %json over the function's schema) gives OpenAI's
    tool_calls with valid arguments; a format it cannot enforce is an error, and the page keeps serving."""
    from tests.runtime.test_tools import ASK, WEATHER

    p = offline_page()
    p.api()
    p.evaluate(LOAD_ENGINE, [SMOL, {"device": "wasm", "speculativeTokens": 0}])
    err = p.evaluate("""async (req) => { try { await engine.chat.completions.create(req); return null; }
      catch (e) { return { message: e.message, param: e.error?.param }; } }""",
                     request({"type": "string", "format": "date-time"}))
    assert err and "format" in err["message"] and err["param"] == "response_format", err
    reply = p.evaluate(CHAT, request({"enum": ["yes", "no"]}))
    assert reply["choices"][0]["message"]["content"] in ('"yes"', '"no"'), dump(reply)
    reply = p.evaluate(CHAT, {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
                              "max_tokens": 120})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], dump(reply)
    for call in choice["message"]["tool_calls"]:
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
