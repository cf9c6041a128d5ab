"""The serving engine: continuous batching equals solo runs, prefix cache, preemption, abort, streaming."""

from __future__ import annotations

import asyncio

import pytest

from runtime.core.async_engine import AsyncEngine
from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from runtime.errors import RequestError

WORDS = ("apple river stone cloud seven orange music window paper tiger light north garden silver "
         "bridge summer castle ocean forest engine candle mirror").split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 5) % 17)) for i in range(n)]


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def solo_outputs(pkg, texts: list[str], max_tokens: int = 20) -> list[list[int]]:
    engine = Engine.from_package(pkg, enable_prefix_cache=False, max_num_seqs=1, speculative_tokens=0)  # plain greedy
    return [[t for o in engine.generate(text, greedy(max_tokens)) for t in o.token_ids] for text in texts]


def run_staggered(engine: Engine, texts: list[str], per_step: int = 3, max_tokens: int = 20) -> dict[str, list[int]]:
    """Submit a few requests per step while the batch runs; collect each request's tokens."""
    pending = list(enumerate(texts))
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(texts))}
    while pending or engine.has_unfinished():
        for _ in range(per_step):
            if pending:
                i, text = pending.pop(0)
                ids[engine.add_request(text, greedy(max_tokens))] = i
        for out in engine.step():
            tokens[ids[out.request_id]].extend(out.token_ids)
    return tokens


@pytest.fixture(scope="module")
def thirty_two(tiny_package):
    texts = prompts(32)
    return texts, solo_outputs(tiny_package("llama"), texts)


def test_32_concurrent_staggered_requests_equal_their_solo_runs(tiny_package, thirty_two):
    texts, solo = thirty_two
    engine = Engine.from_package(tiny_package("llama"), max_num_seqs=32, max_batch_tokens=128)
    got = run_staggered(engine, texts)
    for i in range(len(texts)):
        assert got[i] == solo[i], f"request {i} differs"
    assert engine.scheduler.allocator.num_used == 0  # finished requests hold nothing; their prefixes stay evictable
    assert engine.scheduler.allocator.num_cached > 0


def test_w8a8_batched_requests_equal_their_solo_runs(tiny_package):
    """w8a8 quantizes activations per row, so a request's tokens never depend on what it is batched with."""
    pkg = tiny_package("qwen2", "w8a8")
    texts = prompts(12)
    solo = solo_outputs(pkg, texts)
    got = run_staggered(Engine.from_package(pkg, max_num_seqs=12, max_batch_tokens=64), texts)
    assert [got[i] for i in range(len(texts))] == solo


def test_preemption_under_a_small_pool_keeps_outputs_exact(tiny_package, thirty_two):
    texts, solo = thirty_two
    engine = Engine.from_package(tiny_package("llama"), num_blocks=12, block_size=4, max_num_seqs=32,
                                 max_batch_tokens=64)
    got = run_staggered(engine, texts)
    assert engine.stats.preemptions > 0
    for i in range(len(texts)):
        assert got[i] == solo[i], f"request {i} differs"


