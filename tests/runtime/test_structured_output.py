"""Structured output natively: 50 JSON schemas on SmolLM2 checked with jsonschema, OpenAI's
response_format and vLLM's structured_outputs / guided_* through the openai client, streaming equal to
whole, batching with free-text requests, and 400s for what cannot be enforced."""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.core.constraints import Constraint
from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from runtime.errors import RequestError


def short(n: int = 12) -> dict:
    return {"type": "string", "maxLength": n}


def schemas() -> list[dict]:
    """50 schemas of varied shape (every string, array and integer bounded: a budget of tokens suffices)."""
    out: list[dict] = []
    for i in range(5):
        out.append({"type": "object", "properties": {"name": short(), "age": {"type": "integer", "minimum": 0,
                    "maximum": 120 + i}, "member": {"type": "boolean"}}, "required": ["name", "age", "member"],
                    "additionalProperties": False})
        out.append({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue", f"c{i}"]},
                    "shade": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["color", "shade"],
                    "additionalProperties": False})
        out.append({"type": "object", "properties": {"kind": {"const": f"point{i}"}, "x": {"type": "integer",
                    "minimum": -99, "maximum": 99}, "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                    "required": ["kind", "x", "y"], "additionalProperties": False})
        out.append({"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {
                    "type": "integer", "minimum": 1, "maximum": 9999}, "handle": short(8)}, "required": ["id", "handle"],
                    "additionalProperties": False}, "active": {"type": "boolean"}}, "required": ["user", "active"],
                    "additionalProperties": False})
        out.append({"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer",
                    "minimum": 0, "maximum": 100}, "minItems": 1 + i % 3, "maxItems": 3 + i % 3}},
                    "required": ["scores"], "additionalProperties": False})
        out.append({"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
                    "type": "object", "properties": {"sku": short(6), "qty": {"type": "integer", "minimum": 1,
                    "maximum": 9}}, "required": ["sku", "qty"], "additionalProperties": False}}},
                    "required": ["items"], "additionalProperties": False})
        out.append({"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0,
                    "maximum": 50}, short(5), {"type": "null"}]}, "note": {"type": ["string", "null"], "maxLength": 6}},
                    "required": ["value", "note"], "additionalProperties": False})
        out.append({"$defs": {"tag": {"type": "object", "properties": {"label": short(6), "weight": {
                    "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["label", "weight"],
                    "additionalProperties": False}}, "type": "object", "properties": {"main": {"$ref": "#/$defs/tag"},
                    "extra": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/tag"}}},
                    "required": ["main", "extra"], "additionalProperties": False})
        out.append({"type": "object", "properties": {"code": {"type": "string", "pattern": f"^[A-Z]{{2}}-[0-9]{{{2 + i % 2}}}$"},
                    "ok": {"type": "boolean"}, "nothing": {"type": "null"}}, "required": ["code", "ok", "nothing"],
                    "additionalProperties": False})
        out.append([{"type": "array", "items": {"enum": ["yes", "no", "maybe"]}, "minItems": 2, "maxItems": 4},
                    {"type": "object", "properties": {"title": short(10), "subtitle": short(10)}, "required": ["title"],
                     "additionalProperties": False},
                    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 2, "items": {"type": "array",
                     "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}, "required": ["grid"],
                     "additionalProperties": False},
                    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -40, "maximum": 50},
                     "unit": {"enum": ["C", "F"]}}, "required": ["temp", "unit"], "additionalProperties": False},
                    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {
                     "type": "integer", "minimum": 0, "maximum": 3}}, "required": ["a", "b", "c"],
                     "additionalProperties": False},
                    {"enum": ["alpha", "beta", "gamma", "delta"]}][i])
    assert len(out) == 50
    return out


PROMPT = [{"role": "user", "content": "Reply with one JSON value that fits what you are asked: describe a person."}]


def test_fifty_schemas_give_valid_json_batched_with_free_text(smol_int4):
    """All 50 at once (greedy and sampled), beside two free-text requests whose tokens stay those of a
    solo run: each output parses, validates with jsonschema, and ends by itself. The free requests have
    prompts of their own: rows that share prompt blocks are attended together (cascade attention in
    ruvllm.PagedAttention), which rounds differently from a lone row."""
    engine = Engine.from_package(smol_int4, max_num_seqs=32)
    free = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = ["Once upon a time, in a quiet harbour town,", "The three laws of motion say that"]
    solo = [[t for o in engine.generate(p, params=free) for t in o.token_ids] for p in prompts]
    ids = {}
    for i, schema in enumerate(schemas()):
        params = SamplingParams(max_tokens=200, temperature=0.0 if i % 2 else 0.8, seed=i,
                                constraint=Constraint("json_schema", schema))
        ids[engine.add_request(messages=PROMPT, params=params)] = schema
    plain = [engine.add_request(p, params=free) for p in prompts]
    text = {rid: "" for rid in [*ids, *plain]}
    tokens = {rid: [] for rid in plain}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id] += out.delta
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for rid, schema in ids.items():
        assert reasons[rid] == "stop", (schema, text[rid])
        jsonschema.validate(json.loads(text[rid]), schema)
    assert [tokens[rid] for rid in plain] == solo


