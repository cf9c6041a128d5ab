"""`ruvllm serve` over real HTTP on loopback: the openai client, concurrency, metrics, disconnects, bad requests."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from runtime.serve.server import create_app, load_models

PROMPTS = [f"Tell me about {w} number {i}" for i, w in enumerate(
    "apple river stone cloud seven orange music window paper tiger light north garden silver bridge summer".split() * 2)]


class LiveServer:
    """uvicorn serving an app on a free loopback port, in a thread, stopped gracefully."""

    def __init__(self, app) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(tiny_package):
    models = load_models([str(tiny_package("llama"))], "cpu", 32, {})
    live = LiveServer(create_app(models))
    live.model = next(iter(models))
    live.models = models
    yield live
    live.stop()


def solo(pkg, messages, max_tokens=16) -> list[str]:
    engine = Engine.from_package(pkg, enable_prefix_cache=False, max_num_seqs=1)
    return ["".join(o.delta for o in engine.generate(messages=m, params=SamplingParams(temperature=0, max_tokens=max_tokens)))
            for m in messages]


def test_openai_client_chat_completions_streaming_stop_and_seed(served, tiny_package):
    from openai import OpenAI

    client = OpenAI(base_url=served.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [served.model]
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    expected = solo(tiny_package("llama"), [msgs])[0]
    r = client.chat.completions.create(model=served.model, messages=msgs, temperature=0, max_tokens=16)
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=served.model, messages=msgs, temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 16
    stop = expected[4:8]
    r = client.chat.completions.create(model=served.model, messages=msgs, temperature=0, max_tokens=16, stop=[stop])
    assert r.choices[0].message.content == expected[: expected.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    a = client.chat.completions.create(model=served.model, messages=msgs, temperature=1.0, seed=7, max_tokens=12)
    b = client.chat.completions.create(model=served.model, messages=msgs, temperature=1.0, seed=7, max_tokens=12)
    assert a.choices[0].message.content == b.choices[0].message.content
    c = client.completions.create(model=served.model, prompt="Once upon a time", temperature=0, max_tokens=10)
    assert c.choices[0].text and c.usage.completion_tokens == 10
    lp = client.chat.completions.create(model=served.model, messages=msgs, temperature=0, max_tokens=3,
                                        logprobs=True, top_logprobs=2)
    assert len(lp.choices[0].logprobs.content) == 3
    assert len(lp.choices[0].logprobs.content[0].top_logprobs) == 2


def test_n_choices_whole_and_streamed_seeded_and_counted_once(served, tiny_package):
    """n choices are n requests on one prompt, computed once: with a seed, choice i samples with seed + i
    (so a choice equals a single request seeded so); streamed chunks carry their choice's index; the
    usage counts the prompt once and every choice's completion."""
    from openai import OpenAI

    client = OpenAI(base_url=served.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    kw = {"model": served.model, "messages": msgs, "temperature": 1.0, "max_tokens": 12}
    r = client.chat.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3  # different seeds: different samples
    for i in range(3):
        assert client.chat.completions.create(seed=11 + i, **kw).choices[0].message.content == texts[i]
    single = client.chat.completions.create(seed=11, **kw).usage
    assert r.usage.prompt_tokens == single.prompt_tokens
    assert r.usage.completion_tokens == 3 * 12 and r.usage.total_tokens == r.usage.prompt_tokens + 36
    chunks = list(client.chat.completions.create(n=3, seed=11, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1, 2] and {f.finish_reason for f in finals} == {"length"}
    assert chunks[-1].usage.completion_tokens == 36
    greedy = client.completions.create(model=served.model, prompt="Once upon a time", temperature=0, max_tokens=8, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy choices agree, as OpenAI's do


def sse_text(lines: list[str]) -> str:
    text = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            payload = json.loads(line[6:])
            if payload.get("choices"):
                text.append(payload["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + ("{" + labels if labels else "")) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_32_concurrent_streams_equal_solo_and_metrics_count_them(served, tiny_package):
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    expected = solo(tiny_package("llama"), messages)
    before = httpx.get(served.url + "/metrics").text

    async def one(client, msgs):
        body = {"model": served.model, "messages": msgs, "temperature": 0, "max_tokens": 16, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            return [line async for line in resp.aiter_lines() if line]

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, m) for m in messages))

    results = asyncio.run(main())
    for lines, want in zip(results, expected):
        assert lines[-1] == "data: [DONE]"
        assert sse_text(lines) == want
    after = httpx.get(served.url + "/metrics").text
    label = 'endpoint="/v1/chat/completions",status="200"'
    assert metric(after, "ruvllm_requests_total", label) - metric(before, "ruvllm_requests_total", label) == 32
    assert metric(after, "ruvllm_generation_tokens_total") - metric(before, "ruvllm_generation_tokens_total") == 32 * 16
    assert metric(after, "ruvllm_time_to_first_token_seconds_count") - \
        metric(before, "ruvllm_time_to_first_token_seconds_count") == 32


@pytest.mark.slow
def test_disconnect_mid_stream_frees_kv_and_server_keeps_serving(smol_int4):
    """SmolLM2 (~10 ms a token here) asked for 1000 tokens: a client leaving after a few chunks stops it."""
    models = load_models([str(smol_int4)], "cpu", 4, {})
    live = LiveServer(create_app(models))
    try:
        name = next(iter(models))
        engine = models[name].engine
        # greedy, this prompt runs to the full 1000 tokens (checked with ruvllm generate)
        body = {"model": name, "messages": [{"role": "user", "content": "Write a very long story about a "
                                             "lighthouse keeper."}], "max_tokens": 1000, "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=live.url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                for i, _ in enumerate(resp.iter_lines()):
                    if i >= 3:
                        # check while iterating: leaving the loop closes the connection (httpcore)
                        assert engine.stats()["running"] == 1, (engine.stats(), repr(engine.step_error))
                        break
        deadline = time.time() + 5
        while engine.stats()["running"] or engine.stats()["kv_blocks_used"]:
            assert time.time() < deadline, engine.stats()
            time.sleep(0.01)
        assert engine.stats()["aborted"] == 1  # the client left: aborted, not run to its 1000 tokens
        assert engine.stats()["generated_tokens"] < 300
        assert 'ruvllm_requests_aborted_total{model="' + name + '"} 1.0' in httpx.get(live.url + "/metrics").text
        # n = 3 choices stream as three requests: leaving stops all three
        with httpx.Client(base_url=live.url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json={**body, "n": 3}) as resp:
                indices = set()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):  # choices that have generated (past their role chunk)
                        indices.update(c["index"] for c in json.loads(line[6:])["choices"] if c["delta"].get("content"))
                    if len(indices) == 3:
                        assert engine.stats()["running"] == 3, engine.stats()
                        break
        deadline = time.time() + 5
        while engine.stats()["running"] or engine.stats()["kv_blocks_used"]:
            assert time.time() < deadline, engine.stats()
            time.sleep(0.01)
        assert engine.stats()["aborted"] == 4
        r = httpx.post(live.url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        live.stop()


BAD = [
    ("malformed json", b'{"model": "m", "messages": [', 400, None),
    ("not utf-8", b'{"model": "\xff\xfe", "messages": []}', 400, None),
    ("body not an object", b"[1, 2]", 400, None),
    ("missing messages", {"model": "MODEL"}, 400, "messages"),
    ("wrong role", {"model": "MODEL", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("temperature type", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     400, "temperature"),
    ("negative max_tokens", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
     400, "max_tokens"),
    ("max_tokens as bool", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": True},
     400, "max_tokens"),
    ("top_p out of range", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "top_p": 3},
     400, "top_p"),
    ("n zero", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("n above OpenAI's 128", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "n": 129}, 400, "n"),
    ("bad logit_bias", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}},
     400, "logit_bias"),
    ("logit_bias outside vocab", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                                  "logit_bias": {"99999999": 1}}, 400, None),
    ("unknown model", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("huge prompt", {"model": "MODEL", "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ("stream not bool", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
     400, "stream"),
    ("temperature above 2", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
     400, "temperature"),
    ("lone surrogate", b'{"model": "MODEL", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("deeply nested", b'{"model": "MODEL", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("response_format with a bad schema", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                                           "response_format": {"type": "json_schema", "json_schema": {
                                               "name": "x", "schema": {"type": "foo"}}}}, 400, "response_format"),
    ("a tool without a name", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                               "tools": [{"type": "function", "function": {"description": "f"}}]}, 400, "tools[0]"),
    ("tool_choice required without tools", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                                            "tool_choice": "required"}, 400, "tool_choice"),
    ("functions (the deprecated form)", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                                         "functions": [{"name": "f"}]}, 400, "functions"),
    ("unknown field", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "temprature": 0},
     400, "temprature"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(served, name, body, status, param):
    if isinstance(body, dict):
        body = json.dumps({k: (served.model if v == "MODEL" else v) for k, v in body.items()}).encode()
    body = body.replace(b'"MODEL"', json.dumps(served.model).encode())
    r = httpx.post(served.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param
    if name == "huge prompt":
        assert err["code"] == "context_length_exceeded"
    assert httpx.get(served.url + "/health").status_code == 200


def test_informational_fields_are_accepted(served):
    r = httpx.post(served.url + "/v1/chat/completions", json={
        "model": served.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "user": "u-1", "metadata": {"team": "a"}, "store": False, "response_format": None, "tools": None})
    assert r.status_code == 200, r.text


def test_metrics_series_stay_bounded_under_random_paths(served):
    import random

    rng = random.Random(7)
    with httpx.Client(base_url=served.url, timeout=30) as client:
        for _ in range(1000):
            path = "/" + "/".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=rng.randint(1, 12)))
                                  for _ in range(rng.randint(1, 4)))
            assert client.get(path).status_code == 404
        assert client.get("/v1/chat/completions").status_code == 405
        text = client.get("/metrics").text
    series = [ln for ln in text.splitlines() if ln.startswith("ruvllm_requests_total{")]
    endpoints = {ln.split('endpoint="')[1].split('"')[0] for ln in series}
    assert len(series) <= 12, series
    assert "unmatched" in endpoints and endpoints <= {"unmatched", "/health", "/metrics", "/v1/models",
                                                      "/v1/chat/completions", "/v1/completions"}, endpoints
    assert 'ruvllm_requests_total{endpoint="unmatched",status="404"}' in text
    assert 'ruvllm_requests_total{endpoint="/v1/chat/completions",status="405"}' in text


def test_server_defaults_apply_where_the_request_is_silent(tiny_package):
    models = load_models([str(tiny_package("llama"))], "cpu", 4, {})
    live = LiveServer(create_app(models, defaults={"max_tokens": 3, "temperature": 0.0}))
    try:
        name = next(iter(models))
        body = {"model": name, "messages": [{"role": "user", "content": "hello there"}]}
        a = httpx.post(live.url + "/v1/chat/completions", json=body).json()
        b = httpx.post(live.url + "/v1/chat/completions", json=body).json()
        assert a["usage"]["completion_tokens"] == 3 and a["choices"][0]["finish_reason"] == "length"
        assert a["choices"][0]["message"] == b["choices"][0]["message"]  # temperature 0 by default: greedy
        c = httpx.post(live.url + "/v1/chat/completions", json={**body, "max_tokens": 5}).json()
        assert c["usage"]["completion_tokens"] == 5  # the request's own value wins
    finally:
        live.stop()


def test_unknown_route_and_method_use_the_error_shape(served):
    r = httpx.get(served.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(served.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_and_full_queue(tiny_package):
    models = load_models([str(tiny_package("llama"))], "cpu", 4, {})
    live = LiveServer(create_app(models, api_key="sekret", max_queue=0))
    try:
        name = next(iter(models))
        body = {"model": name, "prompt": "hi", "max_tokens": 2}
        r = httpx.post(live.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert httpx.get(live.url + "/health").status_code == 200  # health needs no key
        for path in ("/api/tags", "/tokenizer_info"):  # Ollama's API and the tokenizer's need the key too
            assert httpx.get(live.url + path).status_code == 401
            assert httpx.get(live.url + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        r = httpx.post(live.url + "/api/chat", headers={"Authorization": "Bearer sekret"}, json={
            "model": name, "messages": [{"role": "user", "content": "hi"}], "stream": False})
        assert r.status_code == 429 and "queue" in r.json()["error"]  # the same queue limit, in Ollama's shape
    finally:
        live.stop()
    live = LiveServer(create_app(models, ollama_api=False))  # serve --no-ollama-api
    try:
        assert httpx.get(live.url + "/api/tags").status_code == 404
        assert httpx.get(live.url + "/v1/models").status_code == 200
    finally:
        live.stop()


def test_graceful_shutdown_finishes_in_flight_streams(tiny_package):
    models = load_models([str(tiny_package("llama"))], "cpu", 4, {})
    live = LiveServer(create_app(models))
    name = next(iter(models))
    body = {"model": name, "messages": [{"role": "user", "content": "go"}], "temperature": 0, "max_tokens": 60,
            "stream": True}
    lines: list[str] = []
    with httpx.Client(base_url=live.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            it = resp.iter_lines()
            lines.append(next(it))
            stopper = threading.Thread(target=live.stop)
            stopper.start()
            lines.extend(line for line in it if line)
    stopper.join(timeout=30)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_two_packages_are_served_side_by_side(tiny_package):
    models = load_models([str(tiny_package("llama")), str(tiny_package("qwen2"))], "cpu", 4, {})
    live = LiveServer(create_app(models))
    try:
        names = [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]]
        assert names == list(models) and len(names) == 2
        texts = []
        for name in names:
            r = httpx.post(live.url + "/v1/completions",
                           json={"model": name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == name
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] != texts[1]  # different weights answered
    finally:
        live.stop()


def test_greedy_request_decodes_speculatively_with_unchanged_text_and_counted_drafts(served, tiny_package):
    prompt = "one two three four five one two three four five one two three"
    plain = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
    want = "".join(o.delta for o in plain.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
    before = httpx.get(served.url + "/metrics").text
    r = httpx.post(served.url + "/v1/completions", json={"model": served.model, "prompt": prompt, "max_tokens": 24,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    after = httpx.get(served.url + "/metrics").text
    drafted = metric(after, "ruvllm_spec_draft_tokens_total") - metric(before, "ruvllm_spec_draft_tokens_total")
    accepted = metric(after, "ruvllm_spec_accepted_tokens_total") - metric(before, "ruvllm_spec_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
