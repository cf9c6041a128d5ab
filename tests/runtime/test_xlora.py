"""X-LoRA end to end, with PEFT's XLoraModel as the reference: the classifier's per-token mixing weights,
the logits and greedy tokens, X-LoRA requests batched with plain adapters and the base model, and
clear errors for what is not supported."""

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
from tests.conftest import XLORA_VARIANTS, load_hf

TOL = 1e-3
PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 1000, 12, 13]
def xlora_layers(xmodel) -> dict[tuple[int, str], object]:
    """PEFT's XLoraLayers by the (decoder layer, target) they adapt."""
    from peft.tuners.xlora.layer import XLoraLayer

    found = {}
    for name, module in xmodel.base_model.lora_model.model.named_modules():
        layer = getattr(module.forward, "__self__", None)
        if isinstance(layer, XLoraLayer):
            parts = name.split(".")
            found[int(parts[parts.index("layers") + 1]), parts[-1]] = layer
    return found


def peft_forward(xmodel, ids: list[int]) -> tuple[np.ndarray, dict[tuple[int, str], np.ndarray]]:
    """PEFT's logits [seq, vocab] and each LoRA layer's mixing weights [seq, experts] by (layer, target)
    (the same for every one unless layerwise_scalings)."""
    with torch.no_grad():
        logits = xmodel(input_ids=torch.tensor([ids])).logits[0].numpy()
    scalings = xmodel.get_latest_scalings()  # [1, seq, lora layers, experts]
    layers = xlora_layers(xmodel)
    assert scalings.shape[2] == len(layers)
    if not xmodel.xlora_config.layerwise_scalings:
        assert torch.equal(scalings, scalings[:, :, :1].expand_as(scalings))
    return logits, {k: layer.get_maybe_topk_scalings(scalings)[0].numpy() for k, layer in layers.items()}