def test_regex_choice_grammar_and_json_object(tiny_package):
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=3)
    cases = [(Constraint("regex", r"[0-9]{3}-[a-z]{2}"), lambda s: len(s) == 6 and s[3] == "-" and s[:3].isdigit()),
             (Constraint("choice", ["yes", "no way", "perhaps"]), lambda s: s in ("yes", "no way", "perhaps")),
             (Constraint("grammar", 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[1-9]/'),
              lambda s: s[0] == "(" and s[-1] == ")" and len(s) in (3, 5)),
             (Constraint("json_schema", {"type": "integer", "minimum": 10, "maximum": 20}), lambda s: 10 <= int(s) <= 20)]
    for temperature in (0.0, 1.0):
        for c, ok in cases:
            outs = list(engine.generate("hello there", SamplingParams(max_tokens=40, temperature=temperature, seed=3,
                                                                   constraint=c)))
            text = "".join(o.delta for o in outs)
            assert outs[-1].finish_reason == "stop" and ok(text), (c, text)
    # any JSON object: a random model writes one to its end only when the object may be empty; check the prefix
    outs = list(engine.generate("hi", SamplingParams(max_tokens=8, temperature=0.0, constraint=Constraint("json_object"))))
    assert "".join(o.delta for o in outs).startswith("{")


def test_constraints_the_engine_cannot_compile_are_request_errors(tiny_package):
    engine = Engine.from_package(tiny_package("llama"))
    for c, match in ((Constraint("json_schema", {"type": "foo"}), "Invalid type"),
                     (Constraint("json_schema", {"type": "string", "format": "weird"}), "format"),
                     (Constraint("regex", "[unclosed"), "regex"),
                     (Constraint("grammar", "start: missing_rule"), "grammar")):
        with pytest.raises(RequestError, match=match) as err:
            engine.add_request("x", SamplingParams(constraint=c))
        assert err.value.param == "response_format"
    for kind, value in (("json_schema", "not a schema"), ("choice", []), ("regex", ""), ("nope", None)):
        with pytest.raises(RequestError):
            Constraint(kind, value)
    assert not engine.has_unfinished()
    engine.backend.runner.has_mask = False  # a package exported before the mask input
    engine.backend._guide = None
    with pytest.raises(RequestError, match="re-export"):
        engine.add_request("x", SamplingParams(constraint=Constraint("json_object")))


def test_openai_client_response_format_and_vllm_fields(tiny_package):
    """Through the server: response_format json_schema whole and streamed (the deltas concatenate to
    the whole), vLLM's structured_outputs and guided_choice via extra_body, and 400s naming the field."""
    from openai import BadRequestError, OpenAI

    from runtime.serve.server import create_app, load_models
    from tests.runtime.test_server import LiveServer

    models = load_models([str(tiny_package("llama"))], "cpu", 16, {"speculative_tokens": 0}, {})
    live = LiveServer(create_app(models))
    try:
        model = next(iter(models))
        client = OpenAI(base_url=live.url + "/v1", api_key="unused")
        schema = {"type": "object", "properties": {"city": short(10), "days": {"type": "integer", "minimum": 1,
                  "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}
        fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}
        messages = [{"role": "user", "content": "Plan a trip."}]
        whole = client.chat.completions.create(model=model, messages=messages, response_format=fmt, temperature=0,
                                               max_tokens=60)
        content = whole.choices[0].message.content
        jsonschema.validate(json.loads(content), schema)
        assert whole.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(model=model, messages=messages, response_format=fmt, temperature=0,
                                                max_tokens=60, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content
        regex = client.completions.create(model=model, prompt="Code:", max_tokens=20, temperature=0.7,
                                          extra_body={"structured_outputs": {"regex": "[A-Z]{3}[0-9]{2}"}})
        code = regex.choices[0].text
        assert len(code) == 5 and code[:3].isupper() and code[3:].isdigit()
        pick = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=1.0,
                                              extra_body={"guided_choice": ["north", "south"]})
        assert pick.choices[0].message.content in ("north", "south")
        bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
                "response_format"),
               ({"response_format": {"type": "xml"}}, "response_format"),
               ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
               ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")]
        for extra, param in bad:
            with pytest.raises(BadRequestError) as err:
                client.chat.completions.create(model=model, messages=messages, max_tokens=5, extra_body=extra)
            assert err.value.body["param"] == param, err.value.body
    finally:
        live.stop()


def test_cli_json_schema_file(tiny_package, tmp_path):
    from tests.conftest import run_cli

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    proc = run_cli("generate", str(tiny_package("llama")), "count", "--json-schema", str(tmp_path / "s.json"),
                   "--temperature", "0", "--max-tokens", "30", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    jsonschema.validate(json.loads(json.loads(proc.stdout)["text"]), schema)
    (tmp_path / "bad.json").write_text("{not json")
    proc = run_cli("generate", str(tiny_package("llama")), "count", "--json-schema", str(tmp_path / "bad.json"))
    assert proc.returncode != 0 and "bad.json" in proc.stderr


def test_a_constraint_the_tokens_cannot_continue_ends_that_request_alone(tiny_package):
    """A choice of U+40000 (found by the server fuzzer): llguidance's mask allows a byte token it then
    refuses. That request ends with an error naming response_format; the one beside it runs on."""
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
    bad = engine.add_request("x", SamplingParams(max_tokens=8, temperature=0.0,
                                                 constraint=Constraint("choice", ["\U00040000"])))
    good = engine.add_request("x", SamplingParams(max_tokens=8, temperature=0.0))
    outs = {bad: [], good: []}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    assert outs[bad][-1].error_param == "response_format" and "cannot continue" in outs[bad][-1].error
    assert len([t for o in outs[good] for t in o.token_ids]) == 8 and not outs[good][-1].error
