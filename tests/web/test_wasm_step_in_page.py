"""backend 'wasm-step' in a page: the package's own WASM decode step (wasm/step/step.c) runs the engine's
steps instead of onnxruntime-web, as the same step does natively in wasmtime (issue 33)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.formats.step_abi import FORMAT
from tests.conftest import run_cli
from tests.web.conftest import CHAT, LOAD_ENGINE, publish
from tests.web.test_wasm_step import WasmtimeBackend

pytestmark = pytest.mark.slow

SMOL = "/models/smollm2-135m/"
QUESTION = [{"role": "user", "content": "Name the capital of France, then describe the city."}]
# createEngine's error message for [model, options], or null when it loads
LOAD_ERROR = """async ([model, opts]) => {
  try { await window.createEngine({ model, ...opts }); return null; }
  catch (e) { return String(e.message ?? e); }
}"""


def load(p, url: str, **opts) -> dict:
    p.api()
    return p.evaluate(LOAD_ENGINE, [url, opts])


def wasmtime_ids(bundle, messages: list[dict], kv_dtype: str = "fp32", **params) -> list[int]:
    """The same engine natively, over the bundle's own step.wasm in wasmtime and the package's weights."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.package import load_package

    package = bundle / "models" / "smollm2-135m"
    engine = Engine(load_package(package), WasmtimeBackend(package, bundle / "ruvllm" / "step.wasm", kv_dtype),
                    speculative_tokens=0)
    return [t for o in engine.generate(messages=messages, params=SamplingParams(**params)) for t in o.token_ids]


def test_the_page_runs_the_wasm_step_as_wasmtime_does_and_fetches_only_its_weights(offline_page, web_bundle, smol_int4):
    """Greedy and seeded sampled text in the page equal the same engine on the same step in wasmtime
    (V8 and Cranelift run one module: the same numbers), and the greedy text equals the native engine's
    on the default package (the same GGUF blocks); the page fetches step.bin and no ONNX file. The page
    runs the threaded build on two threads, wasmtime the one-thread build: splitting a step's rows and
    heads between threads changes no number."""
    p = offline_page()
    info = load(p, SMOL, device="wasm", backend="wasm-step", speculativeTokens=0, threads=2)
    assert info["backend"] == "wasm-step" and info["graph"] == "step.bin" and info["threads"] == 2
    fetched = {u.rsplit("/", 1)[1] for u in p.requests if SMOL in u}
    assert "step.bin" in fetched and not any(n.endswith((".onnx", ".data")) for n in fetched), fetched
    greedy = {"max_tokens": 24, "temperature": 0}
    reply = p.evaluate(CHAT, {"messages": QUESTION, "return_token_ids": True, **greedy})
    ids = reply["choices"][0]["token_ids"]
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert ids == wasmtime_ids(web_bundle, QUESTION, **greedy)
    proc = run_cli("generate", str(smol_int4), QUESTION[0]["content"], "--chat", "--json", "--temperature", "0",
                   "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ids == json.loads(proc.stdout)["token_ids"]
    sampled = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 11, "presence_penalty": 0.5}
    reply = p.evaluate(CHAT, {"messages": QUESTION, "return_token_ids": True, **sampled})
    assert reply["choices"][0]["token_ids"] == wasmtime_ids(web_bundle, QUESTION, **sampled)
    stats = p.evaluate("async () => await window.engine.stats()")
    assert stats["backend"]["steps"] > 0 and stats["backend"]["threads"] == 2
    assert any(u.endswith("/ruvllm/step-threads.wasm") for u in p.requests)