def test_shared_system_prompt_hits_the_prefix_cache(tiny_package):
    pkg = tiny_package("llama")
    system = " ".join(WORDS[i % len(WORDS)] for i in range(200))
    questions = [f"question number {i}: {WORDS[i]} or {WORDS[-i - 1]}?" for i in range(6)]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    plain = Engine.from_package(pkg, enable_prefix_cache=False)
    expected = [[t for o in plain.generate(messages=m, params=greedy()) for t in o.token_ids] for m in chats]
    cached = Engine.from_package(pkg)
    outs = [list(cached.generate(messages=m, params=greedy())) for m in chats]
    assert [[t for o in out for t in o.token_ids] for out in outs] == expected
    prompt_len = outs[0][-1].prompt_tokens
    assert prompt_len > 200
    assert outs[0][-1].cached_tokens == 0
    for out in outs[1:]:  # every later request reuses the system prompt's full blocks
        assert out[-1].cached_tokens >= 200 - cached.block_size
    stats = cached.stats_snapshot()
    assert stats["prefix_cache_hits"] >= 5 * (200 // cached.block_size)
    assert stats["cached_prompt_tokens"] == sum(o[-1].cached_tokens for o in outs)
    assert stats["prompt_tokens"] + stats["cached_prompt_tokens"] == sum(o[-1].prompt_tokens for o in outs)
    # a reset forgets every prefix: the pool is all free again and the next prompt computes from scratch
    assert cached.reset_prefix_cache() == stats["prefix_cache_blocks"] > 0
    assert cached.scheduler.allocator.num_free == cached.scheduler.allocator.num_blocks and cached.scheduler.allocator.num_cached == 0
    again = list(cached.generate(messages=chats[1], params=greedy()))
    assert again[-1].cached_tokens == 0 and [t for o in again for t in o.token_ids] == expected[1]


def test_prompts_arriving_together_compute_their_shared_blocks_once(tiny_package):
    """Six chats with one 200-token system prompt submitted at once (and an unrelated prompt among them):
    the first computes the system prompt, the other five wait a step and read it from the cache; the
    unrelated prompt is not held back; every output equals its run without a prefix cache."""
    pkg = tiny_package("llama")
    system = " ".join(WORDS[i % len(WORDS)] for i in range(200))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}: {WORDS[i]}?"}]
             for i in range(6)]
    other = prompts(40)[-1]
    plain = Engine.from_package(pkg, enable_prefix_cache=False, speculative_tokens=0)
    expected = [[t for o in plain.generate(messages=m, params=greedy()) for t in o.token_ids] for m in chats]
    expected_other = [t for o in plain.generate(other, greedy()) for t in o.token_ids]
    # the whole budget for prompts while others decode: the steps below are those of an uncapped step
    engine = Engine.from_package(pkg, speculative_tokens=0, max_batch_tokens=4096, long_prefill_tokens=0)
    rids = [engine.add_request(messages=m, params=greedy()) for m in chats[:3]]
    rid_other = engine.add_request(other, greedy())
    rids += [engine.add_request(messages=m, params=greedy()) for m in chats[3:]]
    first_step = {}
    tokens: dict[str, list[int]] = {r: [] for r in [*rids, rid_other]}
    last: dict[str, object] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first_step.setdefault(out.request_id, step)
            tokens[out.request_id].extend(out.token_ids)
            last[out.request_id] = out
    assert [tokens[r] for r in rids] == expected
    assert tokens[rid_other] == expected_other
    # the unrelated prompt ran in the first step with the first chat; the other chats a step later
    assert first_step[rids[0]] == first_step[rid_other] == 1
    assert all(first_step[r] == 2 for r in rids[1:])
    block = engine.block_size
    assert last[rids[0]].cached_tokens == 0
    assert all(last[r].cached_tokens >= 200 - block for r in rids[1:])
    stats = engine.stats_snapshot()
    prompt_lens = [last[r].prompt_tokens for r in [*rids, rid_other]]
    assert stats["prompt_tokens"] + stats["cached_prompt_tokens"] == sum(prompt_lens)
    assert stats["prompt_tokens"] < sum(prompt_lens) - 5 * (200 - block)


def test_resetting_the_prefix_cache_mid_run_leaves_running_requests_whole(tiny_package, thirty_two):
    texts, solo = thirty_two
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
    rids = [engine.add_request(t, greedy()) for t in texts[:4]]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    held = engine.scheduler.allocator.num_used
    assert engine.reset_prefix_cache() > 0  # their computed prompt blocks were cached
    assert engine.scheduler.allocator.num_cached == 0 and engine.scheduler.allocator.num_used == held  # still theirs
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    assert [tokens[r] for r in rids] == solo[:4]
    assert engine.scheduler.allocator.num_used == 0  # every block back in the pool: free, or cached and evictable


