"""Who may do what on `ruvllm serve`: named API keys, per-key concurrency, runtime adapter loading."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from runtime.errors import RuvLLMError
from runtime.serve import api_keys
from runtime.serve.api_keys import ApiKeys, access_warnings, digest
from runtime.serve.server import create_app, load_models
from tests.conftest import ROOT
from tests.runtime.test_server import LiveServer

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


@pytest.fixture
def tiny_models(tiny_package):  # one per server: stopping a server shuts its engines down
    return load_models([str(tiny_package("llama"))], "cpu", 8, {"speculative_tokens": 0})


def key_file(tmp_path, entries) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": entries}))
    return str(path)


def test_two_keys_each_see_their_own_identity_and_quota(tiny_models, tmp_path):
    keys = ApiKeys.load(path=key_file(tmp_path, [
        {"name": "alice", "key": ALICE, "max_concurrent": 1},
        {"name": "bob", "sha256": digest(BOB).hex()}]))
    live = LiveServer(create_app(tiny_models, keys=keys))
    model = next(iter(tiny_models))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            me = {who: http.get("/v1/me", headers={"Authorization": f"Bearer {secret}"}).json()
                  for who, secret in (("alice", ALICE), ("bob", BOB))}
            assert me["alice"]["name"] == "alice" and me["alice"]["max_concurrent"] == 1
            assert me["bob"]["name"] == "bob" and me["bob"]["max_concurrent"] is None
            assert "bob" not in json.dumps(me["alice"]) and "alice" not in json.dumps(me["bob"])
            for bad in ({}, {"Authorization": "Bearer sk-alice-012345678"}, {"Authorization": f"Basic {ALICE}"},
                        {"Authorization": f"Bearer {digest(BOB).hex()}"}):  # the stored digest is no key
                r = http.get("/v1/me", headers=bad)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200  # needs no key

            # alice may have one request in flight: a second one is 429 while her stream runs; bob is not limited
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            alice = {"Authorization": f"Bearer {ALICE}"}
            with http.stream("POST", "/v1/completions", json=body, headers=alice) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                assert http.get("/v1/me", headers=alice).json()["in_flight"] == 1
                second = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=alice)
                assert second.status_code == 429 and second.json()["error"]["code"] == "concurrency_limit_exceeded"
                other = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                                  headers={"Authorization": f"Bearer {BOB}"})
                assert other.status_code == 200
                assert [line for line in lines if line][-1] == "data: [DONE]"
            assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                             headers=alice).status_code == 200
            assert http.get("/v1/me", headers=alice).json()["in_flight"] == 0
            metrics = http.get("/metrics").text
        assert 'ruvllm_key_requests_total{key="alice",status="429"} 1.0' in metrics
        assert 'ruvllm_key_requests_total{key="bob",status="200"}' in metrics
    finally:
        live.stop()


def test_a_key_is_found_by_comparing_digests_with_every_key(monkeypatch):
    """Constant time by construction: the presented key is hashed, and compare_digest runs against every
    stored digest whether or not one matched, so neither a right prefix nor which key matched shows."""
    keys = ApiKeys.load(ALICE, None)
    keys = ApiKeys(keys.keys + [api_keys.ApiKey(f"k{i}", digest(f"secret-number-{i}")) for i in range(5)])
    calls = []
    real = api_keys.hmac.compare_digest
    monkeypatch.setattr(api_keys.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    for header, want in ((f"Bearer {ALICE}", "default"), ("Bearer secret-number-4", "k4"),
                         (f"Bearer {ALICE[:-1]}", None), ("Bearer " + "x" * 5000, None), ("", None)):
        calls.clear()
        found = keys.identify(header.encode())
        assert (found.name if found else None) == want
        assert calls == [(32, 32)] * 6


@pytest.mark.parametrize("entries, message", [
    ([{"name": "alice", "key": ALICE}, {"name": "alice", "key": BOB}], "unique"),
    ([{"name": "a", "key": ALICE}, {"name": "b", "key": ALICE}], "same secret"),
    ([{"name": "alice/x", "key": ALICE}], "'name'"),
    ([{"name": "anonymous", "key": ALICE}], "'name'"),
    ([{"name": "alice", "key": ALICE, "sha256": digest(ALICE).hex()}], "exactly one"),
    ([{"name": "alice", "key": "short"}], "at least 8"),
    ([{"name": "alice", "sha256": "abc"}], "64 hex"),
    ([{"name": "alice", "key": ALICE, "max_concurrent": 0}], "positive"),
    ([{"name": "alice", "key": ALICE, "rate": 3}], "expected an object"),
    ([], "expected"),
])
def test_bad_key_files_are_refused_by_name(tmp_path, entries, message):
    with pytest.raises(RuvLLMError, match=message):
        ApiKeys.load(path=key_file(tmp_path, entries))


def test_runtime_adapter_endpoints_are_off_by_default(tiny_models, peft_adapters):
    live = LiveServer(create_app(tiny_models))
    try:
        adapter = str(peft_adapters("llama")["attn4"])
        r = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter})
        assert r.status_code == 404 and "error" in r.json()
        assert httpx.post(live.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        assert [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]] == list(tiny_models)
    finally:
        live.stop()


def test_runtime_adapter_loading_answers_alike_for_every_path_outside_the_roots(tiny_models, peft_adapters, tmp_path):
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    shutil.copytree(peft_adapters("llama")["attn4"], root / "attn4")
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "README.md").write_text("not an adapter")
    shutil.copytree(peft_adapters("llama")["mlp8"], outside / "mlp8")  # a real adapter, outside the roots
    os.symlink(outside / "mlp8", root / "link")  # inside by name, outside in fact
    live = LiveServer(create_app(tiny_models, lora_roots=[str(root)]))
    try:
        answers = {}
        for path in ["/etc", str(outside / "mlp8"), str(tmp_path / "missing"), str(root / "notes"),
                     str(root / "missing"), str(root / "link"), str(root / ".." / "elsewhere" / "mlp8"),
                     str(root / "attn4" / "adapter_config.json"), "bad\0path"]:
            r = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            error = r.json()["error"]
            answers[path] = (r.status_code, json.dumps({**error, "message": error["message"].replace(repr(path), "PATH")}))
        assert len(set(answers.values())) == 1, answers
        status, text = next(iter(answers.values()))
        assert status == 400 and json.loads(text)["code"] == "adapter_not_found"
        r = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(root / "attn4")})
        assert r.status_code == 200, r.text
        done = httpx.post(live.url + "/v1/completions", json={"model": "mine", "prompt": "hi", "max_tokens": 3})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3, done.text
    finally:
        live.stop()


def test_serve_checks_access_flags_and_warns_beyond_loopback(tiny_package, tmp_path):
    assert access_warnings("127.0.0.1", ApiKeys([]), None) == []
    assert access_warnings("0.0.0.0", ApiKeys.load(ALICE), None) == []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    pkg = str(tiny_package("llama"))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "runtime", "serve", pkg, *args], capture_output=True, text=True,
                              env=env, cwd=str(ROOT), timeout=120)

    refused = cli("--lora-root", str(tmp_path))
    assert refused.returncode == 1 and "--allow-runtime-lora-updating" in refused.stderr
    refused = cli("--allow-runtime-lora-updating")
    assert refused.returncode == 1 and "--lora-root" in refused.stderr
    refused = cli("--api-key-file", str(tmp_path / "none.json"))
    assert refused.returncode == 1 and "cannot read" in refused.stderr
    server = subprocess.Popen([sys.executable, "-m", "runtime", "serve", pkg, "--host", "0.0.0.0", "--port", "0",
                               "--allow-runtime-lora-updating", "--lora-root", str(tmp_path)],
                              stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    try:
        deadline, seen = time.time() + 120, ""
        while "warning:" not in seen:
            assert time.time() < deadline and server.poll() is None, seen
            seen += server.stderr.readline()
        assert "serving on 0.0.0.0 with no API key" in seen and "--lora-root" in seen
    finally:
        server.terminate()
        server.wait(timeout=30)
