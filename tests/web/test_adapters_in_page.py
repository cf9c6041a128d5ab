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


@pytest.mark.parametrize("variant", ["dense", "layerwise"])
def test_xlora_in_the_page_gives_the_native_tokens(variant, offline_page, tiny_package, peft_adapters, xlora_models,
                                                    web_models):
    """A PEFT X-LoRA folder (its classifier partly in the experts' subfolders, as PEFT saves it) with its
    three experts by URL: the page runs the scaling pass, the classifier and the mixed pass as natively
    (layerwise: a set of weights per layer and target)."""
    pkg = tiny_package("llama", "fp32")
    url = publish(web_models, pkg, "tiny-llama-fp32")
    _, folder = xlora_models(variant)
    xurl = publish(web_models, folder, f"xlora-{variant}")
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


STORE_FILE = """async ([sha, corrupt]) => {
  const dir = await (await navigator.storage.getDirectory()).getDirectoryHandle('ruvllm-models-v1');
  let handle;
  try { handle = await dir.getFileHandle(sha); } catch { return null; }
  const bytes = new Uint8Array(await (await handle.getFile()).arrayBuffer());
  if (corrupt) {
    bytes[bytes.length >> 1] ^= 0xff;  // one flipped byte, same size
    const out = await handle.createWritable();
    await out.write(bytes);
    await out.close();
  }
  return bytes.length;
}"""


def test_converted_adapters_are_cached_hash_checked_and_load_offline(offline_page, tiny_package, peft_adapters,
                                                                     web_models, workdir):
    """`python -m exporter adapter`'s folder names its weights' sha256: the page keeps them in the model store,
    re-checks them on every load, fetches a damaged copy again, and loads the adapter with the network gone."""
    pkg = tiny_package("llama", "fp32")
    url = publish(web_models, pkg, "tiny-llama-fp32")
    peft = peft_adapters("llama")["all16"]
    converted = workdir / "adapter-all16-ruvllm"
    if not converted.exists():
        proc = run_cli("adapter", str(peft), "-o", str(converted), "--base", str(pkg), module="exporter")
        assert proc.returncode == 0, proc.stderr[-2000:]
    sha = json.loads((converted / "adapter.json").read_text())["files"]["adapter.safetensors"]["sha256"]
    aurl = publish(web_models, converted, "adapter-all16-ruvllm")
    want = native_ids(pkg, converted)
    assert want == native_ids(pkg, peft)  # the converted adapter is the PEFT one

    p = offline_page()
    p.api()

    def load_and_chat() -> tuple[dict, list[int]]:
        p.evaluate(LOAD_ENGINE, [url, {"device": "wasm", "speculativeTokens": 0}])
        info = p.evaluate("async (url) => engine.loadAdapter('mine', url)", aurl)
        reply = p.evaluate(CHAT, {"messages": HELLO, **GREEDY, "model": "mine"})
        return info["cache"], reply["choices"][0]["token_ids"]

    cache, ids = load_and_chat()
    assert cache == {"downloaded": 1, "fromCache": 0, "refetched": 0} and ids == want
    assert p.evaluate(STORE_FILE, [sha, False]) == (converted / "adapter.safetensors").stat().st_size

    p.page.reload()
    p.api()
    fetched = len([r for r in p.requests if r.endswith("adapter.safetensors")])
    cache, ids = load_and_chat()
    assert cache == {"downloaded": 0, "fromCache": 1, "refetched": 0} and ids == want
    assert len([r for r in p.requests if r.endswith("adapter.safetensors")]) == fetched  # not asked for again

    p.evaluate(STORE_FILE, [sha, True])
    p.page.reload()
    p.api()
    cache, ids = load_and_chat()
    assert cache == {"downloaded": 1, "fromCache": 0, "refetched": 1} and ids == want

    # the network gone: the adapter's JSON as last seen, its weights from the store
    p.context.route("**/adapter-all16-ruvllm/**", lambda route: route.abort())
    info = p.evaluate("async (url) => engine.loadAdapter('offline', url)", aurl)
    assert info["cache"] == {"downloaded": 0, "fromCache": 1, "refetched": 0}
    reply = p.evaluate(CHAT, {"messages": HELLO, **GREEDY, "model": "offline"})
    assert reply["choices"][0]["token_ids"] == want
