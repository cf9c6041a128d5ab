"""Exported fp32 graphs against transformers logits: prefill, decode, several blocks, mixed batches, LoRA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.backends.native import NativeBackend
from runtime.package import load_package
from tests.conftest import TINY_ARCHS
from tests.stepping import Stepper

TOL = 1e-3


def hf_last_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float().numpy()


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_and_decode_match_transformers(arch, tiny_model_dir, tiny_package):
    model = load_hf(tiny_model_dir(arch))
    backend = NativeBackend(load_package(tiny_package(arch)))
    stepper = Stepper(backend, block_size=4)  # 13 prompt tokens + 8 decodes span 6 blocks
    rng = np.random.default_rng(0)
    seq = [int(t) for t in rng.integers(3, model.config.vocab_size, 13)]
    res = stepper.step({0: seq})
    assert np.abs(res.logits[0] - hf_last_logits(model, seq)).max() < TOL
    for _ in range(8):
        seq.append(int(np.argmax(res.logits[0])))
        res = stepper.step({0: [seq[-1]]})
        ref = hf_last_logits(model, seq)
        assert np.abs(res.logits[0] - ref).max() < TOL
        assert res.topk_ids[0][0] == int(np.argmax(ref))


@pytest.mark.parametrize("arch,target", [(arch, "cpu") for arch in TINY_ARCHS] + [("mistral", "webgpu")])
def test_mixed_batch_of_different_lengths(arch, target, tiny_model_dir, tiny_package):
    """Two sequences of different lengths, then one in prefill while the other decodes, in one step.
    The webgpu target writes the step's K/V with ScatterND instead of TensorScatter."""
    model = load_hf(tiny_model_dir(arch))
    pkg = load_package(tiny_package(arch, "fp32", target))
    assert pkg.manifest["kv_cache"]["write"] == ("ScatterND" if target == "webgpu" else "TensorScatter")
    backend = NativeBackend(pkg)
    stepper = Stepper(backend, block_size=4)
    rng = np.random.default_rng(1)
    a = [int(t) for t in rng.integers(3, model.config.vocab_size, 11)]
    b = [int(t) for t in rng.integers(3, model.config.vocab_size, 5)]
    res = stepper.step({0: a, 1: b})
    for row, seq in enumerate((a, b)):
        assert np.abs(res.logits[row] - hf_last_logits(model, seq)).max() < TOL
    # a decodes one token while b gets a 9-token chunk (chunked prefill mixed with decode)
    a.append(int(np.argmax(res.logits[0])))
    extra = [int(t) for t in rng.integers(3, model.config.vocab_size, 9)]
    b.extend(extra)
    res = stepper.step({0: [a[-1]], 1: extra})
    for row, seq in enumerate((a, b)):
        assert np.abs(res.logits[row] - hf_last_logits(model, seq)).max() < TOL
    # a long decode run past the sliding window (mistral: 24) and across many blocks
    for _ in range(20):
        a.append(int(np.argmax(res.logits[0])))
        b.append(int(np.argmax(res.logits[1])))
        res = stepper.step({0: [a[-1]], 1: [b[-1]]})
    for row, seq in enumerate((a, b)):
        assert np.abs(res.logits[row] - hf_last_logits(model, seq)).max() < TOL


def test_shared_prefix_blocks_are_read_through_block_tables(tiny_model_dir, tiny_package):
    """Two sequences pointing at the same full blocks (prefix sharing) both match transformers."""
    model = load_hf(tiny_model_dir("llama"))
    backend = NativeBackend(load_package(tiny_package("llama")))
    stepper = Stepper(backend, block_size=4)
    rng = np.random.default_rng(2)
    prefix = [int(t) for t in rng.integers(3, model.config.vocab_size, 8)]  # two full blocks
    stepper.step({0: prefix})
    # sequence 1 reuses sequence 0's two blocks and only computes its own suffix
    shared = stepper.blocks[0][:2]
    stepper.blocks[1] = list(shared)
    for blk in shared:
        stepper.alloc.retain(blk)
    stepper.length[1] = 8
    tail_a = [int(t) for t in rng.integers(3, model.config.vocab_size, 3)]
    tail_b = [int(t) for t in rng.integers(3, model.config.vocab_size, 6)]
    res = stepper.step({0: tail_a, 1: tail_b})
    assert np.abs(res.logits[0] - hf_last_logits(model, prefix + tail_a)).max() < TOL
    assert np.abs(res.logits[1] - hf_last_logits(model, prefix + tail_b)).max() < TOL


def peft_adapter(model_dir, config: dict, folder) -> tuple:
    """A random rank-4 peft LoRA on every target of the model in model_dir, saved by PEFT into `folder`: (peft
    model, the runtime's stacked adapter inputs for it, read by its one PEFT reader, in slot 1)."""
    from peft import LoraConfig, get_peft_model

    from runtime import contract as C
    from runtime.backends.adapter_weights import AdapterTensors
    from runtime.core.adapters import read_adapter

    torch.manual_seed(7)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(C.LORA_TARGETS), init_lora_weights=False)
    peft_model = get_peft_model(load_hf(model_dir), cfg).eval()
    peft_model.save_pretrained(str(folder))
    tensors = AdapterTensors(config, max_loras=1, max_rank=4)
    tensors.put(1, read_adapter("peft", folder, config, config.get("architecture", "")))
    return peft_model, tensors


