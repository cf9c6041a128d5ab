"""LoRA adapters in the page: loaded at run time, picked per request by `model`, the same greedy tokens
as the native runtime, mixed with base-model requests, unloaded."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.web.conftest import CHAT, LOAD_ENGINE, publish

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Hello! Tell me about the sea."}]
GREEDY = {"temperature": 0, "return_token_ids": True, "max_tokens": 16}


def native_ids(package, adapter=None) -> list[int]:
    extra = ["--lora", str(adapter)] if adapter else []
    proc = run_cli("generate", str(package), HELLO[0]["content"], "--chat", "--json", "--temperature", "0",
                   "--max-tokens", str(GREEDY["max_tokens"]), "--speculative-tokens", "0", *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["token_ids"]


def test_adapters_loaded_in_the_page_give_the_native_tokens(offline_page, tiny_package, peft_adapters, web_models):
    pkg = tiny_package("llama", "fp32")
    url = publish(web_models, pkg, "tiny-llama-fp32")
    adapters = peft_adapters("llama")
    urls = {name: publish(web_models, adapters[name], f"adapter-{name}") for name in ("attn4", "all16")}
    want = {name: native_ids(pkg, adapters[name]) for name in urls}
    want[None] = native_ids(pkg)
    assert len({tuple(v) for v in want.values()}) == 3  # each adapter really changes the output

    p = offline_page()
    p.api()
    p.evaluate(LOAD_ENGINE, [url, {"device": "wasm", "speculativeTokens": 0}])
    assert p.evaluate(CHAT, {"messages": HELLO, **GREEDY})["choices"][0]["token_ids"] == want[None]
    infos = p.evaluate("""async (urls) => {
      const out = {};
      for (const [name, url] of Object.entries(urls)) out[name] = await engine.loadAdapter(name, url);
      return out;
    }""", urls)
    assert infos["all16"]["rank"] == 16 and infos["attn4"]["targets"] == ["q_proj", "v_proj"]
    # all three at once, in one batch: each as it runs alone natively
    replies = p.evaluate("""async ([req, names]) => Promise.all(names.map((model) =>
      engine.chat.completions.create(model ? { ...req, model } : req)))""", [{"messages": HELLO, **GREEDY},
                                                                           ["attn4", None, "all16"]])
    got = {name: r["choices"][0]["token_ids"] for name, r in zip(["attn4", None, "all16"], replies)}
    assert got == want
    assert p.evaluate("async () => engine.unloadAdapter('attn4')") is True
    err = p.evaluate("""async (req) => { try { await engine.chat.completions.create(req); return null; }
      catch (e) { return { code: e.code, message: e.message }; } }""", {"messages": HELLO, **GREEDY, "model": "attn4"})
    assert err and err["code"] == "model_not_found", err
    bad = p.evaluate("""async () => { try { await engine.loadAdapter('x', { 'adapter_config.json': new TextEncoder().encode('{}') });
      return null; } catch (e) { return e.message; } }""")
    assert bad and "adapter_model.safetensors" in bad, bad
    again = p.evaluate(CHAT, {"messages": HELLO, **GREEDY, "model": "all16"})
    assert again["choices"][0]["token_ids"] == want["all16"]


def test_xlora_in_the_page_gives_the_native_tokens(offline_page, tiny_package, peft_adapters, xlora_models,
                                                    web_models):
    """A PEFT X-LoRA folder (its classifier partly in the experts' subfolders, as PEFT saves it) with its
    three experts by URL: the page runs the scaling pass, the classifier and the mixed pass as natively."""
    pkg = tiny_package("llama", "fp32")
    url = publish(web_models, pkg, "tiny-llama-fp32")
    _, folder = xlora_models("dense")
    xurl = publish(web_models, folder, "xlora-dense")
    experts = {str(i): publish(web_models, path, f"adapter-{name}") for i, (name, path) in
               enumerate(peft_adapters("llama").items())}
    want = native_ids(pkg, folder)
    assert want != native_ids(pkg)
    p = offline_page()
    p.api()
    p.evaluate(LOAD_ENGINE, [url, {"device": "wasm", "speculativeTokens": 0}])
    info = p.evaluate("async ([url, experts]) => engine.loadAdapter('mix', url, { experts })", [xurl, experts])
    assert info["kind"] == "xlora" and info["experts"] == ["mix/0", "mix/1", "mix/2"] and info["rank"] == 16
    replies = p.evaluate("""async ([req, names]) => Promise.all(names.map((model) =>
      engine.chat.completions.create(model ? { ...req, model } : req)))""", [{"messages": HELLO, **GREEDY},
                                                                           ["mix", None]])
    assert replies[0]["choices"][0]["token_ids"] == want
    assert replies[1]["choices"][0]["token_ids"] == native_ids(pkg)