def test_abort_frees_blocks_at_once_and_others_finish_unchanged(tiny_package, thirty_two):
    texts, solo = thirty_two
    engine = Engine.from_package(tiny_package("llama"), enable_prefix_cache=False)
    rids = [engine.add_request(t, greedy()) for t in texts[:4]]
    tokens = {r: [] for r in rids}
    for _ in range(5):
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    victim = rids[1]
    held = len(engine.seqs[victim].blocks)
    used = engine.scheduler.allocator.num_used
    assert engine.abort(victim)
    assert engine.scheduler.allocator.num_used == used - held
    assert victim not in engine.seqs
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != victim
            tokens[out.request_id].extend(out.token_ids)
    for i, r in enumerate(rids):
        if r != victim:
            assert tokens[r] == solo[i]
    assert engine.scheduler.allocator.num_used == 0


def test_stop_string_across_tokens_and_deltas_concatenate(tiny_package):
    engine = Engine.from_package(tiny_package("llama"))
    outs = list(engine.generate("tell me about the ocean", greedy(24)))
    deltas = [o.delta for o in outs]
    text = "".join(deltas)
    assert text == engine.tokenizer.decode([t for o in outs for t in o.token_ids])
    # a stop string made of the end of one delta and the start of the next
    k = next(i for i in range(1, len(deltas)) if len(deltas[i - 1]) >= 2 and len(deltas[i]) >= 2)
    stop = deltas[k - 1][-2:] + deltas[k][:2]
    params = greedy(24)
    params.stop = [stop]
    cut = list(engine.generate("tell me about the ocean", params))
    assert cut[-1].finish_reason == "stop"
    assert "".join(o.delta for o in cut) == text[: text.index(stop)]


def test_a_prompt_longer_than_the_step_budget_is_prefilled_over_several_steps(tiny_package):
    """Steps that only prefill (no row wants logits yet) run too, and the answer is the one-step one."""
    pkg = tiny_package("llama")
    text = " ".join(prompts(12))  # ~140 tokens
    want = solo_outputs(pkg, [text])[0]
    engine = Engine.from_package(pkg, enable_prefix_cache=False, speculative_tokens=0, max_batch_tokens=32)
    got = [t for o in engine.generate(text, greedy()) for t in o.token_ids]
    assert got == want and engine.stats_snapshot()["prompt_tokens"] > 100


def test_prompt_longer_than_context_is_refused_and_engine_keeps_serving(tiny_package):
    engine = Engine.from_package(tiny_package("llama"))
    ok = engine.add_request("hello there", greedy(5))
    with pytest.raises(RequestError, match="context is 256 tokens"):
        engine.add_request("word " * 400, greedy(5))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [ok] and done[0].completion_tokens == 5


def test_async_engine_streams_concurrently_and_cancel_aborts(tiny_package, thirty_two):
    texts, solo = thirty_two

    async def main():
        aengine = AsyncEngine(Engine.from_package(tiny_package("llama"), max_num_seqs=16))

        async def collect(text):
            return [t async for o in aengine.generate(text, greedy()) for t in o.token_ids]

        results = await asyncio.gather(*(collect(t) for t in texts[:8]))
        # a consumer that walks away mid-stream: its request is aborted and its blocks freed
        gen = aengine.generate(texts[9], greedy(200))
        async for _ in gen:
            break
        await gen.aclose()
        stats = aengine.stats()
        await aengine.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    assert results == solo[:8]
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_blocks_used"] == 0


