"""Speculative decoding by prompt lookup: drafts are verified exactly, so outputs never change."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.sampling import SamplingParams
from runtime.speculative import PromptLookup
from tests.runtime.test_engine import greedy, prompts, run_staggered, solo_outputs


def test_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    look = PromptLookup(1, 3)
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    assert look.draft(tokens, 2) == [9, 2]  # the tail 5 6 7 last came before 9 2, not before 8
    assert look.draft(tokens + [9], 3) == [2, 5, 6]  # incremental: same as indexing from scratch
    assert PromptLookup(1, 3).draft(tokens + [9], 3) == [2, 5, 6]
    assert look.draft([1, 2, 3], 4) == []  # a tail only matches earlier text, never itself
    assert PromptLookup(1, 3).draft([4, 1, 2, 3, 9, 4], 5) == [1, 2]  # a 1-token match drafts at most 2
    assert PromptLookup(2, 2).draft([4, 1, 2, 9, 3, 2], 2) == []  # "3 2" never occurred before
    with pytest.raises(ValueError):
        PromptLookup(3, 2)


@pytest.fixture(scope="module")
def texts_and_solo(tiny_package):
    # repeated phrases give the lookup something to find; a random tiny model also loops by itself
    texts = [t + " . " + t for t in prompts(12)]
    return texts, solo_outputs(tiny_package("llama"), texts, max_tokens=24)


@pytest.mark.parametrize("num_blocks", [None, 24])  # 24 blocks of 16 force preemption under 12 requests
def test_speculative_outputs_equal_plain_greedy_and_drafts_are_accepted(tiny_package, texts_and_solo, num_blocks):
    texts, solo = texts_and_solo
    engine = Engine.from_package(tiny_package("llama"), max_num_seqs=12, max_batch_tokens=96,
                                 num_blocks=num_blocks, speculative_tokens=3, speculative_max_batch=12)
    got = run_staggered(engine, texts, max_tokens=24)
    for i in range(len(texts)):
        assert got[i] == solo[i], f"request {i} differs"
    stats = engine.stats_snapshot()
    assert stats["accepted_draft_tokens"] > 0
    assert stats["steps"] < stats["generated_tokens"]  # verified drafts saved steps
    assert engine.allocator.num_used == 0
    if num_blocks:
        assert stats["preemptions"] > 0


def test_limits_hold_and_only_greedy_unpenalized_requests_draft(tiny_package, texts_and_solo):
    texts, solo = texts_and_solo
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=4)  # one request: under the batch cap
    outs = list(engine.generate(texts[0], greedy(5)))
    assert [t for o in outs for t in o.token_ids] == solo[0][:5]  # max_tokens is exact even mid-draft
    assert outs[-1].finished and outs[-1].completion_tokens == 5 and outs[-1].finish_reason == "length"

    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=4)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)
    for params in (sampled, penalized):
        plain = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
        want = [t for o in plain.generate(texts[1], params) for t in o.token_ids]
        assert [t for o in engine.generate(texts[1], params) for t in o.token_ids] == want
    assert engine.stats_snapshot()["draft_tokens"] == 0


def test_drafting_stops_above_the_batch_cap(tiny_package, texts_and_solo):
    texts, solo = texts_and_solo
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=3, speculative_max_batch=2)
    got = run_staggered(engine, texts[:3], per_step=3, max_tokens=24)  # three at once: above the cap
    assert [got[i] for i in range(3)] == solo[:3]
    assert engine.stats_snapshot()["draft_tokens"] == 0
