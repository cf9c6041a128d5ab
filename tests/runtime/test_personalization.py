"""Per-user adaptation as served (runtime/serve/personalization.py, feedback_api.py): real HTTP on loopback,
the tiny llama package, each user's adapter learned from their feedback and served to them alone."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from runtime.serve.api_keys import ApiKeys
from runtime.serve.personalization import ADAPTER_PREFIX, PersonalSettings, user_digest
from runtime.serve.server import create_app, load_models
from tests.conftest import run_cli
from tests.runtime.test_server import LiveServer

ALICE_KEY, BOB_KEY = "sk-team-a-0123456789", "sk-team-b-9876543210"
SETTINGS = PersonalSettings(targets=("q_proj", "v_proj", "down_proj"), rank=2, lr=0.3, epochs=2,
                            reference_tokens=24, consolidate_every=2)
PHRASE = "the quick brown fox jumps over the lazy dog near the quiet river bank "


@pytest.fixture
def personalized(tiny_package, tmp_path, monkeypatch):
    models = load_models([str(tiny_package("llama"))], "cpu", 8, {"speculative_tokens": 0}, personalize=SETTINGS,
                         state_dir=str(tmp_path / "users"))
    keys = ApiKeys.load(path=_key_file(tmp_path))
    live = LiveServer(create_app(models, keys=keys))
    live.model = next(iter(models))
    yield live
    live.stop()


def _key_file(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "team-a", "key": ALICE_KEY}, {"name": "team-b", "key": BOB_KEY}]}))
    return str(path)


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def greedy(http, model: str, key: str, user: str | None, prompt: str = "the quick brown") -> tuple[str, list]:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, **({"user": user} if user else {})}
    r = http.post("/v1/completions", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_feedback_teaches_one_user_and_leaves_every_other_bit_identical(personalized):
    live, model = personalized, personalized.model
    with httpx.Client(base_url=live.url, timeout=300) as http:
        base = greedy(http, model, ALICE_KEY, None)
        assert greedy(http, model, ALICE_KEY, "alice") == base  # nothing learned yet: the base model
        card = http.get("/v1/models", headers=_auth(ALICE_KEY)).json()["data"][0]
        assert card["personalization"]["enabled"] and card["personalization"]["users"] == 0
        versions = []
        for _ in range(3):
            r = http.post("/v1/feedback", json={"user": "alice", "text": PHRASE * 4}, headers=_auth(ALICE_KEY))
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["kind"] == "text" and out["steps"] >= 2 and out["tokens"] > 40
            versions.append(out["version"])
        # two steps a feedback, the Fisher measured again every second step: before each feedback's first
        assert versions == [1, 2, 3] and out["consolidated"] is True and out["feedbacks"] == 3
        assert out["losses"][-1] < out["losses"][0]
        learned = greedy(http, model, ALICE_KEY, "alice")
        assert learned != base
        assert greedy(http, model, ALICE_KEY, "bob") == base  # another user of the same key
        assert greedy(http, model, BOB_KEY, "alice") == base  # another key's "alice" is another user
        assert greedy(http, model, ALICE_KEY, None) == base
        state = http.get("/v1/users/alice", headers=_auth(ALICE_KEY)).json()
        assert state["version"] == 3 and state["feedbacks"] == 3
        assert http.get("/v1/users/alice", headers=_auth(BOB_KEY)).status_code == 404
        # a user's adapter is theirs: it is neither listed nor named as a model
        cards = http.get("/v1/models", headers=_auth(ALICE_KEY)).json()["data"]
        assert [c["id"] for c in cards] == [model] and cards[0]["personalization"]["users"] == 1
        hidden = ADAPTER_PREFIX + user_digest("team-a", "alice")
        r = http.post("/v1/completions", json={"model": hidden, "prompt": "x", "max_tokens": 2}, headers=_auth(BOB_KEY))
        assert r.status_code == 404
        # another key cannot reset alice; alice's key can, and she is the base model again
        assert http.delete("/v1/users/alice", headers=_auth(BOB_KEY)).json()["deleted"] is False
        assert greedy(http, model, ALICE_KEY, "alice") == learned
        assert http.delete("/v1/users/alice", headers=_auth(ALICE_KEY)).json()["deleted"] is True
        assert greedy(http, model, ALICE_KEY, "alice") == base
        assert http.get("/v1/users/alice", headers=_auth(ALICE_KEY)).status_code == 404
        # she starts again from nothing (numbered past the versions still retiring)
        r = http.post("/v1/feedback", json={"user": "alice", "text": PHRASE * 4}, headers=_auth(ALICE_KEY))
        assert r.status_code == 200 and r.json()["version"] == 4 and r.json()["feedbacks"] == 1
        assert greedy(http, model, ALICE_KEY, "alice") != base


@pytest.mark.parametrize("body,param", [
    ({"text": "hello there"}, "user"),
    ({"user": "", "text": "hello"}, "user"),
    ({"user": "a" * 257, "text": "hello"}, "user"),
    ({"user": "a", "text": "hello", "preferred": "x", "messages": [{"role": "user", "content": "q"}]}, "preferred"),
    ({"user": "a"}, "text"),
    ({"user": "a", "text": "   "}, "text"),
    ({"user": "a", "text": "hi", "messages": [{"role": "user", "content": "q"}]}, "messages"),
    ({"user": "a", "rating": 2, "completion": "x", "messages": [{"role": "user", "content": "q"}]}, "rating"),
    ({"user": "a", "rating": True, "completion": "x", "messages": [{"role": "user", "content": "q"}]}, "rating"),
    ({"user": "a", "rating": 1, "messages": [{"role": "user", "content": "q"}]}, "completion"),
    ({"user": "a", "preferred": "x"}, "messages"),
    ({"user": "a", "preferred": "x", "messages": [{"role": "robot", "content": "q"}]}, "messages[0].role"),
    ({"user": "a", "text": "hi", "temperature": 1}, "temperature"),
    ({"user": "a", "text": "hi", "model": "nope"}, "model"),
])
def test_bad_feedback_is_refused_naming_the_field_and_learns_nothing(personalized, body, param):
    with httpx.Client(base_url=personalized.url, timeout=60) as http:
        r = http.post("/v1/feedback", json=body, headers=_auth(ALICE_KEY))
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
        assert http.get("/v1/models", headers=_auth(ALICE_KEY)).json()["data"][0]["personalization"]["users"] == 0
        r = http.post("/v1/feedback", content=b"{not json", headers=_auth(ALICE_KEY))
        assert r.status_code == 400


def test_feedback_routes_are_absent_without_personalize(tiny_package):
    models = load_models([str(tiny_package("llama"))], "cpu", 4, {})
    live = LiveServer(create_app(models))
    try:
        r = httpx.post(live.url + "/v1/feedback", json={"user": "a", "text": "hello"})
        assert r.status_code == 404
        card = httpx.get(live.url + "/v1/models").json()["data"][0]
        assert card["personalization"] == {"enabled": False}
        # `user` stays accepted and changes nothing
        body = {"model": card["id"], "prompt": "hi", "max_tokens": 4, "temperature": 0}
        assert httpx.post(live.url + "/v1/completions", json={**body, "user": "alice"}).json()["choices"][0]["text"] == \
            httpx.post(live.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    finally:
        live.stop()


def test_a_rating_moves_the_answer_the_way_it_says(tiny_package, tmp_path):
    """+1 makes the rated answer likelier for that user, -1 (the unlikelihood loss) less likely; a
    preferred answer is learned as the reply to its conversation."""
    from runtime.backends.lora_gradients import loss_and_grads
    from runtime.core.engine import Engine
    from runtime.serve.personalization import LocalUser, tokenize_feedback

    engine = Engine.from_package(tiny_package("llama"))
    settings = PersonalSettings(rank=2, lr=0.2, ewc=0.0)
    messages = [{"role": "user", "content": "Name a colour."}]
    results = {}
    for name, what in (("up", {"kind": "rating", "rating": 1.0}), ("down", {"kind": "rating", "rating": -1.0}),
                       ("preferred", {"kind": "preferred"})):
        me = LocalUser(engine, name, settings, tmp_path / "users")
        what = {**what, "messages": messages, "answer": "Blue, like the sea on a clear day."}
        fb = tokenize_feedback(engine.prompts, what)
        assert fb.scored_from > 0 and len(fb.ids) > fb.scored_from
        trainer = me.personal._trainer(user_digest("local", name))
        before = loss_and_grads(trainer.dec, fb.ids, trainer.lora, backward=False, scored_from=fb.scored_from)[0]
        out = me.learn(what)
        assert out["version"] == 1 and out["steps"] == settings.epochs  # an answer whole, each pass
        trainer = me.personal._trainer(user_digest("local", name))
        results[name] = loss_and_grads(trainer.dec, fb.ids, trainer.lora, backward=False,
                                       scored_from=fb.scored_from)[0] - before
    assert results["up"] < 0 and results["preferred"] < 0 and results["down"] > 0, results
    # a rating of 0 is recorded and teaches nothing
    me = LocalUser(engine, "neutral", settings, tmp_path / "users")
    out = me.learn({"kind": "rating", "rating": 0.0, "messages": messages, "answer": "Blue."})
    assert out["steps"] == 0 and out["version"] == 0 and me.adapter is None


def test_a_users_state_resumes_from_disk_where_it_stopped(tiny_package, tmp_path):
    """A second server (or chat) on the same state folder serves the user's last version, and its next
    step continues from the stored Adam moments and Fisher (the same factors as one long run)."""
    from runtime.core.engine import Engine
    from runtime.serve.personalization import LocalUser

    settings = PersonalSettings(rank=2, lr=0.2, reference_tokens=16, consolidate_every=1)
    text = PHRASE * 3
    one = LocalUser(Engine.from_package(tiny_package("llama")), "carol", settings, tmp_path / "a")
    for _ in range(2):
        one.learn({"kind": "text", "text": text})
    first = LocalUser(Engine.from_package(tiny_package("llama")), "carol", settings, tmp_path / "b")
    first.learn({"kind": "text", "text": text})
    again = LocalUser(Engine.from_package(tiny_package("llama")), "carol", settings, tmp_path / "b")
    assert again.adapter is not None  # served from disk before it learns anything here
    again.learn({"kind": "text", "text": text})
    a = one.personal._trainer(user_digest("local", "carol")).lora.factors
    b = again.personal._trainer(user_digest("local", "carol")).lora.factors
    for key in a:
        for x, y in zip(a[key], b[key]):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_a_users_state_from_other_settings_is_refused_and_kept(tiny_package, tmp_path):
    """A server restarted with other settings (every layer now) refuses the user's stored trainer with a
    request error saying why, rather than resuming part of it; the stored state is left as it was."""
    from runtime.core.engine import Engine
    from runtime.errors import RequestError
    from runtime.serve.personalization import LocalUser

    engine = Engine.from_package(tiny_package("llama"))
    first = LocalUser(engine, "dave", PersonalSettings(rank=2, ewc=0.0), tmp_path)
    first.learn({"kind": "text", "text": PHRASE * 3})
    state = tmp_path / first.personal.root.name / user_digest("local", "dave") / "trainer.safetensors"
    before = state.read_bytes()
    again = LocalUser(engine, "dave", PersonalSettings(rank=2, ewc=0.0, top_layers=1.0), tmp_path)
    with pytest.raises(RequestError, match="other personalization settings.*reset the user"):
        again.learn({"kind": "text", "text": PHRASE})
    assert state.read_bytes() == before


def test_a_forgotten_users_folder_goes_at_the_next_start_and_a_new_users_stays(tiny_package, tmp_path):
    """A process starting on a state folder deletes what a forgotten user left, and nothing else: a folder
    with no user.json yet may be a new user's first feedback, written by another process right then."""
    from runtime.core.engine import Engine
    from runtime.serve.personalization import FORGOTTEN, LocalUser

    settings = PersonalSettings(rank=2, lr=0.2, reference_tokens=16)
    engine = Engine.from_package(tiny_package("llama"))
    erin = LocalUser(engine, "erin", settings, tmp_path / "users")
    erin.learn({"kind": "text", "text": PHRASE * 2})
    root = erin.personal.root
    gone, arriving = root / user_digest("local", "erin"), root / user_digest("local", "fay")
    (arriving / "v000001").mkdir(parents=True)  # another process's new user, its user.json not yet written
    assert erin.forget() and (gone / FORGOTTEN).exists() and not (gone / "user.json").exists()
    LocalUser(engine, "gil", settings, tmp_path / "users")  # a process starting on the folder
    assert not gone.exists() and (arriving / "v000001").is_dir()
    erin.learn({"kind": "text", "text": PHRASE})  # erin again, in the process that forgot her: kept
    assert not (gone / FORGOTTEN).exists() and (gone / "user.json").exists()
    LocalUser(engine, "gil", settings, tmp_path / "users")
    assert (gone / "user.json").exists()


