"""The ruvllm-web API in a page: parity with the native runtime, streaming, batching, errors, the cache."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.web.conftest import CHAT, LOAD_ENGINE, STREAM, dump, publish, stream_ids

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Hello! Tell me about the sea."}]
GREEDY = {"temperature": 0, "return_token_ids": True}


@pytest.fixture(scope="module")
def tiny_url(tiny_package, web_models) -> str:
    return publish(web_models, tiny_package("llama", "fp32"), "tiny-llama-fp32")


def native_chat_ids(package, text: str, max_tokens: int) -> list[int]:
    proc = run_cli("generate", str(package), text, "--chat", "--json", "--temperature", "0",
                   "--max-tokens", str(max_tokens))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["token_ids"]


def load(p, url: str, **opts) -> dict:
    p.api()
    return p.evaluate(LOAD_ENGINE, [url, opts])


def test_browser_greedy_tokens_equal_native_fp32(offline_page, tiny_package, tiny_url):
    p = offline_page()
    load(p, tiny_url, device="wasm")
    reply = p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 24, **GREEDY})
    ids = reply["choices"][0]["token_ids"]
    assert len(ids) == reply["usage"]["completion_tokens"] > 0
    assert ids == native_chat_ids(tiny_package("llama", "fp32"), HELLO[0]["content"], 24)


@pytest.mark.parametrize("arch", ["qwen3", "gemma", "gemma2", "phi3"])
def test_newer_families_in_the_page_equal_native(arch, offline_page, tiny_package, web_models):
    """Qwen3's q/k norms, Gemma's GeGLU, (1 + w) norms and scaled embeddings, Gemma 2's soft-capping and
    per-layer windows, and Phi-3 (read as Mistral, sliding window included) run in onnxruntime-web as natively, on the browser package (int4 on the
    wire, fp32 compute)."""
    pkg = tiny_package(arch, "int4", "wasm")
    p = offline_page()
    load(p, publish(web_models, pkg, f"tiny-{arch}-int4-wasm"), device="wasm")
    reply = p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 16, **GREEDY})
    assert reply["choices"][0]["token_ids"] == native_chat_ids(pkg, HELLO[0]["content"], 16)


def test_smollm2_browser_package_equals_native(offline_page, web_bundle):
    """The browser package computes in fp32 on both sides (weights expanded from int4 at load)."""
    p = offline_page()
    info = load(p, "/models/smollm2-135m/", device="wasm", backend="onnxruntime")
    assert info["quantization"]["compute"] == "fp32" and info["quantization"]["weights"] == "int4"
    # WASM runs the main graph; the package's WebGPU variant is never downloaded
    assert info["graph"] == "model.onnx" and not any(u.endswith("/model_webgpu.onnx") for u in p.requests)
    question = "Name the capital of France."
    reply = p.evaluate(CHAT, {"messages": [{"role": "user", "content": question}], "max_tokens": 16, **GREEDY})
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert reply["choices"][0]["token_ids"] == native_chat_ids(web_bundle / "models" / "smollm2-135m", question, 16)


def test_a_text_prompt_is_continued_as_natively(offline_page, tiny_package, tiny_url):
    """engine.completions.create: a base model's request (no chat template needed), streamed or whole,
    the same greedy tokens as `ruvllm generate --raw`."""
    p = offline_page()
    load(p, tiny_url, device="wasm")
    prompt = "The sea is"
    whole = p.evaluate("async (r) => await window.engine.completions.create(r)",
                       {"prompt": prompt, "max_tokens": 12, **GREEDY})
    assert whole["object"] == "text_completion"
    proc = run_cli("generate", str(tiny_package("llama", "fp32")), prompt, "--raw", "--json", "--temperature", "0",
                   "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert whole["choices"][0]["token_ids"] == json.loads(proc.stdout)["token_ids"]
    texts = p.evaluate("""async (r) => { const out = [];
      for await (const c of await window.engine.completions.create(r)) out.push(c.choices[0]?.text ?? '');
      return out; }""", {"prompt": prompt, "max_tokens": 12, "stream": True, **GREEDY})
    assert "".join(texts) == whole["choices"][0]["text"] and len([t for t in texts if t]) > 1
    bad = p.evaluate("""async () => { try { await window.engine.completions.create({ messages: [] }); }
      catch (e) { return e.error?.param ?? String(e); } }""")
    assert bad == "messages"  # a chat body sent to completions: refused naming the field, as the server does
    # lm-eval's scoring request: the prompt's own log-probabilities, computed in the page's prefill as natively
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    ids = whole["choices"][0]["token_ids"]
    scored = p.evaluate("async (r) => await window.engine.completions.create(r)",
                        {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
    lp = scored["choices"][0]["logprobs"]
    engine = Engine.from_package(tiny_package("llama", "fp32"))
    native = next(engine.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=1))).prompt_logprobs
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert max(abs(a - b.logprob) for a, b in zip(lp["token_logprobs"][1:], native)) < 1e-3


def test_stream_chunks_arrive_one_by_one(offline_page, tiny_url):
    p = offline_page()
    load(p, tiny_url)
    chunks = p.evaluate(STREAM, {"messages": HELLO, "max_tokens": 20, "stream_options": {"include_usage": True},
                                 **GREEDY})
    assert chunks[0]["c"]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [c for c in chunks if c["c"]["choices"] and c["c"]["choices"][0].get("token_ids")]
    assert len(tokens) == 20, dump(chunks)  # one chunk per token
    times = [c["t"] for c in tokens]
    assert len(set(times)) >= 15 and times == sorted(times)  # delivered as generated, not at the end
    assert chunks[-1]["c"]["usage"]["completion_tokens"] == 20
    text = "".join(c["c"]["choices"][0]["delta"].get("content", "") for c in chunks if c["c"]["choices"])
    full = p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 20, **GREEDY})
    assert text == full["choices"][0]["message"]["content"]
    assert stream_ids(chunks) == full["choices"][0]["token_ids"]


def test_two_concurrent_creates_are_batched_and_correct(offline_page, tiny_url):
    p = offline_page()
    load(p, tiny_url)
    a = {"messages": HELLO, "max_tokens": 24, **GREEDY}
    b = {"messages": [{"role": "user", "content": "Count to ten, please."}], "max_tokens": 24, **GREEDY}
    both = p.evaluate("""async ([a, b]) => {
      const run = async (req) => { const out = []; for await (const c of await engine.chat.completions.create({ ...req, stream: true })) out.push({ t: performance.now(), c }); return out; };
      return await Promise.all([run(a), run(b)]);
    }""", [a, b])
    stats = p.evaluate("engine.stats()")
    assert stats["peak_running"] >= 2  # one engine stepped both at once
    alone_a = p.evaluate(CHAT, a)["choices"][0]["token_ids"]
    alone_b = p.evaluate(CHAT, b)["choices"][0]["token_ids"]
    assert stream_ids(both[0]) == alone_a and stream_ids(both[1]) == alone_b
    ta, tb = [c["t"] for c in both[0]], [c["t"] for c in both[1]]
    assert min(tb) < max(ta) and min(ta) < max(tb)  # interleaved, not one after the other


def test_abort_mid_stream_frees_kv_and_the_engine_keeps_serving(offline_page, tiny_url):
    p = offline_page()
    load(p, tiny_url)
    out = p.evaluate("""async () => {
      const s = await engine.chat.completions.create({ messages: [{ role: 'user', content: 'Go on forever.' }], max_tokens: 200, stream: true });
      let n = 0, reason = null;
      for await (const c of s) { n++; if (n === 5) await s.abort(); reason = c.choices?.[0]?.finish_reason ?? reason; }
      return { n, reason, stats: await engine.stats() };
    }""")
    assert out["n"] < 50 and out["reason"] == "stop"
    assert out["stats"]["aborted"] == 1 and out["stats"]["running"] == 0 and out["stats"]["kv_blocks_used"] == 0
    assert p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 4, **GREEDY})["usage"]["completion_tokens"] == 4


def test_bad_requests_get_clear_errors_and_lose_nothing(offline_page, tiny_url):
    p = offline_page()
    load(p, tiny_url)
    errors = p.evaluate("""async () => {
      const tries = [
        { messages: [{ role: 'user', content: 'word '.repeat(400) }] },
        { messages: [] },
        { messages: [{ role: 'user', content: 'hi' }], temperature: 9 },
        // past the default body limit (1 KiB a token of the 256-token context, plus 1 MiB)
        { messages: [{ role: 'user', content: 'x'.repeat(2 << 20) }] },
        // within it, but ~1 MB of text: refused by its length, before the pure-Python tokenizer sees it
        { messages: [{ role: 'user', content: 'word '.repeat(200000) }] },
      ];
      const out = [];
      for (const req of tries) {
        const t0 = performance.now();
        try { await engine.chat.completions.create(req); out.push(null); }
        catch (e) { out.push({ message: e.message, code: e.code ?? null, ms: performance.now() - t0 }); }
      }
      return out;
    }""")
    assert errors[0]["code"] == "context_length_exceeded" and "context" in errors[0]["message"]
    assert "messages" in errors[1]["message"] and "temperature" in errors[2]["message"]
    assert errors[3]["code"] == "request_too_large" and "maxRequestBytes" in errors[3]["message"]
    assert errors[4]["code"] == "context_length_exceeded" and "at least" in errors[4]["message"]
    assert errors[4]["ms"] < 2000, errors[4]
    assert p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 4, **GREEDY})["usage"]["completion_tokens"] == 4


STORE = """async ([pkg, name]) => {
  const manifest = await (await fetch(new URL('manifest.json', new URL(pkg, location.href)))).json();
  const dir = await (await navigator.storage.getDirectory()).getDirectoryHandle('ruvllm-models-v1', { create: true });
  return { sha: manifest.files[name].sha256, dir };
}"""
# the stored file names (a file is stored under its sha256) that belong to the package's `name`
STORED = """async ([pkg, name]) => {
  const { sha, dir } = await (STORE)([pkg, name]);
  const keys = [];
  for await (const key of dir.keys()) if (key.startsWith(sha)) keys.push(key);
  return keys;
}""".replace("STORE", STORE)
CORRUPT = """async ([pkg, name]) => {
  const { sha, dir } = await (STORE)([pkg, name]);
  const handle = await dir.getFileHandle(sha);
  const bytes = new Uint8Array(await (await handle.getFile()).arrayBuffer());
  bytes[bytes.length >> 1] ^= 0xff;  // one flipped byte, same size
  const out = await handle.createWritable();
  await out.write(bytes);
  await out.close();
  return sha;
}""".replace("STORE", STORE)
def test_python_comes_from_the_bundles_snapshot_and_a_corrupt_one_is_refused(offline_page, tiny_url):
    p = offline_page()
    info = load(p, tiny_url)
    assert info["python"] == "snapshot"  # made at bundle build (wasm/snapshot.py), restored here
    expected = p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 8, **GREEDY})["choices"][0]["token_ids"]
    sampled = {"messages": HELLO, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    assert p.evaluate(CHAT, sampled)["choices"][0]["message"] == p.evaluate(CHAT, sampled)["choices"][0]["message"]

    def corrupt(route):  # same size, one byte flipped: the sha256 check must catch it before Pyodide does
        body = bytearray(route.fetch().body())
        body[len(body) // 2] ^= 0xFF
        route.fulfill(status=200, body=bytes(body), headers={"Content-Type": "application/gzip"})
    p.context.route("**/python-snapshot.bin.gz", corrupt)
    p.page.reload()
    booted = load(p, tiny_url)
    assert booted["python"] == "booted"
    assert any("snapshot was not usable" in line and "sha256" in line for line in p.console)
    assert p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 8, **GREEDY})["choices"][0]["token_ids"] == expected


# flip one byte in the middle of every saved prompt-K/V file (web/src/prompt_kv.js); returns their names
CORRUPT_PROMPT_KV = """async () => {
  const dir = await (await navigator.storage.getDirectory()).getDirectoryHandle('ruvllm-models-v1');
  const names = [];
  for await (const [name, handle] of dir.entries()) {
    if (!name.startsWith('prompt-kv-')) continue;
    const bytes = new Uint8Array(await (await handle.getFile()).arrayBuffer());
    bytes[bytes.length >> 1] ^= 0xff;
    const out = await handle.createWritable();
    await out.write(bytes);
    await out.close();
    names.push(name);
  }
  return names;
}"""


def test_reload_uses_the_cache_and_a_corrupt_entry_is_refetched(offline_page, tiny_url):
    p = offline_page()
    first = load(p, tiny_url)
    assert first["cache"]["downloaded"] >= 3 and first["cache"]["fromCache"] == 0
    assert first["restoredPromptBlocks"] == 0
    reply = p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 8, **GREEDY})
    expected = reply["choices"][0]["token_ids"]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert p.evaluate(STORED, [tiny_url, "model.onnx.data"]) != []
    p.evaluate("engine.stats()")  # resolves once the prompt's K/V blocks are saved

    p.page.reload()
    again = load(p, tiny_url)
    assert again["cache"]["downloaded"] == 0 and again["cache"]["fromCache"] == first["cache"]["downloaded"]
    assert again["timings"]["model_worker"]["warmup_steps"] == 0  # warm-up only while bytes come from the network
    # the last prompt's full K/V blocks came back from storage: the same prompt skips their prefill, same answer
    blocks = reply["usage"]["prompt_tokens"] // 16
    assert blocks >= 1 and again["restoredPromptBlocks"] == blocks
    reply = p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 8, **GREEDY})
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * blocks
    assert reply["choices"][0]["token_ids"] == expected
    p.evaluate("engine.stats()")
    p.page.reload()
    assert load(p, tiny_url, promptCache=False)["restoredPromptBlocks"] == 0  # the page can opt out

    assert len(p.evaluate(CORRUPT_PROMPT_KV)) == 1  # a damaged prompt cache is dropped, never used
    p.page.reload()
    assert load(p, tiny_url)["restoredPromptBlocks"] == 0
    reply = p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 8, **GREEDY})
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert reply["choices"][0]["token_ids"] == expected

    p.evaluate(CORRUPT, [tiny_url, "model.onnx.data"])
    p.page.reload()
    healed = load(p, tiny_url)
    assert healed["cache"]["refetched"] == 1 and healed["cache"]["downloaded"] == 1
    assert p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 8, **GREEDY})["choices"][0]["token_ids"] == expected

    # the graph itself: its check runs while onnxruntime-web parses it, and may fail after the parse does
    p.evaluate(CORRUPT, [tiny_url, "model.onnx"])
    p.page.reload()
    healed = load(p, tiny_url)
    assert healed["cache"]["refetched"] == 1 and healed["cache"]["downloaded"] == 1
    assert p.evaluate(CHAT, {"messages": HELLO, "max_tokens": 8, **GREEDY})["choices"][0]["token_ids"] == expected


def test_a_partial_download_fails_clearly_and_leaves_no_cache_entry(offline_page, tiny_url):
    p = offline_page()
    p.api()
    cut = {"n": 0}

    def truncated(route):  # the server dies half way through the weights
        cut["n"] += 1
        body = route.fetch().body()
        route.fulfill(status=200, body=body[: len(body) // 2], headers={"Content-Type": "application/octet-stream"})
    p.context.route("**/model.onnx.data", truncated)
    err = p.evaluate("""async (model) => {
      try { await window.createEngine({ model }); return null; } catch (e) { return e.message; }
    }""", tiny_url)
    assert cut["n"] == 1 and "model.onnx.data" in err and "bytes" in err
    assert p.evaluate(STORED, [tiny_url, "model.onnx.data"]) == []  # not even a .part file
    p.context.unroute("**/model.onnx.data")
    info = load(p, tiny_url)  # the next load downloads it whole
    assert info["cache"]["downloaded"] >= 1
    assert p.evaluate(STORED, [tiny_url, "model.onnx.data"]) != []
