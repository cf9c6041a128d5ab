"""The scheduler alone, with no model: budgets, chunked prefill, preemption, fairness, prefix hits, abort.

Each test plays the engine's part by hand: schedule, pretend the step ran (append a token to every
sequence whose chunk wanted logits), update.
"""

from __future__ import annotations

from runtime.core.config import EngineConfig
from runtime.core.sampling import SamplingParams
from runtime.core.scheduler import Scheduler
from runtime.core.sequence import Sequence

BS = 4


def make(num_blocks: int = 64, **cfg) -> Scheduler:
    cfg.setdefault("speculative_tokens", 0)
    return Scheduler(EngineConfig(**cfg), num_blocks, BS, max_context=256, vocab_size=100)


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   tokens=list(prompt))
    s.add(seq)
    return seq


def run_step(s: Scheduler, token: int = 7, finish: set[str] = frozenset()):
    """One step as the engine runs it: every chunk that wanted logits gets `token`; returns the output."""
    out = s.schedule()
    if out is None:
        return None
    for (seq, n), chunk in zip(out.scheduled, out.chunks):
        if chunk.want_logits:
            seq.tokens.append(token)
        s.update(seq, n, 0, seq.id in finish)
    return out


def check_blocks(s: Scheduler) -> None:
    """Every running sequence holds blocks for its computed tokens, no block twice unless shared by
    the prefix cache, and the allocator's counts add up."""
    held: dict[int, int] = {}
    for seq in s.running:
        assert len(seq.blocks) * BS >= seq.num_computed
        for b in seq.blocks:
            held[b] = held.get(b, 0) + 1
    for b, n in held.items():
        assert s.allocator.refcount[b] == n
    assert s.allocator.num_used == len(held)


def test_token_budget_splits_a_long_prompt_into_chunks():
    s = make(max_batch_tokens=16)
    seq = add(s, "a", list(range(40)))
    sizes = []
    while seq.num_computed < 40:
        out = run_step(s)
        sizes.append(out.scheduled[0][1])
        assert out.chunks[0].want_logits == (seq.num_computed == 40)
        check_blocks(s)
    assert sizes == [16, 16, 8]
    assert seq.num_generated == 1  # only the last chunk asked for logits


def test_decodes_come_before_new_prompts_and_share_the_budget():
    s = make(max_batch_tokens=10)
    a = add(s, "a", list(range(6)))
    run_step(s)  # a's prompt
    add(s, "b", list(range(30, 50)))
    out = run_step(s)
    assert [(seq.id, n) for seq, n in out.scheduled] == [("a", 1), ("b", 9)]  # a's decode first, b fills the rest
    assert out.chunks[0].tokens == [a.tokens[-2]] and out.chunks[0].start == 6


def test_on_a_backend_that_pads_rows_rows_times_the_longest_chunk_stays_within_the_budget():
    """The graph's own attention computes every row over the step's longest chunk: 8 decoding streams and a
    new 60-token prompt must not make a step of 9 x 60 padded tokens (on a real pool, gigabytes of scores).
    Each row's chunk is capped at the budget over the rows; the prompt still gets all its tokens, in order."""
    padded = Scheduler(EngineConfig(max_batch_tokens=32, speculative_tokens=0), 256, BS, max_context=256,
                       vocab_size=100, pads_rows=True)
    plain = make(256, max_batch_tokens=32)
    for s in (padded, plain):
        for i in range(8):
            add(s, f"d{i}", [1, 2, 3], max_tokens=64)
        run_step(s)  # the eight prompts (3 tokens each: within either budget)
        add(s, "long", list(range(10, 70)), max_tokens=4)
    longest = {}
    for name, s in (("padded", padded), ("plain", plain)):
        seq, steps = s.seqs["long"], []
        while seq.num_computed < 60:
            out = run_step(s)
            rows = len(out.scheduled)
            steps.append(rows * max(n for _, n in out.scheduled))
        longest[name] = max(steps)
        assert seq.tokens[:60] == list(range(10, 70))
        check_blocks(s)
    assert longest["padded"] <= 32  # 9 rows x 3 tokens at most
    assert longest["plain"] > 32  # without the cap a step pads 9 rows to the prompt's 24-token chunk


