"""Speculative decoding by prompt lookup: drafts are verified exactly, so outputs never change."""

from __future__ import annotations

import pytest

from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from runtime.core.speculative import PromptLookup
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
    assert engine.scheduler.allocator.num_used == 0
    if num_blocks:
        assert stats["preemptions"] > 0


def test_max_tokens_is_exact_even_in_the_middle_of_a_draft(tiny_package, texts_and_solo):
    texts, solo = texts_and_solo
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=4)  # one request: under the batch cap
    outs = list(engine.generate(texts[0], greedy(5)))
    assert [t for o in outs for t in o.token_ids] == solo[0][:5]
    assert outs[-1].finished and outs[-1].completion_tokens == 5 and outs[-1].finish_reason == "length"


SAMPLED_AND_PENALIZED = {
    "sampled": SamplingParams(temperature=0.05, seed=3),
    "nucleus": SamplingParams(temperature=0.05, top_p=0.9, seed=5, logprobs=2),
    "frequency": SamplingParams(temperature=0.0, frequency_penalty=0.05),
    "presence+bias": SamplingParams(temperature=0.0, presence_penalty=0.1, logit_bias={100: 0.5}),
    "repetition+sampled": SamplingParams(temperature=0.05, repetition_penalty=1.02, seed=7),
}


@pytest.mark.parametrize("kind", SAMPLED_AND_PENALIZED)
def test_sampled_and_penalized_requests_draft_and_stay_exact(tiny_package, texts_and_solo, kind):
    """Each drafted row has its own penalty state and a sampled row draws only when its token is emitted,
    so the output equals plain decoding's, seed for seed (a penalty state shared by the rows of a
    draft, or a draw per row, fails this)."""
    texts, _ = texts_and_solo
    params = SAMPLED_AND_PENALIZED[kind]
    params.max_tokens, params.ignore_eos = 32, True
    spec = Engine.from_package(tiny_package("llama"), speculative_tokens=3)
    plain = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
    for text in texts:
        got, want = list(spec.generate(text, params)), list(plain.generate(text, params))
        assert [o.token_ids for o in got] == [o.token_ids for o in want], text
        if params.logprobs:
            a, b = [lp for o in got for lp in o.logprobs], [lp for o in want for lp in o.logprobs]
            assert [[t for t, _ in lp.top] for lp in a] == [[t for t, _ in lp.top] for lp in b]
            assert [lp.logprob for lp in a] == pytest.approx([lp.logprob for lp in b], abs=1e-4)
    assert spec.stats_snapshot()["accepted_draft_tokens"] > 0


def test_hot_sampling_does_not_draft(tiny_package, texts_and_solo):
    texts, _ = texts_and_solo
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=3)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)
    plain = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
    assert ([t for o in engine.generate(texts[1], params) for t in o.token_ids]
            == [t for o in plain.generate(texts[1], params) for t in o.token_ids])
    assert engine.stats_snapshot()["draft_tokens"] == 0


def test_drafting_stops_above_the_batch_cap(tiny_package, texts_and_solo):
    texts, solo = texts_and_solo
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=3, speculative_max_batch=2)
    got = run_staggered(engine, texts[:3], per_step=3, max_tokens=24)  # three at once: above the cap
    assert [got[i] for i in range(3)] == solo[:3]
    assert engine.stats_snapshot()["draft_tokens"] == 0
