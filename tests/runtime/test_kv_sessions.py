"""Saved KV sessions: a conversation's K/V written to a file and read back into a new engine's prefix cache
(llama.cpp's slot save and restore), giving the live engine's tokens without prefilling the saved part."""

from __future__ import annotations

import httpx
import pytest

from runtime.core.engine import Engine
from runtime.core.kv_blocks import BlockAllocator
from runtime.core.sampling import SamplingParams
from runtime.errors import RequestError
from runtime.formats import kv_session
from runtime.serve.server import create_app, load_models
from tests.runtime.test_server import LiveServer

DOCUMENT = " ".join(f"Section {i}: the river meets the stone bridge near the old mill at dawn." for i in range(12))


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def answer(engine: Engine, prompt) -> tuple[list[int], int]:
    outs = list(engine.generate(prompt, greedy()))
    return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_a_restored_session_gives_the_live_tokens_from_the_cache(tiny_package, tmp_path, kv_dtype):
    pkg = tiny_package("llama")
    live = Engine.from_package(pkg, kv_dtype=kv_dtype)
    tokens, cached = answer(live, DOCUMENT)
    assert cached == 0
    saved = live.save_session(tmp_path / "doc.bin")
    prompt_len = len(live.encode_prompt(DOCUMENT))
    assert saved["tokens"] >= prompt_len - 2 * live.block_size and saved["tokens"] % live.block_size == 0

    fresh = Engine.from_package(pkg, kv_dtype=kv_dtype)  # a restart: nothing cached
    restored = fresh.restore_session(tmp_path / "doc.bin")
    assert restored["tokens"] == restored["restored"] == saved["tokens"]
    again, cached = answer(fresh, DOCUMENT)
    assert again == tokens
    assert cached >= min(saved["tokens"], prompt_len - 1) - live.block_size  # the saved prompt came from the file
    assert fresh.restore_session(tmp_path / "doc.bin")["restored"] == 0  # cached already: nothing written twice
    # the restored session is the engine's slot now: saved again, it is the same file's content
    fresh.save_session(tmp_path / "again.bin")
    assert kv_session.read_header(tmp_path / "again.bin")[0]["sha256"] == kv_session.read_header(tmp_path / "doc.bin")[0]["sha256"]


def test_a_session_is_refused_by_another_pool_or_package_and_when_damaged(tiny_package, tmp_path):
    live = Engine.from_package(tiny_package("llama"))
    answer(live, DOCUMENT)
    live.save_session(tmp_path / "doc.bin")
    with pytest.raises(RequestError, match="kv_dtype"):
        Engine.from_package(tiny_package("llama"), kv_dtype="int8").restore_session(tmp_path / "doc.bin")
    with pytest.raises(RequestError, match="'tiny-qwen2'.*package, weights"):
        Engine.from_package(tiny_package("qwen2")).restore_session(tmp_path / "doc.bin")
    raw = bytearray((tmp_path / "doc.bin").read_bytes())
    raw[-5] ^= 0xFF
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    fresh = Engine.from_package(tiny_package("llama"))
    with pytest.raises(RequestError, match="damaged"):
        fresh.restore_session(tmp_path / "bad.bin")
    (tmp_path / "text.bin").write_text("hello")
    with pytest.raises(RequestError, match="not a saved KV session"):
        fresh.restore_session(tmp_path / "text.bin")
    assert fresh.scheduler.allocator.num_cached == 0  # nothing half-restored
    assert answer(fresh, DOCUMENT)[1] == 0


def test_restoring_evicts_only_blocks_nobody_holds():
    """park_blocks on a full pool: unheld cached blocks go (least recently used first), a running sequence's
    and the session's own already cached blocks stay."""
    from runtime.core.config import EngineConfig
    from runtime.core.scheduler import Scheduler

    sched = Scheduler(EngineConfig(), num_blocks=6, block_size=4, max_context=64, vocab_size=100)
    alloc: BlockAllocator = sched.allocator
    running = alloc.allocate()  # a running sequence's block
    session = list(range(16))  # four blocks
    first = sched.park_blocks(session[:4])  # its first block, cached before
    other = sched.park_blocks([90, 91, 92, 93])  # someone else's cached block
    assert len(first) == len(other) == 1 and alloc.num_free == 5
    parked = sched.park_blocks(session)
    assert [j for j, _ in parked] == [1, 2, 3]
    assert running not in {b for _, b in parked} and alloc.refcount[running] == 1
    assert [b for _, b in sched.cached_run(session)][0] == first[0][1]  # kept: the chain is whole
    assert len(sched.cached_run(session)) == 4
    assert len(sched.cached_run([90, 91, 92, 93])) == 1  # free blocks were left: nothing evicted
    fuller = sched.park_blocks(list(range(100, 140)))  # ten blocks into five: stops, never evicts its own
    assert len(fuller) == 5 and len(sched.cached_run(list(range(100, 140)))) == 5 and alloc.refcount[running] == 1
    assert sched.cached_run(session) == []  # nobody held them


def test_the_server_saves_a_slot_and_a_restarted_one_restores_it(tiny_package, tmp_path):
    pkg = str(tiny_package("llama"))
    chat = {"messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Where is the mill?"}],
            "max_tokens": 8, "temperature": 0, "return_token_ids": True}

    def serve(**options):
        models = load_models([pkg], "cpu", 8, {})
        server = LiveServer(create_app(models, **options))
        return server, {**chat, "model": next(iter(models))}

    server, body = serve(slot_save_path=str(tmp_path / "slots"))
    try:
        first = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert httpx.get(server.url + "/slots").json()[0]["n_tokens"] > first["usage"]["prompt_tokens"]
        saved = httpx.post(server.url + "/slots/0?action=save", json={"filename": "doc.bin"}).json()
        assert saved["n_saved"] > 0 and saved["n_written"] > 0 and (tmp_path / "slots" / "doc.bin").is_file()
        for url, payload, param in (("/slots/0?action=save", {"filename": "../escape.bin"}, "filename"),
                                    ("/slots/1?action=save", {"filename": "a.bin"}, "id_slot"),
                                    ("/slots/0?action=load", {"filename": "a.bin"}, "action"),
                                    ("/slots/0?action=restore", {"filename": "missing.bin"}, "filename")):
            r = httpx.post(server.url + url, json=payload)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert not (tmp_path / "escape.bin").exists()
    finally:
        server.stop()

    server, body = serve(slot_save_path=str(tmp_path / "slots"))  # a restart
    try:
        restored = httpx.post(server.url + "/slots/0?action=restore", json={"filename": "doc.bin"}).json()
        assert restored["n_restored"] == saved["n_saved"]
        again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 2 * 16 and cached > 0
        assert httpx.post(server.url + "/slots/0?action=erase").json()["n_erased"] > 0
    finally:
        server.stop()

    server, _ = serve()  # no --slot-save-path: no slot routes
    try:
        assert httpx.post(server.url + "/slots/0?action=save", json={"filename": "x.bin"}).status_code == 404
    finally:
        server.stop()