def test_lora_inputs_match_peft(tiny_model_dir, tiny_package, tmp_path):
    """The LoRA graph with a peft adapter active equals peft in transformers; a row with weight 0 equals base."""
    from runtime import contract as C

    base = load_hf(tiny_model_dir("llama"))
    package = load_package(tiny_package("llama"))
    peft_model, tensors = peft_adapter(tiny_model_dir("llama"), package.config, tmp_path / "peft")

    backend = NativeBackend(package, lora=True)
    stepper = Stepper(backend, block_size=4)
    rng = np.random.default_rng(3)
    a = [int(t) for t in rng.integers(3, base.config.vocab_size, 9)]
    b = [int(t) for t in rng.integers(3, base.config.vocab_size, 6)]
    lora_inputs = tensors.views(4)
    weights = tensors.mixing([1] * len(a) + [0] * len(b), 4)  # row a on the adapter, b off
    res = stepper.step({0: a, 1: b}, extra_inputs={**lora_inputs, C.LORA_WEIGHTS: weights})
    with_lora, without = hf_last_logits(peft_model, a), hf_last_logits(base, b)
    assert np.abs(res.logits[0] - with_lora).max() < TOL
    assert np.abs(res.logits[1] - without).max() < TOL
    assert np.abs(with_lora - hf_last_logits(base, a)).max() > 10 * TOL  # the adapter really changes a
    for _ in range(3):  # decode steps keep using the adapter's K/V
        a.append(int(np.argmax(res.logits[0])))
        res = stepper.step({0: [a[-1]]}, extra_inputs={**lora_inputs, C.LORA_WEIGHTS: tensors.mixing([1], 4)})
        assert np.abs(res.logits[0] - hf_last_logits(peft_model, a)).max() < TOL


def test_in_graph_penalties_temperature_and_bias(tiny_package):
    """The processed top-K equals the same processing done in numpy on the raw logits."""
    from runtime.core.step_batch import Chunk, PenaltyState, build_step

    backend = NativeBackend(load_package(tiny_package("llama")))
    backend.allocate(16, 4)
    prompt = [5, 6, 7, 5, 9]
    pen = PenaltyState()
    pen.add_prompt(prompt)
    pen.add_generated(9)
    pen.add_generated(9)
    pen.add_bias({11: 5.0, 12: -100.0})
    chunk = Chunk(tokens=prompt, start=0, block_table=[0, 1], kv_slots=list(range(5)), want_logits=True,
                  temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                  penalties=pen, top_k=20)
    res = backend.run(build_step([chunk], 4, want_full_logits=True))
    logits = res.logits[0].astype(np.float64).copy()
    for tid, seen, count, bias in zip(pen.ids, pen.seen, pen.counts, pen.bias):
        x = logits[tid]
        if seen:
            x = x / 1.3 if x > 0 else x * 1.3
        x -= 0.5 * (count > 0) + 0.25 * count
        logits[tid] = x + bias
    logits /= 0.7
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    order = np.argsort(-logprobs)[:20]
    assert res.topk_ids[0] == order.tolist()
    assert np.allclose(res.topk_logprobs[0], logprobs[order], atol=1e-4)
    assert 12 not in res.topk_ids[0]


def test_a_step_may_hold_more_tokens_than_the_context(tiny_model_dir, tiny_package):
    """Three 150-token prompts in one step (450 flat tokens > the 256-token context) still match."""
    model = load_hf(tiny_model_dir("qwen2"))
    backend = NativeBackend(load_package(tiny_package("qwen2")))
    stepper = Stepper(backend, block_size=16, num_blocks=64)
    rng = np.random.default_rng(4)
    seqs = [[int(t) for t in rng.integers(3, model.config.vocab_size, 150)] for _ in range(3)]
    res = stepper.step({i: s for i, s in enumerate(seqs)})
    for i, s in enumerate(seqs):
        assert np.abs(res.logits[i] - hf_last_logits(model, s)).max() < TOL


def test_phi3_longrope_is_exported_at_its_original_context(tiny_model_dir, workdir):
    """Phi-3.5's longrope uses short factors up to its original context and long ones past it: the export
    keeps the short ones (and that context), so prompts within it equal transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporter.convert import ConvertOptions, convert
    from tests.conftest import tiny_config

    out = workdir / "tiny-phi3-longrope"
    if not out.exists():
        cfg = tiny_config("phi3", 49152)
        half = cfg.hidden_size // cfg.num_attention_heads // 2
        cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                               "short_factor": [1.0 + 0.1 * i for i in range(half)],
                               "long_factor": [2.0 + 0.5 * i for i in range(half)]}
        cfg.original_max_position_embeddings = 64
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny_model_dir("phi3")).save_pretrained(out)
    model = load_hf(out)
    pkg = load_package(convert(str(out), workdir / "pkg-phi3-longrope", ConvertOptions(quant="fp32", progress=False)))
    assert pkg.manifest["config"]["max_positions"] == 64
    assert pkg.manifest["architecture"] == "mistral" and pkg.manifest["provenance"]["source_architecture"] == "phi3"
    stepper = Stepper(NativeBackend(pkg), block_size=4)
    seq = [int(t) for t in np.random.default_rng(2).integers(3, model.config.vocab_size, 30)]
    res = stepper.step({0: seq})
    assert np.abs(res.logits[0] - hf_last_logits(model, seq)).max() < TOL