def test_a_prompts_blocks_restored_into_a_new_engine_are_hits_with_unchanged_output(tiny_package):
    """What the page does across a reload: save the last prompt's cached blocks, restore them into a
    fresh engine (same package), whose first request then skips their prefill and answers the same."""
    pkg = tiny_package("llama")
    chat = [{"role": "system", "content": " ".join(WORDS[:60])}, {"role": "user", "content": "and then?"}]
    first = Engine.from_package(pkg)
    expected = [t for o in first.generate(messages=chat, params=greedy()) for t in o.token_ids]
    saved = first.scheduler.recent_prompt_blocks(max_blocks=8)
    prompt_len = len(first.encode_prompt(messages=chat))
    assert len(saved) == min(8, prompt_len // first.block_size) > 1

    fresh = Engine.from_package(pkg)
    for _ in range(3):  # blocks in use elsewhere: the restored ones land on other ids
        fresh.scheduler.allocator.allocate()
    blocks = fresh.scheduler.restore_prompt_blocks([key for key, _ in saved])
    assert len(blocks) == len(saved) and not set(blocks) & {0, 1, 2}
    for (_, src), dst in zip(saved, blocks):  # the backend's part: the K/V themselves
        (fk, fv), (k, v) = fresh.backend.pool.host_view(), first.backend.pool.host_view()
        fk[:, :, dst] = k[:, :, src]
        fv[:, :, dst] = v[:, :, src]
    outs = list(fresh.generate(messages=chat, params=greedy()))
    assert outs[-1].cached_tokens == len(saved) * fresh.block_size
    assert [t for o in outs for t in o.token_ids] == expected
    assert fresh.scheduler.restore_prompt_blocks([key for key, _ in saved]) == []  # already cached: nothing to restore

    wrong = Engine.from_package(pkg)  # restored keys without their K/V would be a silent corruption:
    wrong.scheduler.restore_prompt_blocks([key for key, _ in saved])  # this test must see the difference
    assert [t for o in wrong.generate(messages=chat, params=greedy()) for t in o.token_ids] != expected

    undone = Engine.from_package(pkg)  # what the page does when the K/V cannot be written after all
    undone.scheduler.forget_prompt_blocks(undone.scheduler.restore_prompt_blocks([key for key, _ in saved]))
    outs = list(undone.generate(messages=chat, params=greedy()))
    assert outs[-1].cached_tokens == 0 and [t for o in outs for t in o.token_ids] == expected


def test_the_kv_pools_device_writes_equal_the_host_writes(tiny_package):
    """The pool's device path (a ScatterND graph writing in place, what a GPU runs) gives the same tokens
    as CPU's host writes, over prompts in scattered blocks, decodes and a preemption."""
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    pkg = load_package(tiny_package("llama"))
    prompts = [[5 + i, 17, 99, 3 + i, 250, 41, 7, 8, 10 * i + 1, 12] * (1 + i % 3) for i in range(6)]
    outs = []
    for device_writes in (False, True):
        backend = NativeBackend(pkg, kv_device_writes=device_writes)
        engine = Engine(pkg, backend, num_blocks=20, block_size=4, speculative_tokens=0)
        assert backend.pool.device_writes is device_writes
        rids = [engine.add_request(p, greedy()) for p in prompts]
        got = {r: [] for r in rids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
        outs.append([got[r] for r in rids])
        assert engine.stats.preemptions > 0
    assert outs[0] == outs[1]


def test_the_kv_pools_memory_grows_with_the_blocks_in_use(tiny_package):
    """The native CPU pool commits (zeroes) its memory ahead of use, doubling from 16 blocks, not the whole
    budget at start; a long prompt grows it, and the output equals a pool committed whole from the start."""
    pkg = tiny_package("llama")
    engine = Engine.from_package(pkg, num_blocks=256, block_size=4)
    pool = engine.backend.pool
    assert pool.committed == 16 and pool.committed_bytes == 2 * pool.num_layers * pool.layer_bytes * 16 // 256
    short = [t for o in engine.generate("one two three", greedy()) for t in o.token_ids]
    assert pool.committed == 16
    prompt = " ".join(WORDS * 4)  # ~90 tokens: over 16 blocks of 4
    grown = [t for o in engine.generate(prompt, greedy()) for t in o.token_ids]
    assert 16 < pool.committed < 256
    whole = Engine.from_package(pkg, num_blocks=256, block_size=4)
    whole.backend.pool.host_view()  # commits every block
    assert whole.backend.pool.committed == 256
    assert [t for o in whole.generate("one two three", greedy()) for t in o.token_ids] == short
    assert [t for o in whole.generate(prompt, greedy()) for t in o.token_ids] == grown
