"""OpenAI tools on chat completions: the weather round trip with SmolLM2 through the openai client (a
required call constrained by the function's schema, streamed deltas equal to the whole), the Hermes
prompt format for templates without tools, and 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.serve import tools as T

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


def live_server(package):
    from runtime.serve.server import create_app, load_models
    from tests.runtime.test_server import LiveServer

    models = load_models([str(package)], "cpu", 16, {}, {})
    return LiveServer(create_app(models)), next(iter(models))


def test_weather_tool_round_trip_with_the_openai_client(smol_int4):
    from openai import OpenAI

    live, model = live_server(smol_int4)
    try:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused")
        schema = WEATHER["function"]["parameters"]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                               temperature=0, max_tokens=120)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls, r
            for call in msg.tool_calls:
                assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
                jsonschema.validate(json.loads(call.function.arguments), schema)
            if isinstance(choice, dict):
                assert len(msg.tool_calls) == 1  # a named function: that one call
        stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                temperature=0, max_tokens=120, stream=True)
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in stream:
            for choice in chunk.choices:
                reasons.append(choice.finish_reason)
                for d in choice.delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
        whole = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                               temperature=0, max_tokens=120)
        assert [calls[k] for k in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                     for c in whole.choices[0].message.tool_calls]
        assert reasons[-1] == "tool_calls"
        call = whole.choices[0].message.tool_calls[0]
        answer = client.chat.completions.create(model=model, temperature=0, max_tokens=60, tools=[WEATHER], messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}])
        final = answer.choices[0]
        assert final.finish_reason in ("stop", "length") and not final.message.tool_calls
        assert isinstance(final.message.content, str) and final.message.content.strip()
    finally:
        live.stop()


def test_templates_without_tools_get_the_hermes_format_and_calls_parse_back():
    tools = T.parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    assert tools.choice is None and tools.active
    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    out = T.render_messages(messages, tools, template_takes_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n18C\n</tool_response>"}
    assert T.render_messages(messages, tools, template_takes_tools=True) is messages
    content, calls = T.parse_calls('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                   '</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>', tools)
    assert content == "Sure."  # a block naming no offered function is not a call (nor content)
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert T.parse_calls("no calls here", tools) == ("no calls here", [])
    assert T.constraint(tools) is None  # auto: the model chooses
    named = T.parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert T.constraint(named).kind == "grammar" and "start: call\n" in T.constraint(named).value
    assert T.parse_tools({"tools": [WEATHER], "tool_choice": "none"}).active is False


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_requests_are_400s_naming_the_field(tiny_package, extra, param):
    import httpx

    live, model = live_server(tiny_package("llama"))
    try:
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": model, "messages": ASK, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        live.stop()
