"""Schemathesis over the server's published OpenAPI document: every endpoint, valid and invalid bodies,
a bounded number of examples each (Ollama's API and llama.cpp's slots among them). No 5xx, and the server is healthy after."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

from runtime.serve import openai_protocol as P
from runtime.serve.server import create_app, load_models
from tests.runtime.test_server import LiveServer

pytestmark = pytest.mark.slow
EXAMPLES = 30  # per endpoint and mode


@pytest.fixture(scope="module")
def live(tiny_package, tmp_path_factory):
    models = load_models([str(tiny_package("llama"))], "cpu", 16, {})
    # a request that names no max_tokens gets 8 (`serve --max-tokens 8`), not the context's room: each of the
    # hundreds of cases is then quick, and every field is still read and checked as without the default
    server = LiveServer(create_app(models, slot_save_path=str(tmp_path_factory.mktemp("slots")),
                                   defaults={"max_tokens": 8}))
    server.model = next(iter(models))
    yield server
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    engine = models[server.model].engine
    assert engine.stats()["running"] == 0 and engine.stats()["kv_blocks_used"] == 0
    server.stop()


@pytest.fixture(scope="module")
def api_schema(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES, deterministic=True)
    return schema


def test_the_published_request_schemas_are_the_parsers_fields(live):
    doc = httpx.get(live.url + "/openapi.json").json()
    for path, fields in (("/v1/chat/completions", P.CHAT_FIELDS), ("/v1/completions", P.COMPLETION_FIELDS)):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == set(fields) and schema["additionalProperties"] is False
        assert schema["properties"]["model"] == {"enum": [live.model]}
        temperature = {k: v for k, v in schema["properties"]["temperature"].items() if k != "description"}
        assert temperature == {"type": "number", "minimum": 0.0, "maximum": 2.0}


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_no_request_gets_a_server_error(case):
    response = case.call(timeout=120)
    assert response.status_code < 500, (repr(case.body), response.text[:500])
    if response.status_code >= 400 and case.path.startswith("/api/"):  # Ollama's API: Ollama's error shape
        assert isinstance(response.json()["error"], str) and response.json()["error"]
    elif response.status_code >= 400:  # every other refusal in OpenAI's error shape
        error = response.json()["error"]
        assert error["message"] and error["type"]