def peft_greedy(xmodel, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):  # PEFT's X-LoRA keeps no KV cache: each token recomputes the sequence
        with torch.no_grad():
            out.append(int(xmodel(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompt: list[int], adapter: str | None = None, n: int = 8) -> list[int]:
    return [t for o in engine.generate(prompt, greedy(n), adapter=adapter) for t in o.token_ids]


@pytest.mark.parametrize("variant, arch", [(v, "llama") for v in XLORA_VARIANTS] + [("layerwise", "phi3")])
def test_xlora_matches_peft_mixing_logits_and_greedy_tokens(variant, arch, tiny_model_dir, tiny_package,
                                                             xlora_models, monkeypatch):
    """Phi-3's LoRA layers come in another module order (o_proj, then the fused qkv_proj), which the
    layerwise weights follow."""
    from runtime.backends.native import NativeBackend
    from runtime.core.adapters import FUSED_TARGETS
    from runtime.package import load_package

    xmodel, folder = xlora_models(variant, arch)
    want_logits, want_weights = peft_forward(xmodel, PROMPT)
    with torch.no_grad():
        base = load_hf(tiny_model_dir(arch))(torch.tensor([PROMPT])).logits[0, -1].numpy()
    assert np.abs(want_logits[-1] - base).max() > 50 * TOL  # the experts really change the model
    pkg = load_package(tiny_package(arch))
    engine = Engine(pkg, NativeBackend(pkg), speculative_tokens=0, max_loras=3)
    info = engine.adapters.add("mix", folder)
    assert info.kind == "xlora" and [e.rank for e in info.experts] == [4, 8, 16]
    engine.add_request(PROMPT, greedy(1), adapter="mix")
    prepared = engine.prepare_step()
    prepared.batch.want_full_logits = True
    got = engine.backend.run(prepared.batch)
    weights = np.array(engine.backend.last_xlora_weights[0])  # [tokens, experts] (layerwise: [.., sets])
    if variant == "layerwise":
        assert weights.shape == (len(PROMPT), 3, C.lora_modules(pkg.config["num_layers"]))
        per_layer = {(layer, t): weights[:, :, C.lora_module(layer, part)] for layer, t in want_weights
                     for part in FUSED_TARGETS.get(t, (t,))}  # a fused module's targets: the same weights
        assert all(np.array_equal(per_layer[k], weights[:, :, C.lora_module(k[0], p)])
                   for k in per_layer for p in FUSED_TARGETS.get(k[1], (k[1],)))
        assert len({np.round(w, 4).tobytes() for w in per_layer.values()}) > len(per_layer) // 2  # really per layer
    else:
        per_layer = {k: weights for k in want_weights}
    for k, want in want_weights.items():
        assert want.shape == (len(PROMPT), 3)
        assert np.abs(per_layer[k] - want).max() < TOL, (k, np.abs(per_layer[k] - want).max())
    assert weights.std(axis=0).max() > 0.05  # tokens really weigh the experts differently
    assert np.abs(got.logits[0] - want_logits[-1]).max() < TOL, np.abs(got.logits[0] - want_logits[-1]).max()
    engine.finish_step(prepared, got)
    assert run(engine, PROMPT, "mix") == peft_greedy(xmodel, PROMPT, 8)
    if variant == "layerwise" and engine.backend.lora_kernel:  # and the graph's own per-target gathers alike
        from runtime.backends import kernel_library

        assert "LoraDelta" in engine.backend.lora_kernel
        all_ops = kernel_library.operators()
        monkeypatch.setattr(kernel_library, "operators", lambda lib=None, o=all_ops: o - {"LoraDelta"})
        plain = Engine(pkg, NativeBackend(pkg), speculative_tokens=0, max_loras=3)
        plain.adapters.add("mix", folder)
        assert plain.backend.lora_kernel is None
        assert run(plain, PROMPT, "mix") == peft_greedy(xmodel, PROMPT, 8)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_xlora_batched_with_adapters_and_the_base_model_equals_solo_runs(tiny_package, peft_adapters, xlora_models,
                                                                         kv_dtype):
    """Twelve requests over the base model, a plain adapter and two X-LoRAs (one layerwise; their experts
    include that adapter) run together with a small KV pool (so some wait or are preempted): each equals its
    solo run, on an fp32 pool and on a (two-tier, where the kernel runs) int8 one."""
    pkg = tiny_package("llama")
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, 2000, int(rng.integers(4, 20)))] for _ in range(12)]
    names = [None, "attn4", "mix", "layerwise"] * 3

    def engine(**kw) -> Engine:
        e = Engine.from_package(pkg, speculative_tokens=0, max_loras=4, kv_dtype=kv_dtype, **kw)
        e.adapters.add("attn4", peft_adapters("llama")["attn4"])
        e.adapters.add("mix", xlora_models("dense")[1])
        e.adapters.add("layerwise", xlora_models("layerwise")[1])
        return e

    solo = engine()
    want = [run(solo, p, a) for p, a in zip(prompts, names)]
    together = engine(num_blocks=10, max_batch_tokens=32)
    ids = [together.add_request(p, greedy(), adapter=a) for p, a in zip(prompts, names)]
    got = {i: [] for i in ids}
    while together.has_unfinished():
        for out in together.step():
            got[out.request_id].extend(out.token_ids)
    assert [got[i] for i in ids] == want
    assert together.stats.preemptions > 0 or together.stats.peak_running < 12  # the pool was really tight


def drop_classifier_layer_0(folder) -> None:
    """The classifier's first Linear gone from every file it may be in: PEFT 0.21 kept it in the experts'
    subfolders (as `layers.weight`), 0.22 in the adapter's own file."""
    from safetensors.torch import load_file, save_file

    for sub in [d for d in folder.iterdir() if d.is_dir()]:
        shutil.rmtree(sub)
    weights = folder / "adapter_model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if "internal_xlora_classifier.layers.0." not in k}
    save_file(kept, weights)