SEA = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_pools_on_the_step_give_the_native_tokens(offline_page, web_bundle, smol_int4, web_models, tmp_path,
                                                               kv_dtype):
    """kvDtype 'int8' / 'int4' take the WASM step under backend 'auto': greedy text equal to the same step's in
    wasmtime (the same module), again from the prefix cache's quantized blocks, and to the native engine's on
    its pool of the same kind (rows quantized by the same rule) until they part at a near tie, if they do; the
    pool is the quantized pool's bytes a token, and the tails a sequence's last blocks; adapters run on it."""
    from runtime.core.engine import Engine
    from runtime.core.kv_blocks import kv_bytes_per_token
    from runtime.core.sampling import SamplingParams

    p = offline_page()
    info = load(p, SMOL, device="wasm", kvDtype=kv_dtype, speculativeTokens=0, threads=2)
    assert info["backend"] == "wasm-step" and info["kvDtype"] == kv_dtype, info
    greedy = {"max_tokens": 32, "temperature": 0}
    got = [p.evaluate(CHAT, {"messages": SEA, "return_token_ids": True, **greedy})["choices"][0]["token_ids"]
           for _ in range(2)]
    want = wasmtime_ids(web_bundle, SEA, kv_dtype, **greedy)
    assert got == [want, want]
    native = Engine.from_package(smol_int4, verify=False, speculative_tokens=0, kv_dtype=kv_dtype)
    steps = [lp for o in native.generate(messages=SEA, params=SamplingParams(logprobs=5, **greedy)) for lp in o.logprobs]
    # equal until they part, if they do, and only at a near tie of the native engine's (the page's token within
    # 0.3 nats of its best): rows quantized from slightly different activations may tip one
    parted = next((i for i, (t, lp) in enumerate(zip(want, steps)) if t != lp.token_id), len(steps))
    assert parted >= 8, (parted, want, steps)
    if parted < len(steps):
        top = dict(steps[parted].top)
        assert want[parted] in top and top[steps[parted].token_id] - top[want[parted]] < 0.3, (parted, want, steps[parted])
    stats = p.evaluate("async () => await window.engine.stats()")
    manifest = json.loads((web_bundle / "models" / "smollm2-135m" / "manifest.json").read_text())
    cfg, block = manifest["config"], manifest["kv_cache"]["block_size"]
    pool, tails = stats["backend"]["kv_pool_bytes"], stats["backend"]["kv_tail_bytes"]
    assert pool > 0 and pool % (kv_bytes_per_token(cfg, kv_dtype) * block) == 0, stats["backend"]
    slot = kv_bytes_per_token(cfg) * block  # a tail slot: one block of fp32 rows
    assert 0 < tails <= 4 * slot and tails % slot == 0, stats["backend"]  # a sequence's last blocks only
    url = publish(web_models, smol_peft(tmp_path / "peft"), "smol-peft")  # adapters run on the quantized pool
    assert p.evaluate("async (url) => engine.loadAdapter('mine', url)", url)["rank"] == 4
    tuned = p.evaluate(CHAT, {"messages": SEA, "return_token_ids": True, "model": "mine", **greedy})
    assert tuned["choices"][0]["token_ids"][:4] != want[:4]
    assert p.evaluate(CHAT, {"messages": SEA, "return_token_ids": True, **greedy})["choices"][0]["token_ids"] == want


