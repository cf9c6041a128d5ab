"""A prompt's own log-probabilities (vLLM's prompt_logprobs, the completions API's echo), computed in the engine's
prefill: each prompt token's equals transformers' log-softmax given the tokens before it, whatever the batch,
the prefix cache or the chunking; max_tokens 0 computes the prompt and generates nothing."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from runtime.errors import RequestError
from tests.runtime.test_generate import PROMPT, package_tokenizer

TOL = 2e-3


def hf_prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def run(engine: Engine, requests: dict) -> dict:
    """Each request's outputs, all submitted before the first step (one batch)."""
    rids = {name: engine.add_request(ids, params) for name, (ids, params) in requests.items()}
    outs = {name: [] for name in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[next(n for n, r in rids.items() if r == out.request_id)].append(out)
    return outs


@pytest.mark.parametrize("scored_rows", [128, 3])  # 3: a step scores 3 of the prompt's rows at most
def test_prompt_logprobs_equal_transformers_in_any_batch(scored_rows, tiny_model_dir, tiny_package, monkeypatch):
    from runtime.core import scheduler

    monkeypatch.setattr(scheduler, "SCORED_ROWS", scored_rows)
    pkg = tiny_package("llama")
    ids = package_tokenizer(pkg).encode(PROMPT)
    ref = hf_prompt_logprobs(tiny_model_dir("llama"), ids)
    # a small token budget: the prompt is computed in several chunks, beside another request's decode
    engine = Engine.from_package(pkg, max_batch_tokens=5)
    run(engine, {"warm": (ids, SamplingParams(max_tokens=2, temperature=0))})  # its blocks now in the prefix cache
    outs = run(engine, {"scored": (ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)),
                        "other": (ids[:7], SamplingParams(max_tokens=8, temperature=0.7, seed=1))})
    first = outs["scored"][0]
    assert first.cached_tokens == 0  # a scored prompt computes every row, cache or not
    scores = first.prompt_logprobs
    assert [s.token_id for s in scores] == ids[1:]
    for at, s in enumerate(scores):
        assert abs(s.logprob - float(ref[at, ids[at + 1]])) < TOL, at
        best = torch.topk(ref[at], 3)
        assert [t for t, _ in s.top] == best.indices.tolist(), at  # the alternatives, likeliest first
        assert all(abs(lp - float(v)) < TOL for (_, lp), v in zip(s.top, best.values)), at
    assert all(o.prompt_logprobs is None for o in outs["scored"][1:] + outs["other"])
    assert sum(len(o.token_ids) for o in outs["scored"]) == 3  # and it generates as asked


def test_max_tokens_zero_computes_the_prompt_and_generates_nothing(tiny_package):
    pkg = tiny_package("llama")
    ids = package_tokenizer(pkg).encode(PROMPT)
    engine = Engine.from_package(pkg)
    outs = run(engine, {"p": (ids, SamplingParams(max_tokens=0, prompt_logprobs=0))})["p"]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length" and outs[0].token_ids == []
    assert len(outs[0].prompt_logprobs) == len(ids) - 1
    assert all(s.top == [] and s.logprob <= 0 and math.isfinite(s.logprob) for s in outs[0].prompt_logprobs)
    again = run(engine, {"p": (ids, SamplingParams(max_tokens=0, prompt_logprobs=0))})["p"]
    assert [s.logprob for s in again[0].prompt_logprobs] == [s.logprob for s in outs[0].prompt_logprobs]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused_by_name(bad):
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad).validate()
