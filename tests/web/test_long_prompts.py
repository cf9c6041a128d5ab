"""Prompts longer than the page's step budget (256 tokens): chunked prefill in the page equals native."""

from __future__ import annotations

import pytest

from tests.web.conftest import CHAT, LOAD_ENGINE, dump

pytestmark = pytest.mark.slow

SMOL = "/models/smollm2-135m/"
QUESTION = "In one sentence, what is the text above about?"
# words that SmolLM2's BPE keeps as one token each after a space: a prompt of exactly N tokens
WORDS = ("the sea is wide and deep and the ship sails over it while the sun goes down on a long day "
         "of work for all the men who live by the water and know its ways").split()
LENGTHS = (255, 256, 257, 511, 512, 513, 1500)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def native(web_bundle):
    """The same browser package on the native backend, stepping with the page's budget."""
    from runtime.core.engine import Engine

    return Engine.from_package(web_bundle / "models" / "smollm2-135m", max_batch_tokens=256,
                               speculative_tokens=0)


def messages_of_length(engine, n: int) -> list[dict]:
    """A long system prompt plus a question, exactly n prompt tokens under the chat template."""
    def msgs(k: int) -> list[dict]:
        text = " ".join(WORDS[i % len(WORDS)] for i in range(k))
        return [{"role": "system", "content": f"Read this: {text}."}, {"role": "user", "content": QUESTION}]
    base = len(engine.encode_prompt(messages=msgs(0)))
    out = msgs(n - base)
    assert len(engine.encode_prompt(messages=out)) == n
    return out


def native_ids(engine, messages: list[dict]) -> list[int]:
    from runtime.core.sampling import SamplingParams

    return [t for o in engine.generate(messages=messages, params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
            for t in o.token_ids]


def test_long_prompts_in_the_page_equal_native(offline_page, native):
    p = offline_page()
    p.api()
    p.evaluate(LOAD_ENGINE, [SMOL, {"device": "wasm", "speculativeTokens": 0, "backend": "onnxruntime"}])
    for n in LENGTHS:
        messages = messages_of_length(native, n)
        reply = p.evaluate(CHAT, {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                                  "return_token_ids": True})
        assert reply["usage"]["prompt_tokens"] == n, dump(reply)
        assert reply["choices"][0]["token_ids"] == native_ids(native, messages), f"{n}-token prompt"


def test_over_the_context_is_the_native_error_and_the_page_keeps_serving(offline_page, native):
    from runtime.errors import ContextLengthError

    p = offline_page()
    p.api()
    p.evaluate(LOAD_ENGINE, [SMOL, {"device": "wasm", "speculativeTokens": 0, "backend": "onnxruntime"}])
    too_long = messages_of_length(native, native.max_context + 10)
    with pytest.raises(ContextLengthError) as native_error:
        native.add_request(messages=too_long)
    error = p.evaluate("""async (req) => {
      try { await engine.chat.completions.create(req); return null; }
      catch (e) { return { message: e.message, code: e.code ?? null }; }
    }""", {"messages": too_long, "max_tokens": 4})
    assert error == {"message": str(native_error.value), "code": "context_length_exceeded"}
    # the page keeps serving: four requests at once (one with a 1,500-token prompt), then an abort and a new one
    reqs = [{"messages": messages_of_length(native, n), "max_tokens": MAX_TOKENS, "temperature": 0,
             "return_token_ids": True} for n in (1500, 300, 40, 257)]
    replies = p.evaluate("async (reqs) => Promise.all(reqs.map((r) => engine.chat.completions.create(r)))", reqs)
    for req, reply in zip(reqs, replies):
        assert reply["choices"][0]["token_ids"] == native_ids(native, req["messages"])
    out = p.evaluate("""async (req) => {
      const s = await engine.chat.completions.create({ ...req, max_tokens: 200, stream: true });
      let n = 0;
      for await (const c of s) if (++n === 3) await s.abort();
      const next = await engine.chat.completions.create(req);
      return { n, next, stats: await engine.stats() };
    }""", reqs[0])
    assert out["n"] < 50 and out["next"]["choices"][0]["token_ids"] == native_ids(native, reqs[0]["messages"])
    assert out["stats"]["running"] == 0 and out["stats"]["aborted"] == 1
