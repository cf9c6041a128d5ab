"""LoRA adapters end to end, with PEFT as the reference: PEFT folders read as PEFT saves them, one batch
mixing adapters and the base model, prefix-cache isolation by content, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from runtime import contract as C
from runtime.core.adapters import AdapterError
from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from tests.conftest import load_hf

TOL = 1e-3
def peft_model(model_dir, folder):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(model_dir), folder).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompt: list[int], adapter: str | None = None, n: int = 8) -> list[int]:
    return [t for o in engine.generate(prompt, greedy(n), adapter=adapter) for t in o.token_ids]


PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 1000, 12, 13]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"])
def test_peft_adapters_match_peft_logits_and_greedy_tokens(arch, tiny_model_dir, tiny_package, peft_adapters):
    from runtime.backends.native import NativeBackend
    from runtime.core.adapters import read_adapter
    from runtime.core.step_batch import Chunk, build_step
    from runtime.package import load_package

    pkg = load_package(tiny_package(arch))
    base = load_hf(tiny_model_dir(arch))
    with torch.no_grad():
        base_logits = base(torch.tensor([PROMPT])).logits[0, -1].numpy()
    engine = Engine(pkg, NativeBackend(pkg), speculative_tokens=0, max_loras=3)
    backend = NativeBackend(pkg)
    backend.allocate(64, 4)
    backend.enable_lora(3, 16)
    for slot, (name, folder) in enumerate(peft_adapters(arch).items(), start=1):
        ref = peft_model(tiny_model_dir(arch), folder)
        with torch.no_grad():
            want = ref(torch.tensor([PROMPT])).logits[0, -1].numpy()
        assert np.abs(want - base_logits).max() > 50 * TOL, name  # the adapter really changes the model
        backend.set_adapter(slot, read_adapter(name, folder, pkg.config, arch))
        table = list(range(4 * slot, 4 * slot + 3))
        chunk = Chunk(PROMPT, 0, table, [table[t // 4] * 4 + t % 4 for t in range(len(PROMPT))], True,
                      top_k=5, adapter_slot=slot)
        got = backend.run(build_step([chunk], 4, want_full_logits=True)).logits[0]
        assert np.abs(got - want).max() < TOL, (name, np.abs(got - want).max())
        engine.adapters.add(name, folder)
        assert run(engine, PROMPT, name) == hf_greedy(ref, PROMPT, 8), name
    assert run(engine, PROMPT) == hf_greedy(base, PROMPT, 8)  # the base model, with adapters loaded


def test_one_batch_mixes_the_base_model_and_three_adapters(tiny_package, peft_adapters):
    """12 requests over the base model and 3 adapters, 2 adapter slots (so some wait for a slot), run
    together: each equals its solo run."""
    pkg = tiny_package("llama")
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 2000, int(rng.integers(4, 20)))] for _ in range(12)]
    names = [None, "attn4", "mlp8", "all16"] * 3
    solo = Engine.from_package(pkg, speculative_tokens=0, enable_prefix_cache=False)
    for name, folder in peft_adapters("llama").items():
        solo.adapters.add(name, folder)
    expected = [run(solo, p, a) for p, a in zip(prompts, names)]
    assert len({tuple(e) for e in expected}) == 12
    engine = Engine.from_package(pkg, speculative_tokens=0, max_loras=2)
    for name, folder in peft_adapters("llama").items():
        engine.adapters.add(name, folder)
    rids = [engine.add_request(p, greedy(), adapter=a) for p, a in zip(prompts, names)]
    got = {rid: [] for rid in rids}
    mixed = 0
    while engine.has_unfinished():
        slots = {s.adapter_slot for s in engine.scheduler.running}
        mixed = max(mixed, len(slots))
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert mixed == 3  # the base model and both slots in one step
    assert [got[r] for r in rids] == expected


def test_prefix_cache_keys_blocks_by_adapter_content(tiny_package, peft_adapters, tmp_path):
    """The same prompt under two adapters shares no blocks; one adapter under two names shares them."""
    pkg = tiny_package("llama")
    folders = peft_adapters("llama")
    shutil.copytree(folders["attn4"], tmp_path / "copy")
    engine = Engine.from_package(pkg, speculative_tokens=0, block_size=4)
    for name in ("attn4", "mlp8"):
        engine.adapters.add(name, folders[name])
    engine.adapters.add("attn4-again", tmp_path / "copy")
    prompt = list(range(10, 27))  # 4 full blocks and one token
    stats = engine.scheduler.allocator.stats
    run(engine, prompt, "attn4", 2)
    hits = stats.hits
    run(engine, prompt, "mlp8", 2)
    assert stats.hits == hits  # another adapter: nothing shared
    run(engine, prompt, None, 2)
    assert stats.hits == hits  # nor with the base model
    out = list(engine.generate(prompt, greedy(2), adapter="attn4-again"))
    assert stats.hits == hits + 4 and out[-1].cached_tokens == 16  # the same weights under another name


def test_adapter_errors_are_clear_and_leave_the_engine_serving(tiny_package, peft_adapters, tmp_path):
    pkg = tiny_package("llama")
    engine = Engine.from_package(pkg, speculative_tokens=0, max_lora_rank=8)
    folders = peft_adapters("llama")
    with pytest.raises(AdapterError, match="rank 16, more than --max-lora-rank 8"):
        engine.adapters.add("big", folders["all16"])
    with pytest.raises(AdapterError, match="no such adapter folder"):
        engine.adapters.add("nope", tmp_path / "missing")
    other = peft_adapters("qwen2")["attn4"]  # same shapes here: a wrong base is caught by its shapes...
    wrong = tmp_path / "wrong"
    shutil.copytree(other, wrong)
    cfg = json.loads((wrong / "adapter_config.json").read_text())
    from safetensors.numpy import load_file, save_file

    tensors = load_file(wrong / "adapter_model.safetensors")
    tensors = {k: np.concatenate([v, v], axis=1) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(tensors, wrong / "adapter_model.safetensors")  # ...an input width of 128 is another model
    with pytest.raises(AdapterError, match="another base model"):
        engine.adapters.add("wrong", wrong)
    cut = tmp_path / "cut"
    shutil.copytree(folders["attn4"], cut)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="corrupt safetensors|not a readable safetensors"):
        engine.adapters.add("cut", cut)
    dora = tmp_path / "dora"
    shutil.copytree(folders["attn4"], dora)
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        engine.adapters.add("dora", dora)
    with pytest.raises(Exception, match="no adapter named 'nope'"):
        engine.add_request([5, 6, 7], greedy(), adapter="nope")
    engine.adapters.add("attn4", folders["attn4"])  # and it still serves
    assert len(run(engine, PROMPT, "attn4", 3)) == 3
    assert engine.adapters.remove("attn4") and "attn4" not in engine.adapters


def test_server_serves_adapters_by_model_and_hot_loads_them_while_requests_stream(tiny_package, peft_adapters,
                                                                                   tmp_path):
    """vLLM's interface: --lora-modules, `model` selects an adapter, /v1/models lists it with its parent,
    load and unload while 8 requests stream; a request on an unloaded adapter gets 404, bad loads 400."""
    import asyncio

    import httpx
    from openai import OpenAI

    from runtime.serve.server import create_app, load_models
    from tests.runtime.test_server import LiveServer

    pkg = tiny_package("llama")
    folders = peft_adapters("llama")
    solo = Engine.from_package(pkg, speculative_tokens=0, enable_prefix_cache=False)
    for name, folder in folders.items():
        solo.adapters.add(name, folder)
    prompt = "one two three four"
    want = {a: solo.tokenizer.decode(run(solo, solo.encode_prompt(prompt), a, 12)) for a in (None, "attn4", "mlp8")}
    assert len(set(want.values())) == 3
    models = load_models([str(pkg)], "cpu", 16, {"speculative_tokens": 0}, {"attn4": str(folders["attn4"])})
    live = LiveServer(create_app(models, lora_roots=[str(folders["mlp8"].parent)]))
    try:
        base = next(iter(models))
        client = OpenAI(base_url=live.url + "/v1", api_key="unused")
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {base, "attn4"} and cards["attn4"].model_extra["parent"] == base

        def complete(model: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

        assert complete("attn4") == want["attn4"] and complete(base) == want[None]

        async def streams_during_load() -> list[str]:
            async def one(model: str) -> str:
                text = ""
                async with httpx.AsyncClient(timeout=120) as http:
                    async with http.stream("POST", live.url + "/v1/completions", json={
                            "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                text += json.loads(line[6:])["choices"][0]["text"]
                return text

            tasks = [asyncio.create_task(one(m)) for m in [base, "attn4"] * 4]
            await asyncio.sleep(0.05)
            async with httpx.AsyncClient(timeout=120) as http:
                r = await http.post(live.url + "/v1/load_lora_adapter",
                                    json={"lora_name": "mlp8", "lora_path": str(folders["mlp8"])})
                assert r.status_code == 200, r.text
            return await asyncio.gather(*tasks)

        assert asyncio.run(streams_during_load()) == [want[None], want["attn4"]] * 4
        assert complete("mlp8") == want["mlp8"]
        # unload while one request is in flight: it finishes; new ones get 404
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", live.url + "/v1/completions", json={
                    "model": "mlp8", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                assert http.post(live.url + "/v1/unload_lora_adapter", json={"lora_name": "mlp8"}).status_code == 200
                text = json.loads(first[6:])["choices"][0]["text"] + "".join(
                    json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {"))
            assert text == want["mlp8"]
            r = http.post(live.url + "/v1/completions", json={"model": "mlp8", "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert http.post(live.url + "/v1/unload_lora_adapter", json={"lora_name": "mlp8"}).status_code == 404
            bad = http.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "adapter_not_found"
            bad = http.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "attn4", "lora_path": str(tmp_path)})
            assert bad.status_code == 400 and "already loaded" in bad.json()["error"]["message"]
            assert http.post(live.url + "/v1/load_lora_adapter", content=b"{").status_code == 400
        assert complete(base) == want[None] and complete("attn4") == want["attn4"]  # nothing else disturbed
    finally:
        live.stop()


def test_cli_generate_with_lora(tiny_package, peft_adapters):
    from tests.conftest import run_cli

    pkg = tiny_package("llama")
    folder = peft_adapters("llama")["attn4"]
    proc = run_cli("generate", str(pkg), "one two three", "--raw", "--lora", str(folder), "--temperature", "0",
                   "--max-tokens", "6", "--json", "--speculative-tokens", "0")
    assert proc.returncode == 0, proc.stderr
    solo = Engine.from_package(pkg, speculative_tokens=0)
    solo.adapters.add("a", folder)
    ids = [t for o in solo.generate("one two three", SamplingParams(max_tokens=6, temperature=0), adapter="a")
           for t in o.token_ids]
    assert json.loads(proc.stdout)["token_ids"] == ids


def test_adapters_on_an_int4_package_run_beside_the_base_graph(tiny_package, peft_adapters):
    """The LoRA graph opens as a second session on the same KV pool (on RuvLLM's kernels where the host has
    them, as the base graph); on an int4 package a batch mixing base and adapter rows gives each its solo
    tokens."""
    folder = peft_adapters("llama")["attn4"]
    engine = Engine.from_package(tiny_package("llama", "int4"), speculative_tokens=0)
    engine.adapters.add("a", folder)
    backend = engine.backend
    assert backend.lora_runner is not backend.runner
    from runtime.backends import kernel_library

    if kernel_library.library()[0] is not None:  # every target's delta on ruvllm.LoraDelta
        assert backend.lora_kernel == ("ruvllm.LoraDelta (14 targets), 2 attentions' q, k and v (ruvllm.LoraSplit), "
                                       "adapters in fp16"), backend.lora_kernel
    solo = {a: run(engine, PROMPT, a, 6) for a in (None, "a")}
    assert solo[None] != solo["a"]
    rids = {engine.add_request(PROMPT, greedy(6), adapter=a): a for a in (None, "a", None, "a")}
    got = {r: [] for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert all(got[r] == solo[a] for r, a in rids.items())


def mixed_step_logits(backend):
    """The logits of one step of three prompts, on adapter slot 1, the base model and slot 2 (block size 4)."""
    from runtime.core.step_batch import Chunk, build_step

    chunks = []
    for row, slot in enumerate((1, 0, 2)):
        table = list(range(8 * row, 8 * row + 3))
        chunks.append(Chunk(PROMPT, 0, table, [table[t // 4] * 4 + t % 4 for t in range(len(PROMPT))], True,
                            top_k=5, adapter_slot=slot))
    return backend.run(build_step(chunks, 4, want_full_logits=True)).logits


@pytest.mark.parametrize("quant", ["int4", "int8", "fp32"])
def test_lora_delta_kernel_equals_the_graphs_own_path(tiny_package, peft_adapters, monkeypatch, quant):
    """ruvllm.LoraDelta against the LoRA graph's Gemm/Mul/MatMul/Add on the same package, two adapters and
    the base model in one step: an int4 AWQ package (up_proj's delta carries an output scale), an int8 RTN
    and an fp32 one, whose MLPs (unscaled) run as ruvllm.LoraSwiGLU, the gate and up deltas and the SwiGLU
    fused; each attention's q, k and v deltas run as one ruvllm.LoraSplit. On the quantized packages the
    kernels read the adapters in fp16, and the graph's own path is given the same fp16-rounded numbers."""
    from runtime.backends import kernel_library
    from runtime.backends.native import NativeBackend
    from runtime.core.adapters import read_adapter
    from runtime.package import load_package

    if kernel_library.library()[0] is None:
        pytest.skip("RuvLLM's kernels do not build here")
    pkg = load_package(tiny_package("llama", quant))
    folders = peft_adapters("llama")
    logits = []
    for ops in (None, "without LoraDelta"):
        if ops:
            all_ops = kernel_library.operators()
            monkeypatch.setattr(kernel_library, "operators", lambda lib=None, o=all_ops: o - {"LoraDelta"})
        backend = NativeBackend(pkg)
        backend.allocate(64, 4)
        backend.enable_lora(2, 16)
        assert (backend.lora_kernel is None) == bool(ops)
        if not ops:
            assert ("LoraSwiGLU" in backend.lora_kernel) == (quant != "int4"), backend.lora_kernel
            assert ("fp16" in backend.lora_kernel) == (quant != "fp32"), backend.lora_kernel
            assert "LoraSplit" in backend.lora_kernel, backend.lora_kernel
        for slot, name in ((1, "all16"), (2, "mlp8")):
            backend.set_adapter(slot, read_adapter(name, folders[name], pkg.config, "llama"))
        held = {a.dtype for pair in backend.adapters.stacked.values() for a in pair}
        assert held == {np.dtype(np.float16 if quant != "fp32" and not ops else np.float32)}
        if ops and quant != "fp32":
            for a, b in backend.adapters.stacked.values():
                a[:], b[:] = a.astype(np.float16), b.astype(np.float16)
        logits.append(mixed_step_logits(backend))
    assert np.abs(logits[0] - logits[1]).max() < 1e-4 * max(1.0, np.abs(logits[1]).max())


@pytest.mark.parametrize("quant", ["int4", "fp32"])
def test_targets_no_held_adapter_adapts_are_skipped_with_bit_equal_logits(tiny_package, peft_adapters, quant):
    """A step over adapters that leave targets out (q,v and an MLP-only one) binds those targets with no
    columns, and ruvllm's LoRA kernels pass their projections through: the logits are bit-equal to binding
    every column (whose deltas for those targets are zero)."""
    from runtime.backends import kernel_library
    from runtime.backends.native import NativeBackend
    from runtime.core.adapters import read_adapter
    from runtime.package import load_package

    if kernel_library.library()[0] is None:
        pytest.skip("RuvLLM's kernels do not build here")
    pkg = load_package(tiny_package("llama", quant))
    folders = peft_adapters("llama")
    backend = NativeBackend(pkg)
    backend.allocate(64, 4)
    backend.enable_lora(2, 16)
    for slot, name in ((1, "attn4"), (2, "mlp8")):
        backend.set_adapter(slot, read_adapter(name, folders[name], pkg.config, "llama"))
    assert backend._lora_all_fused
    pairs = lambda *targets: {(layer, t) for layer in range(2) for t in targets}  # noqa: E731
    assert backend.adapters.idle(backend.adapters.columns([2])) == pairs("k_proj", "o_proj")
    assert backend.adapters.idle(backend.adapters.columns([1])) == pairs("k_proj", "o_proj", "gate_proj",
                                                                          "up_proj", "down_proj")
    skipped = mixed_step_logits(backend)
    assert backend._lora_columns[1] == pairs("k_proj", "o_proj")
    backend._lora_all_fused = False  # every column bound, as a graph without the kernels needs
    every = mixed_step_logits(backend)
    assert backend._lora_columns[1] == frozenset()
    assert np.array_equal(skipped, every)
    # a step of slot 1 alone (q, v): five targets idle, the same logits as with their columns
    from runtime.core.step_batch import Chunk, build_step

    def alone():
        table = [0, 1, 2]
        return backend.run(build_step([Chunk(PROMPT, 0, table, [table[t // 4] * 4 + t % 4 for t in range(len(PROMPT))],
                                             True, top_k=5, adapter_slot=1)], 4, want_full_logits=True)).logits.copy()
    every = alone()
    backend._lora_all_fused = True
    assert np.array_equal(alone(), every) and len(backend._lora_columns[1]) == 10


def test_layers_a_users_adapter_leaves_out_are_skipped_with_bit_equal_logits(tiny_package, tmp_path):
    """A user's adapter of the last layer alone (PEFT's layers_to_transform) binds the other layer with no
    columns on every target: the logits are bit-equal to binding every column."""
    from runtime.backends import kernel_library
    from runtime.backends.lora_gradients import DenseDecoder
    from runtime.backends.micro_lora import MicroLora
    from runtime.backends.native import NativeBackend
    from runtime.core.adapters import read_adapter
    from runtime.core.step_batch import Chunk, build_step
    from runtime.package import load_package

    if kernel_library.library()[0] is None:
        pytest.skip("RuvLLM's kernels do not build here")
    pkg = load_package(tiny_package("llama", "int4"))
    user = MicroLora(DenseDecoder.from_package(pkg), tuple(C.LORA_TARGETS), rank=2, lr=0.3, layers=[1])
    user.learn(PROMPT * 4, chunk=16, epochs=2)
    backend = NativeBackend(pkg)
    backend.allocate(64, 4)
    backend.enable_lora(1, 4)
    backend.set_adapter(1, read_adapter("top", user.save_peft(tmp_path / "top"), pkg.config, "llama"))

    def step():
        table = [0, 1, 2]
        return backend.run(build_step([Chunk(PROMPT, 0, table, [table[t // 4] * 4 + t % 4 for t in range(len(PROMPT))],
                                             True, top_k=5, adapter_slot=1)], 4, want_full_logits=True)).logits.copy()
    skipped = step()
    assert backend._lora_columns[1] == {(0, t) for t in C.LORA_TARGETS}
    backend._lora_all_fused = False
    every = step()
    assert backend._lora_columns[1] == frozenset() and np.array_equal(skipped, every)


def test_a_one_set_lora_graph_still_fuses_and_gives_the_same_logits(tiny_package, peft_adapters, tmp_path):
    """LoRA graphs exported before per-module weight sets (contract.LORA_PER_MODULE) multiply every target by
    lora_weights itself: they still fuse into the same operators (the kernels' module 0, set min(t, 0)) and
    give the same logits as today's graph."""
    import hashlib

    import onnx

    from runtime import contract as C
    from runtime.backends import graph_rewrite, kernel_library
    from runtime.backends.native import NativeBackend
    from runtime.core.adapters import read_adapter
    from runtime.package import load_package

    if kernel_library.library()[0] is None:
        pytest.skip("RuvLLM's kernels do not build here")
    new = tiny_package("llama", "fp32")
    old = tmp_path / "one-set"
    shutil.copytree(new, old)
    graph = onnx.load(str(old / "model_lora.onnx"), load_external_data=False)
    sets = graph_rewrite.lora._weight_sets(graph, list(graph.graph.node))
    assert len(sets) == 14  # two layers' seven targets
    for node in graph.graph.node:
        node.input[:] = [C.LORA_WEIGHTS if name in sets else name for name in node.input]
    graph_rewrite.nodes._drop_dead(graph)
    onnx.save(graph, str(old / "model_lora.onnx"))
    manifest = json.loads((old / "manifest.json").read_text())
    data = (old / "model_lora.onnx").read_bytes()
    manifest["files"]["model_lora.onnx"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    del manifest["lora"][C.LORA_PER_MODULE]
    (old / "manifest.json").write_text(json.dumps(manifest))

    folders = peft_adapters("llama")
    logits, kernels = [], []
    for path in (new, old):
        pkg = load_package(path)
        backend = NativeBackend(pkg)
        backend.allocate(64, 4)
        backend.enable_lora(2, 16)
        kernels.append(backend.lora_kernel)
        for slot, name in ((1, "all16"), (2, "mlp8")):
            backend.set_adapter(slot, read_adapter(name, folders[name], pkg.config, "llama"))
        logits.append(mixed_step_logits(backend))
    assert kernels[0] == kernels[1] and "LoraSplit" in kernels[0] and "LoraSwiGLU" in kernels[0], kernels
    assert np.abs(logits[0] - logits[1]).max() < 1e-5
