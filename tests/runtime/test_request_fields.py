"""Each scalar sampling field is declared once (runtime/core/request_fields.py): a field added to a copy of the
declaration reaches the OpenAI request parser, its published schema and the CLI's flags, and no front end names a
default of its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtime.core.request_fields import SAMPLING_FIELDS, SamplingField
from runtime.core.sampling import RANGES, SamplingParams
from runtime.serve import openai_protocol as P
from runtime.serve.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
FAKE = SamplingField("xtc_probability", "number", 0.0, (0.0, 1.0, False), "XTC: how often to exclude top choices",
                     "llama.cpp's server")


def test_a_new_field_reaches_every_front_end():
    fields = (*SAMPLING_FIELDS, FAKE)
    assert P.sampling_values({}, None, fields)["xtc_probability"] == 0.0  # the declared default
    assert P.sampling_values({"xtc_probability": 0.5}, None, fields)["xtc_probability"] == 0.5
    assert P.sampling_values({}, {"xtc_probability": 0.25}, fields)["xtc_probability"] == 0.25  # the server's
    with pytest.raises(P.ProtocolError, match="xtc_probability"):
        P.sampling_values({"xtc_probability": "high"}, None, fields)
    schema = P.request_schema(True, fields=fields)["properties"]["xtc_probability"]
    assert schema["type"] == "number" and schema["minimum"] == 0.0 and schema["maximum"] == 1.0
    args = build_parser(fields).parse_args(["generate", "hi", "--xtc-probability", "0.3"])
    assert args.xtc_probability == 0.3
    assert "xtc_probability" not in P.request_schema(True)["properties"]  # the copy, not the declaration


def test_every_declared_field_is_a_sampling_setting_with_its_declared_default_and_range():
    params = SamplingParams()
    for f in SAMPLING_FIELDS:
        assert getattr(params, f.name) == f.default, f.name
        assert RANGES.get(f.name) == f.range, f.name
        schema = P.request_schema(False)["properties"][f.name]
        assert schema["type"] == f.kind, f.name
    flags = build_parser().parse_args(["generate", "hi"])
    assert all(getattr(flags, f.name) is None for f in SAMPLING_FIELDS)  # not given: the model's or the request's


def test_no_front_end_names_a_declared_default_of_its_own():
    """The parser, the CLI and the page's engine read the declaration; none spells a field's default beside it."""
    names = "|".join(f.name for f in SAMPLING_FIELDS)
    for path in ("runtime/serve/openai_protocol.py", "runtime/serve/cli/parser.py", "runtime/serve/cli/options.py",
                 "runtime/serve/web_api.py"):
        text = (ROOT / path).read_text()
        found = re.findall(rf"""get\(["'](?:{names})["'],\s*[-\d.]""", text) + re.findall(
            rf"""["']--(?:{names.replace('_', '-')})["']""", text)
        assert not found, (path, found)