def test_chunk_carries_block_table_and_kv_slots():
    s = make()
    add(s, "a", list(range(10)))
    out = s.schedule()
    chunk = out.chunks[0]
    blocks = out.scheduled[0][0].blocks
    assert len(chunk.block_table) == 3 and chunk.block_table == blocks
    assert chunk.kv_slots == [blocks[t // BS] * BS + t % BS for t in range(10)]


def test_max_num_seqs_caps_running_and_waiting_ones_get_in_fcfs():
    s = make(max_num_seqs=2)
    for i in range(4):
        add(s, f"r{i}", [i + 1] * 3, max_tokens=2)
    out = run_step(s)
    assert [seq.id for seq, _ in out.scheduled] == ["r0", "r1"]
    finished = set()
    while s.has_unfinished():
        out = run_step(s, finish={seq.id for seq in s.running if seq.num_generated >= 1})
        finished |= {seq.id for seq, _ in out.scheduled}
        assert len(s.running) <= 2
    assert finished == {"r0", "r1", "r2", "r3"}
    assert s.allocator.num_used == 0


def test_preemption_frees_the_newest_and_it_recomputes_later():
    s = make(num_blocks=6, max_batch_tokens=64, enable_prefix_cache=False)
    a = add(s, "a", list(range(8)), max_tokens=50)  # 2 blocks, grows
    b = add(s, "b", list(range(20, 28)), max_tokens=50)
    run_step(s)
    assert {seq.id for seq in s.running} == {"a", "b"}
    preempted = False
    for _ in range(12):
        run_step(s)
        check_blocks(s)
        if b in s.waiting:
            preempted = True
            assert b.num_computed == 0 and b.blocks == []  # its KV is gone, its tokens are not
            break
    assert preempted and s.stats.preemptions == 1
    s.finish(a)
    out = s.schedule()
    (seq, n), = out.scheduled
    assert seq is b and n == len(b.tokens)  # prompt + generated, recomputed in one chunk


def test_prefix_cache_hit_skips_cached_blocks_and_shares_them():
    s = make()
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    a = add(s, "a", prompt)
    run_step(s)
    b = add(s, "b", prompt)
    out = s.schedule()
    (seq, n), = [x for x in out.scheduled if x[0] is b]
    assert b.cached_tokens == 12 and n == 1  # only the last token is computed
    assert b.blocks[:3] == a.blocks[:3]
    assert s.allocator.stats.hits == 3


def test_a_pool_reading_the_block_before_a_querys_own_exact_shares_only_blocks_below_floors():
    """exact_blocks 2 (a two-tier int8 pool, kv_tails.TAIL_BLOCKS): each chunk carries its sequence's floor
    (kv_blocks.exact_floor), a sequence registers only the blocks up to its floor's, and a hit ends at
    the new sequence's floor, so no cached block (whose tail is gone) is read exact."""
    from runtime.core.kv_blocks import exact_floor

    s = Scheduler(EngineConfig(speculative_tokens=0), 64, BS, max_context=256, vocab_size=100, exact_blocks=2)
    prompt = list(range(1, 23))  # 5 full blocks + 2 tokens: floor 16 (the block before the last token's)
    a = add(s, "a", prompt, max_tokens=12)
    out = run_step(s)
    assert exact_floor(len(prompt), BS) == 16 and out.chunks[0].exact_from == 16
    while a.num_generated < 12:
        out = run_step(s)
        assert out.chunks[0].exact_from == 16  # decodes too: the floor is the prompt's
    assert len(a.block_keys) == 5  # blocks 0..4: block 4 is computed reading its own block alone
    longer = add(s, "b", prompt + a.tokens[len(prompt):] + [9] * 10)  # the next turn of a chat
    out = s.schedule()
    assert longer.cached_tokens == 20 and out.chunks[-1].exact_from == exact_floor(len(longer.prompt_ids), BS)
    again = add(s, "c", prompt)  # the same prompt: hits end at its own floor, not at its last full block
    out = s.schedule()
    assert again.cached_tokens == 16 and out.chunks[-1].exact_from == 16
    plain = make()  # one exact block: every full block before the last token is shared
    add(plain, "a", prompt)
    run_step(plain)
    again = add(plain, "b", prompt)
    plain.schedule()
    assert again.cached_tokens == 20


def test_prefix_keys_depend_on_the_adapter():
    s = make()
    prompt = list(range(1, 14))
    add(s, "a", prompt)
    run_step(s)
    other = Sequence("b", list(prompt), SamplingParams(max_tokens=4, temperature=0.0), tokens=list(prompt),
                     adapter="sql")
    s.add(other)
    s.schedule()
    assert other.cached_tokens == 0


def test_waiting_prompt_defers_a_step_to_share_blocks_computed_in_this_one():
    s = make()
    prompt = list(range(1, 18))
    a = add(s, "a", prompt)
    b = add(s, "b", prompt)
    out = run_step(s)
    assert [seq for seq, _ in out.scheduled] == [a]  # b waits: a computes the blocks it would compute
    out = s.schedule()
    assert b in [seq for seq, _ in out.scheduled] and b.cached_tokens == 16


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make(max_num_seqs=1)
    add(s, "a", list(range(9)))
    add(s, "b", list(range(9)))
    run_step(s)
    assert s.allocator.num_used > 0
    assert s.abort("a") and s.abort("b") and not s.abort("c")
    assert not s.has_unfinished() and s.allocator.num_used == 0 and s.stats.aborted == 2
    assert s.schedule() is None


def test_drafts_are_scheduled_only_for_greedy_decodes_with_room():
    s = make(speculative_tokens=3)
    seq = add(s, "a", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], max_tokens=20)
    run_step(s, token=7)  # prompt ... 5 6 -> 7: lookup now predicts 8 5 6
    out = s.schedule()
    (seq_, n), = out.scheduled
    assert seq_.draft == [8, 5, 6] and n == 4
    chunk = out.chunks[0]
    assert chunk.tokens == [7, 8, 5, 6] and chunk.logits_rows == 4
    s.update(seq, 1 + 2, 2, False)  # two drafts confirmed, the third not
    assert seq.num_computed == 11 + 2 and s.stats.accepted_draft_tokens == 2


def test_a_long_prompt_does_not_stall_running_decodes_and_arrivals_keep_their_order():
    """Fairness: every running decode gets its token each step while a long prompt is chunked in the
    budget left over, and waiting requests are admitted in arrival order."""
    s = make(max_batch_tokens=8, max_num_seqs=8)
    for i in range(3):
        add(s, f"e{i}", [i + 1] * 3, max_tokens=30)
    run_step(s)
    long = add(s, "long", list(range(10, 50)), max_tokens=4)
    late = add(s, "late", [9, 9], max_tokens=4)
    admitted = []
    for _ in range(12):
        out = run_step(s)
        ids = [seq.id for seq, _ in out.scheduled]
        assert ids[:3] == ["e0", "e1", "e2"]  # the decodes, every step, first
        admitted += [i for i in ids[3:] if i not in admitted]
    assert admitted == ["long", "late"]
    assert long.num_computed >= 40 and late.num_generated >= 1


def test_xlora_sequences_get_expert_slots_and_shadow_blocks_and_give_them_back():
    """An X-LoRA sequence holds a slot per expert and, for its scaling pass, a shadow block per block;
    it fills and reads the prefix cache with both passes' blocks (the scaling pass's on a chain of its
    own, and neither shared with the base model); preemption and finishing free everything."""
    from types import SimpleNamespace

    xlora = SimpleNamespace(experts=[SimpleNamespace(id="e1"), SimpleNamespace(id="e2")])
    s = make(num_blocks=32, max_loras=2, max_batch_tokens=64)
    plain = add(s, "p", list(range(8)))
    x = add(s, "x", list(range(8)))
    x.adapter, x.xlora = "xl", xlora
    out = run_step(s)
    chunk = out.chunks[[seq for seq, _ in out.scheduled].index(x)]
    assert sorted(x.expert_slots) == [1, 2] and chunk.expert_slots == x.expert_slots
    assert len(x.shadow_blocks) == len(x.blocks) == 2 and not set(x.shadow_blocks) & set(x.blocks)
    assert chunk.shadow_table == x.shadow_blocks and len(chunk.shadow_kv_slots) == 8
    assert [k // BS for k in chunk.shadow_kv_slots] == [x.shadow_blocks[t // BS] for t in range(8)]
    assert len(x.block_keys) == len(x.shadow_keys) == len(plain.block_keys) == 2
    assert not set(x.block_keys) & set(plain.block_keys) and not set(x.shadow_keys) & set(x.block_keys)
    assert s.allocator.num_used == 2 + 2 * 2
    other = add(s, "y", list(range(8)))  # the same experts' slots are shared; a third expert would wait
    other.adapter, other.xlora = "xl", xlora
    run_step(s)
    assert set(other.expert_slots) == {1, 2} and s.slots.users[1] == 2 and other in s.running
    assert other.cached_tokens == BS  # x's first block, both passes: (8 - 1) // BS full blocks to look up
    assert other.blocks[0] == x.blocks[0] and other.shadow_blocks[0] == x.shadow_blocks[0]
    s._preempt(other)
    assert not other.shadow_blocks and not other.expert_slots and s.slots.users[1] == 1
    run_step(s)
    assert other in s.running and len(other.shadow_blocks) == len(other.blocks)
    for seq in list(s.running):
        s.finish(seq)
    assert s.slots.users == [0, 0, 0] and s.allocator.num_used == 0
    assert all(not seq.shadow_blocks and not seq.expert_slots for seq in (x, other))


def test_prompts_arriving_while_others_decode_take_at_most_long_prefill_tokens_a_step():
    """Streams that decode run every step; beside them a prompt longer than long_prefill_tokens computes that
    many a step, one such prompt a step, and a short prompt arriving meanwhile computes whole at once instead
    of queueing behind it; alone, a prompt takes the whole budget; 0 turns the cap off."""
    s = make(max_batch_tokens=64, long_prefill_tokens=8)
    add(s, "first", list(range(40)), max_tokens=100)
    assert run_step(s).scheduled[0][1] == 40  # nobody decodes yet: the whole budget
    for i in range(2):
        add(s, f"long{i}", [50 + i] * 30, max_tokens=2)
    steps = 0
    while any(q.num_computed < 30 for q in s.running if q.id.startswith("long")) or s.waiting:
        left = {q.id: len(q.tokens) - q.num_computed for q in [*s.running, *s.waiting]}
        out = run_step(s)
        plan = dict((q.id, n) for q, n in out.scheduled)
        assert plan["first"] == 1  # the stream steps every time
        prompts = {rid: n for rid, n in plan.items() if left[rid] > 1}
        assert prompts and all(n <= 8 for n in prompts.values())
        assert sum(1 for rid in prompts if left[rid] > 8) <= 1, (left, plan)  # one long prompt a step
        if steps == 1:
            add(s, "short", [60] * 6, max_tokens=2)  # arrives while long0 prefills: computed whole next step
        if "short" in left and left["short"] > 1:
            assert plan["short"] == 6 and any(rid.startswith("long") for rid in prompts), plan
        steps += 1
        check_blocks(s)
    assert steps >= 2 * 30 // 8
    off = make(max_batch_tokens=64, long_prefill_tokens=0)
    add(off, "first", list(range(40)), max_tokens=100)
    run_step(off)
    add(off, "long", [50] * 30, max_tokens=2)
    assert dict((q.id, n) for q, n in run_step(off).scheduled) == {"first": 1, "long": 30}
