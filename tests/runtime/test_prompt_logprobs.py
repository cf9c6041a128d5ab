"""A prompt's own log-probabilities (vLLM's prompt_logprobs, the completions API's echo), computed in the engine's
prefill: each prompt token's equals transformers' log-softmax given the tokens before it, whatever the batch,
the prefix cache or the chunking; max_tokens 0 computes the prompt and generates nothing."""

from __future__ import annotations

import json
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


def test_completions_echo_logprobs_as_lm_eval_reads_them(tiny_model_dir, tiny_package):
    """lm-evaluation-harness's `local-completions` loglikelihood request: token-id prompts in a list, echo,
    logprobs 1, max_tokens 0; it sums token_logprobs past the context. Each equals transformers'; the first
    is null; a string prompt echoes its own text; vLLM's prompt_logprobs ride along; usage counts each prompt."""
    import httpx

    from runtime.serve.server import create_app, load_models
    from tests.runtime.test_server import LiveServer

    pkg = tiny_package("llama")
    ids = package_tokenizer(pkg).encode(PROMPT)
    ref = hf_prompt_logprobs(tiny_model_dir("llama"), ids)
    models = load_models([str(pkg)], "cpu", 32, {})
    live = LiveServer(create_app(models))
    try:
        name = next(iter(models))
        body = {"model": name, "prompt": [ids, ids[:6]], "echo": True, "logprobs": 1, "max_tokens": 0,
                "temperature": 0, "seed": 1234}
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert out["usage"]["prompt_tokens"] == len(ids) + 6 and out["usage"]["completion_tokens"] == 0
        for choice, prompt in zip(out["choices"], (ids, ids[:6])):
            lp = choice["logprobs"]
            assert choice["finish_reason"] == "length" and len(lp["tokens"]) == len(prompt)
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for at in range(1, len(prompt)):
                assert abs(lp["token_logprobs"][at] - float(ref[at - 1, prompt[at]])) < TOL, at
                assert len(lp["top_logprobs"][at]) == 1
                assert abs(max(lp["top_logprobs"][at].values()) - float(ref[at - 1].max())) < TOL
            assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        # a string prompt echoes itself, then its continuation; vLLM's prompt_logprobs beside
        r = httpx.post(live.url + "/v1/completions", json={
            "model": name, "prompt": PROMPT, "echo": True, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2},
            timeout=120)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for at in range(1, len(ids)):
            got = plp[at][str(ids[at])]["logprob"]
            assert abs(got - float(ref[at - 1, ids[at]])) < TOL
        # streamed: the prompt comes first, in the choice's first chunk
        with httpx.stream("POST", live.url + "/v1/completions", json={
                "model": name, "prompt": PROMPT, "echo": True, "max_tokens": 3, "temperature": 0, "stream": True},
                timeout=120) as s:
            texts = [json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                     if line.startswith("data: {")]
        assert texts[0].startswith(PROMPT) and "".join(texts) == choice["text"][:len("".join(texts))]
        bad = httpx.post(live.url + "/v1/completions", json={"model": name, "prompt": PROMPT, "prompt_logprobs": 99})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
        # vLLM's tokenizer endpoints, which lm-eval uses instead of a local tokenizer when they answer
        info = httpx.get(live.url + "/tokenizer_info").json()
        tok = package_tokenizer(pkg)
        assert info["eos_token"] and info["model_max_length"] == models[name].engine.prompts.max_context
        got = httpx.post(live.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert got["tokens"] == tok.encode(PROMPT, add_bos=False) and got["count"] == len(got["tokens"])
        back = httpx.post(live.url + "/detokenize", json={"tokens": got["tokens"]}).json()
        assert back["prompt"] == tok.decode(got["tokens"])
        refused = httpx.post(live.url + "/detokenize", json={"tokens": [-1]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    finally:
        live.stop()