def test_the_last_prompts_kv_survives_a_reload_on_the_wasm_step(offline_page):
    """As on onnxruntime-web: after a reload the last prompt's full K/V blocks come back from storage
    into the step's pool, the same prompt skips their prefill and gets the same greedy answer."""
    p = offline_page()
    first = load(p, SMOL, device="wasm", backend="wasm-step", speculativeTokens=0)
    assert first["restoredPromptBlocks"] == 0
    greedy = {"messages": QUESTION, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    reply = p.evaluate(CHAT, greedy)
    expected = reply["choices"][0]["token_ids"]
    p.evaluate("engine.stats()")  # resolves once the prompt's K/V blocks are saved

    p.page.reload()
    again = load(p, SMOL, device="wasm", backend="wasm-step", speculativeTokens=0)
    blocks = reply["usage"]["prompt_tokens"] // 16
    assert blocks >= 1 and again["restoredPromptBlocks"] == blocks
    reply = p.evaluate(CHAT, greedy)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * blocks
    assert reply["choices"][0]["token_ids"] == expected
    p.evaluate("engine.stats()")
    p.page.reload()  # the other backend computed other K/V: it never reads these
    assert load(p, SMOL, device="wasm", speculativeTokens=0, backend="onnxruntime")["restoredPromptBlocks"] == 0


def test_auto_takes_the_step_where_it_runs_and_onnxruntime_elsewhere(offline_page, tiny_package, web_models):
    """backend 'auto' (the default): the WASM step for a package that carries one, with an int8 KV cache too;
    onnxruntime-web for a package without step weights."""
    url = publish(web_models, tiny_package("llama", "fp32"), "tiny-llama-fp32")
    for model, opts, want in ((SMOL, {}, "wasm-step"), (SMOL, {"kvDtype": "int8"}, "wasm-step"),
                              (url, {}, "onnxruntime")):
        p = offline_page()
        info = load(p, model, device="wasm", **opts)
        assert info["backend"] == want, (model, opts, info)
        assert info["batchInvariant"] == (want == "wasm-step")  # the step promises it; onnxruntime-web does not
        assert ("batchInvariance" in info) == (want != "wasm-step")
        assert p.evaluate(CHAT, {"messages": QUESTION, "max_tokens": 4, "temperature": 0})["choices"][0]["message"]["content"]


def test_the_step_drafts_only_when_asked_and_drafts_change_no_token(offline_page):
    """On the WASM step speculative decoding is off by default (it pays each draft's full compute); asked
    for, prompt-lookup drafts are verified and the greedy tokens are the same."""
    ask = {"messages": [{"role": "user", "content": "Repeat this line three times: the quick brown fox jumps over "
                                                    "the lazy dog near the river bank."}],
           "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    runs = []
    for opts in ({}, {"speculativeTokens": 3}):
        p = offline_page()
        assert load(p, SMOL, device="wasm", **opts)["backend"] == "wasm-step"
        ids = p.evaluate(CHAT, ask)["choices"][0]["token_ids"]
        runs.append((ids, p.evaluate("engine.stats()")))
    (plain, plain_stats), (drafted, drafted_stats) = runs
    assert plain_stats["draft_tokens"] == 0
    assert drafted_stats["draft_tokens"] > 0 and drafted_stats["accepted_draft_tokens"] > 0
    assert drafted == plain


def smol_peft(folder: Path) -> Path:
    """A random rank-4 PEFT adapter on SmolLM2's q, k, v, o and down projections in every layer (q and k:
    the step keeps their rows in the GGUF's order, so their B is reordered when set)."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    shapes = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (576, 192), "self_attn.v_proj": (576, 192),
              "self_attn.o_proj": (576, 576), "mlp.down_proj": (1536, 576)}
    tensors = {}
    for layer in range(30):
        for target, (fin, fout) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{target}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((4, fin)) * 0.03).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fout, 4)) * 0.3).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}))
    return folder


def test_adapters_run_on_the_step_as_natively(offline_page, web_models, smol_int4, tmp_path):
    """A LoRA adapter on the WASM step (no move to onnxruntime-web): its greedy tokens follow the native
    engine's with the same adapter on the default package (the same GGUF blocks; the adapters' fp32 sums
    in another order: the first 10 of 16 measured equal, then a near tie between a newline and the end),
    the same alone and beside a base-model request, which keeps the base tokens."""
    adapter = smol_peft(tmp_path / "peft")
    url = publish(web_models, adapter, "smol-peft")
    greedy = {"messages": QUESTION, "max_tokens": 16, "temperature": 0, "return_token_ids": True}

    def native(*extra: str) -> list[int]:
        proc = run_cli("generate", str(smol_int4), QUESTION[0]["content"], "--chat", "--json", "--temperature", "0",
                       "--max-tokens", "16", "--speculative-tokens", "0", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)["token_ids"]

    base, tuned = native(), native("--lora", str(adapter))
    assert tuned[:4] != base[:4] and len(tuned) >= 8  # the adapter changes the answer (a near tie may end it early)
    p = offline_page()
    load(p, SMOL, device="wasm", backend="wasm-step", speculativeTokens=0)
    assert p.evaluate(CHAT, greedy)["choices"][0]["token_ids"] == base
    info = p.evaluate("async (url) => engine.loadAdapter('mine', url)", url)
    assert info["rank"] == 4
    alone = p.evaluate(CHAT, {**greedy, "model": "mine"})["choices"][0]["token_ids"]
    replies = p.evaluate("""async (req) => Promise.all([null, 'mine'].map((model) =>
      engine.chat.completions.create(model ? { ...req, model } : req)))""", greedy)
    assert [r["choices"][0]["token_ids"] for r in replies] == [base, alone]
    assert alone[:8] == tuned[:8], (alone, tuned)
    stats = p.evaluate("engine.stats()")
    assert stats["info"]["backend"] == "wasm-step" and stats["backend"]["steps"] > 0


def test_wasm_step_refusals_are_clear(offline_page, tiny_package, web_models, web_bundle):
    """A package without step weights, one whose step weights are an older layout, a KV cache of numbers the
    step does not keep and WebGPU are refused by name, at load; under 'auto' the older layout runs on
    onnxruntime-web."""
    url = publish(web_models, tiny_package("llama", "fp32"), "tiny-llama-fp32")
    old = web_models / "smol-old-step"
    old.mkdir(exist_ok=True)
    for f in (web_bundle / "models" / "smollm2-135m").iterdir():
        if f.name != "manifest.json" and not (old / f.name).exists():
            (old / f.name).symlink_to(f)
    manifest = json.loads((web_bundle / "models" / "smollm2-135m" / "manifest.json").read_text())
    del manifest["wasm_step"]["format"]  # as an export before the step read every type
    (old / "manifest.json").write_text(json.dumps(manifest))
    p = offline_page()
    assert load(p, "/test-models/smol-old-step/", device="wasm")["backend"] == "onnxruntime"
    for model, opts, want in ((url, {}, "has no WASM step weights"),
                              ("/test-models/smol-old-step/", {}, f"an older layout (format 1; this page reads {FORMAT})"),
                              (SMOL, {"kvDtype": "fp16"}, "fp16"),
                              (SMOL, {"device": "webgpu"}, 'use device "wasm"')):
        p = offline_page()
        p.api()
        err = p.evaluate(LOAD_ERROR, [model, {"backend": "wasm-step", **opts}])
        assert err and want in err, err
    p = offline_page()  # a KV cache past what wasm32 can hold: every step says so (no caller waits on the pool)
    load(p, SMOL, device="wasm", backend="wasm-step", kvMemoryMB=4000)
    err = p.evaluate("""async (request) => {
      try { await window.engine.chat.completions.create(request); return null; }
      catch (e) { return String(e.message ?? e); }
    }""", {"messages": QUESTION, "max_tokens": 2})
    assert err and "the KV cache could not be allocated" in err and "cannot grow" in err, err


def test_a_browser_without_relaxed_simd_gets_the_simd128_build(offline_page, web_bundle):
    """step-threads.wasm and step.wasm that do not compile (as in a browser without relaxed SIMD): the
    model worker loads step-simd128.wasm instead, on one thread, and the step still answers."""
    p = offline_page()
    broken = []

    def fulfill(route):
        broken.append(route.request.url.rsplit("/", 1)[1])
        route.fulfill(status=200, content_type="application/wasm", body=b"\0asm\x01\0\0\0\x7f")  # a section id no browser knows

    for name in ("step-threads.wasm", "step.wasm"):
        p.page.route(f"**/ruvllm/{name}", fulfill)
    info = load(p, SMOL, device="wasm", backend="wasm-step", threads=2)
    assert info["threads"] == 1 and sorted(broken) == ["step-threads.wasm", "step.wasm"]
    assert any(u.endswith("/ruvllm/step-simd128.wasm") for u in p.requests)
    reply = p.evaluate(CHAT, {"messages": QUESTION, "max_tokens": 12, "temperature": 0})
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_step_weights_stream_in_checked_and_a_model_past_wasm32_is_refused_first(offline_page, web_bundle, web_models):
    """step.bin streams into the step's memory chunk by chunk, each checked against the manifest's sha256
    as it arrives, and is kept in OPFS: a reload reads it from there, a damaged stored copy is fetched
    again with the same answer. A package whose step needs more than wasm32's 4 GB is refused by name
    before anything but its manifest is fetched."""
    from tests.web.test_engine_api import CORRUPT

    manifest = json.loads((web_bundle / "models" / "smollm2-135m" / "manifest.json").read_text())
    assert len(manifest["files"]["step.bin"]["chunks"]["sha256"]) > 1
    p = offline_page()
    first = load(p, SMOL, device="wasm", backend="wasm-step", speculativeTokens=0)
    greedy = {"messages": QUESTION, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    expected = p.evaluate(CHAT, greedy)["choices"][0]["token_ids"]
    assert any(u.endswith(SMOL + "step.bin") for u in p.requests)
    seen = len(p.requests)
    p.page.reload()
    again = load(p, SMOL, device="wasm", backend="wasm-step", speculativeTokens=0)
    assert again["cache"]["downloaded"] == 0 and again["cache"]["fromCache"] >= 1, (first["cache"], again["cache"])
    assert not any(u.endswith("/step.bin") for u in p.requests[seen:])
    assert p.evaluate(CHAT, greedy)["choices"][0]["token_ids"] == expected
    p.evaluate(CORRUPT, [SMOL, "step.bin"])
    p.page.reload()
    healed = load(p, SMOL, device="wasm", backend="wasm-step", speculativeTokens=0)
    assert healed["cache"]["refetched"] == 1 and healed["cache"]["downloaded"] == 1
    assert p.evaluate(CHAT, greedy)["choices"][0]["token_ids"] == expected

    big = web_models / "past-wasm32"
    big.mkdir(exist_ok=True)
    huge = {**manifest, "files": {**manifest["files"], "step.bin": {**manifest["files"]["step.bin"], "size": 5 << 30}}}
    (big / "manifest.json").write_text(json.dumps(huge))
    p = offline_page()
    p.api()
    err = p.evaluate(LOAD_ERROR, ["/test-models/past-wasm32/", {"device": "wasm"}])
    assert err and "4.0 GB" in err and "wasm32" in err and "5.0 GB of weights" in err, err
    assert [u for u in p.requests if "past-wasm32" in u and not u.endswith("manifest.json")] == []


@pytest.fixture(scope="module")
def step_only_package(workdir, smol_gguf):
    """A page's package from a K-quant GGUF past the size the page's onnxruntime-web graphs can hold
    (the limit lowered so that a tiny file is): streamed, native graphs, the WASM step its page path."""
    import exporter.streamed as streamed
    from exporter.convert import ConvertOptions, convert
    from tests.exporter.test_streamed_export import MIX, write_mixed_gguf

    path = workdir / "step-only.gguf"
    write_mixed_gguf(path, smol_gguf, {**{n: "Q4_K" for n in MIX}, "attn_v": "Q6_K", "ffn_down": "Q6_K"}, head=None,
                     vocab=None)  # its first token natively and on the step agreed on this file
    limit, streamed.PAGE_FP32_BYTES = streamed.PAGE_FP32_BYTES, 0
    try:
        return convert(str(path), workdir / "step-only-pkg", ConvertOptions(quant="int4", target="wasm", progress=False))
    finally:
        streamed.PAGE_FP32_BYTES = limit


def test_a_step_only_package_answers_on_the_step_and_refuses_onnxruntime_clearly(offline_page, step_only_package,
                                                                                  web_models, web_bundle):
    """Its greedy tokens in the page equal the same engine over the bundle's step.wasm in wasmtime, and
    the native engine loads the same package; onnxruntime-web is refused by name, before any download."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.package import load_package

    manifest = json.loads((step_only_package / "manifest.json").read_text())
    assert manifest["wasm_step"]["only"] is True and manifest["graphs"]["decoder"]["fusions"]["MatMulQ4"] > 0
    url = publish(web_models, step_only_package, "step-only")
    p = offline_page()
    info = load(p, url, device="wasm", speculativeTokens=0)
    assert info["backend"] == "wasm-step"
    greedy = {"max_tokens": 12, "temperature": 0}
    ids = p.evaluate(CHAT, {"messages": QUESTION, "return_token_ids": True, **greedy})["choices"][0]["token_ids"]
    engine = Engine(load_package(step_only_package), WasmtimeBackend(step_only_package, web_bundle / "ruvllm" / "step.wasm"),
                    speculative_tokens=0)
    assert ids == [t for o in engine.generate(messages=QUESTION, params=SamplingParams(**greedy)) for t in o.token_ids]
    native = Engine.from_package(step_only_package, verify=False).generate(messages=QUESTION, params=SamplingParams(**greedy))
    assert [t for o in native for t in o.token_ids][:1] == ids[:1]  # the same file natively: its first token
    for opts in ({"backend": "onnxruntime"}, {"device": "webgpu"}):
        p = offline_page()
        p.api()
        err = p.evaluate(LOAD_ERROR, [url, {"device": "wasm", **opts}])
        assert err and "WASM step only" in err, (opts, err)
        assert not [u for u in p.requests if "step-only" in u and u.endswith((".onnx", ".data", ".bin"))]


def test_a_native_int4_package_is_refused_in_the_page_by_name(offline_page, tiny_package, web_models):
    """A --target cpu int4 package holds its weights in RuvLLM's CPU kernels' layout (ruvllm.MatMulQ4): the page
    says to export for it, before any download, whichever backend was asked for."""
    url = publish(web_models, tiny_package("llama", "int4"), "tiny-llama-int4-cpu")
    for opts in ({}, {"backend": "onnxruntime"}):
        p = offline_page()
        p.api()
        err = p.evaluate(LOAD_ERROR, [url, {"device": "wasm", **opts}])
        assert err and "--target cpu" in err and "--target wasm" in err, (opts, err)
        assert not [u for u in p.requests if "tiny-llama-int4-cpu" in u and u.endswith((".onnx", ".data"))]