@pytest.mark.slow
def test_chat_user_learns_and_info_and_exporter_see_it(tiny_package, tmp_path):
    pkg = str(tiny_package("llama"))
    state = str(tmp_path / "users")
    proc = subprocess.run([sys.executable, "-m", "runtime", "chat", pkg, "--user", "dana", "--state-dir", state,
                           "--max-tokens", "6", "--temperature", "0", "--personalize-rank", "2"],
                          input="I write about rivers and the quiet banks beside them.\n/good\n/exit\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "learned from your message: version 1" in proc.stderr and "(learned: version 2" in proc.stdout
    info = json.loads(run_cli("info", pkg, "--state-dir", state, "--json").stdout)
    assert info["personalization"]["users"] == 1 and info["personalization"]["feedbacks"] == 2
    out = tmp_path / "dana-peft"
    proc = run_cli("adapter", "--user", "dana", "--state-dir", state, "--base", pkg, "-o", str(out), module="exporter")
    assert proc.returncode == 0, proc.stderr
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(str(out))
    assert config.r == 2 and set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"}


def test_a_base_model_without_a_chat_template_gets_a_reference_text_too(tiny_package):
    """EWC++'s reference is the model's answer to the server's question; a base model (no chat template,
    as Gemma 3 270M's GGUF) continues the question's words instead of failing the first feedback."""
    from runtime.package import load_package
    from runtime.serve.personalization import REFERENCE_MESSAGES, reference_prompt
    from runtime.text.prompt import PromptEncoder, package_tokenizer

    pkg = load_package(tiny_package("llama"))
    tok = package_tokenizer(pkg)
    chat = PromptEncoder.from_package(pkg, pkg.config["vocab_size"], 256)
    base = PromptEncoder(tok, None, pkg.config["vocab_size"], 256)
    assert chat.chat_template is not None and reference_prompt(chat) == chat.encode(None, REFERENCE_MESSAGES)
    assert reference_prompt(base) == tok.encode(REFERENCE_MESSAGES[-1]["content"] + "\n")
