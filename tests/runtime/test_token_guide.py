"""The page's pure-Python structured-output guide (runtime/core/token_guide.py), natively: random walks
over its masks always give text the constraint accepts; on SmolLM2 the 50 schemas of
test_structured_output validate; its masks never allow what llguidance forbids where both are exact."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from runtime.core.constraints import Constraint
from runtime.core.token_guide import PyGuide
from runtime.errors import RequestError
from tests.runtime.test_structured_output import PROMPT, schemas

# a toy vocabulary: every byte, some multi-byte pieces a JSON writer needs, a lone UTF-8 lead byte
TOY = [bytes([b]) for b in range(256)] + [b'{"', b'": ', b'", "', b'"}', b"name", b"true", b"null", b"12", b", ",
                                           b'"]', b'["', b"\xc3\xa9", b"hello world", b"}", b"},", b'"name": "', b"-0.5"]
EOS = len(TOY)


@pytest.fixture(scope="module")
def toy() -> PyGuide:
    return PyGuide(TOY + [b""], len(TOY) + 1, [EOS])


def allowed(matcher, vocab: int) -> list[int]:
    bits = int.from_bytes(bytes(matcher.allowed_bits()), "little")
    return [i for i in range(vocab) if bits >> i & 1]


def walk(guide: PyGuide, c: Constraint, rng: random.Random, limit: int = 300) -> bytes | None:
    """Random allowed tokens until the constraint ends (None if `limit` tokens did not end it)."""
    m = guide.matcher(c)
    out = b""
    for _ in range(limit):
        ids = allowed(m, guide.vocab_size)
        assert ids, f"a dead end after {out!r}"
        if EOS in ids and (rng.random() < 0.3 or ids == [EOS]):
            assert m.consume(EOS) and m.is_stopped()
            return out
        token = rng.choice([t for t in ids if t != EOS])
        assert m.consume(token), (out, TOY[token])
        out += TOY[token]
        if m.is_stopped():
            assert allowed(m, guide.vocab_size) == [EOS]
            return out
    return None


WALKED = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
     "b": {"enum": ["x", "y", 3, None]}, "c": {"type": "number", "minimum": -40, "maximum": 50}}, "required": ["a"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}, "ok": {"type": "boolean"}},
     "required": ["code", "ok"], "additionalProperties": False},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": -7, "maximum": 1234},
     "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v", "kids"]}},
     "$ref": "#/$defs/node"},
    {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]},
    {"type": "array", "items": {"type": "integer", "exclusiveMinimum": 0, "maximum": 12}},
    {"type": ["object", "null"], "additionalProperties": {"type": "boolean"}},
    {"type": "object", "properties": {"free": {}}, "required": ["free"]},
]


@pytest.mark.parametrize("schema", WALKED, ids=range(len(WALKED)))
def test_random_walks_over_the_masks_write_json_the_schema_accepts(toy, schema):
    rng = random.Random(0)
    ended = [out for out in (walk(toy, Constraint("json_schema", schema), rng) for _ in range(40)) if out is not None]
    assert len(ended) >= 10
    for out in ended:
        jsonschema.validate(json.loads(out.decode("utf-8")), schema)


def test_regex_choice_grammar_and_any_object(toy):
    rng = random.Random(1)
    cases = [(Constraint("regex", r"(ab|c)+-\d{2,3}"), lambda s: re.fullmatch(r"(ab|c)+-\d{2,3}", s)),
             (Constraint("choice", ["yes", "no way"]), lambda s: s in ("yes", "no way")),
             (Constraint("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'), lambda s: re.fullmatch(r"\(\d(\+\d)*\)", s)),
             (Constraint("json_object"), lambda s: isinstance(json.loads(s), dict))]
    for c, ok in cases:
        outs = [o for o in (walk(toy, c, rng) for _ in range(30)) if o is not None]
        assert outs and all(ok(o.decode("utf-8")) for o in outs), (c, outs[:3])


def test_the_tool_call_grammar_runs_in_the_page_guide(toy):
    """runtime/serve/tools.py's grammar for a required call (Lark with %json): every walk is a valid call."""
    from runtime.serve.tools import CALL_CLOSE, CALL_OPEN, constraint, parse_tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
    c = constraint(parse_tools({"tools": [weather], "tool_choice": "required"}))
    rng = random.Random(2)
    outs = [o for o in (walk(toy, c, rng, limit=600) for _ in range(20)) if o is not None]
    assert outs
    for out in outs:
        for block in re.findall(re.escape(CALL_OPEN) + r"\n(.*?)\n" + re.escape(CALL_CLOSE), out.decode("utf-8"), re.S):
            call = json.loads(block)
            assert call["name"] == "get_weather"
            jsonschema.validate(call["arguments"], weather["function"]["parameters"])


@pytest.mark.parametrize("schema,word", [({"type": "string", "format": "email"}, "format"),
                                         ({"type": "array", "uniqueItems": True}, "uniqueItems"),
                                         ({"type": "integer", "multipleOf": 3}, "multipleOf"),
                                         ({"type": "string", "pattern": "(?=a)b"}, "group"),
                                         ({"$ref": "#/$defs/missing"}, "missing")])
def test_what_it_cannot_enforce_is_refused_by_name(toy, schema, word):
    with pytest.raises(RequestError) as err:
        toy.matcher(Constraint("json_schema", schema))
    assert word in str(err.value) and err.value.param == "response_format"


def test_fifty_schemas_on_smollm2_with_the_python_guide(smol_int4, monkeypatch):
    """What the page runs, natively on SmolLM2: all 50 schemas batched, each output valid."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    monkeypatch.setenv("RUVLLM_GUIDE", "python")
    engine = Engine.from_package(smol_int4, max_num_seqs=32)
    ids = {}
    for i, schema in enumerate(schemas()):
        params = SamplingParams(max_tokens=200, temperature=0.0 if i % 2 else 0.8, seed=i,
                                constraint=Constraint("json_schema", schema))
        ids[engine.add_request(messages=PROMPT, params=params)] = schema
    text, reasons = {rid: "" for rid in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id] += out.delta
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for rid, schema in ids.items():
        assert reasons[rid] == "stop", (schema, text[rid])
        jsonschema.validate(json.loads(text[rid]), schema)
    assert type(engine.backend.guide(engine.tokenizer)).__name__ == "PyGuide"