def test_xlora_errors_are_clear(tiny_package, xlora_models, tmp_path):
    _, folder = xlora_models("dense")
    pkg = tiny_package("llama")
    engine = Engine.from_package(pkg, speculative_tokens=0, max_loras=3)

    def variant(name: str, edit) -> str:
        dst = tmp_path / name
        shutil.copytree(folder, dst)
        edit(dst)
        return str(dst)

    def config(**changes):
        def edit(dst):
            cfg = json.loads((dst / "adapter_config.json").read_text())
            cfg.update(changes)
            (dst / "adapter_config.json").write_text(json.dumps(cfg))
        return edit

    cases = {
        # a classifier for one set of weights, called layerwise: its size says it is not
        "layerwise": (config(layerwise_scalings=True), r"is \[3, 16\], expected \[42, 16\] \(3 experts, layerwise "
                                                       "over 14 LoRA layers"),
        "hidden": (config(hidden_size=7), "hidden size 7"),
        "expert": (config(adapters={"gone": str(tmp_path / "nowhere")}), "expert 'gone' is not at"),
        "classifier": (drop_classifier_layer_0, "classifier's layer 0 is missing"),
    }
    for name, (edit, match) in cases.items():
        with pytest.raises(AdapterError, match=match):
            engine.adapters.add(name, variant(name, edit))
    old = tmp_path / "format-2-package"  # a LoRA graph exported with one set of weights for every target
    shutil.copytree(pkg, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["lora"][C.LORA_PER_MODULE]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AdapterError, match="cannot weigh per layer .* re-export the package"):
        Engine.from_package(old, speculative_tokens=0, max_loras=3).adapters.add("lw", xlora_models("layerwise")[1])
    small = Engine.from_package(pkg, speculative_tokens=0, max_loras=2)
    with pytest.raises(AdapterError, match="3 experts, more than --max-loras 2"):
        small.adapters.add("mix", folder)
    assert run(engine, PROMPT) == run(Engine.from_package(pkg, speculative_tokens=0), PROMPT)  # still serving


def test_xlora_prefix_cache_serves_both_passes(tiny_package, xlora_models):
    """A prompt's blocks cached by an X-LoRA request serve its next request, both passes' K/V (the scaling
    pass's on a chain of its own), with PEFT's tokens; the base model on the same prompt shares none."""
    xmodel, folder = xlora_models("dense")
    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=0, max_loras=4, block_size=4)
    engine.adapters.add("mix", folder)
    prompt = PROMPT + [33, 44, 55, 66, 77]  # 16 tokens: 3 full blocks cacheable (the last token is computed)

    def go(adapter):
        outs = list(engine.generate(prompt, greedy(), adapter=adapter))
        return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens

    first, cached = go("mix")
    assert cached == 0
    blocks = engine.scheduler.allocator.num_cached
    assert blocks >= 2 * 3  # the real pass's blocks and the scaling pass's
    again, cached = go("mix")
    assert cached == 12 and again == first == peft_greedy(xmodel, prompt, 8)
    _, cached = go(None)
    assert cached == 0  # another adapter id, another chain


def test_xlora_drafts_are_verified_through_both_passes(tiny_package, xlora_models, monkeypatch):
    """Prompt-lookup drafts on an X-LoRA sequence: its scaling pass and classifier run over the drafted
    tokens too, so accepted drafts leave both passes' K/V as plain decoding would. Drafts are forced
    to be right (the plain run's own tokens, mostly) so that many are accepted; the tokens must not change."""
    from runtime.core import speculative

    xmodel, folder = xlora_models("dense")
    pkg = tiny_package("llama")

    def engine(spec: int) -> Engine:
        e = Engine.from_package(pkg, speculative_tokens=spec, max_loras=4)
        e.adapters.add("mix", folder)
        return e

    want = run(engine(0), PROMPT, "mix", n=16)
    truth = PROMPT + want

    def draft(self, tokens, k):  # the true continuation, with every fourth drafted token wrong
        nxt = truth[len(tokens):len(tokens) + k]
        return [t if (len(tokens) + i) % 4 else t + 1 for i, t in enumerate(nxt)]

    monkeypatch.setattr(speculative.PromptLookup, "draft", draft)
    e = engine(3)
    assert run(e, PROMPT, "mix", n=16) == want == peft_greedy(xmodel, PROMPT, 16)
    assert e.stats.accepted_draft_tokens >= 4 and e.stats.draft_tokens > e.stats.accepted_draft_tokens
