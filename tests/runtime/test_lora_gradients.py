"""The instant loop's hand-written backward (runtime/backends/lora_gradients.py) against PEFT's autograd."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backends.lora_gradients import DenseDecoder, Lora, loss_and_grads
from runtime.errors import PackageError
from runtime.package import load_package

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loss_and_factor_gradients_equal_peft_autograd(arch, tiny_model_dir, tiny_package):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), torch_dtype=torch.float32).eval()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    factors = {}
    for name, module in peft.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            layer, target = int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[1]
            with torch.no_grad():  # B starts at zero in PEFT: give it numbers, or A's gradient is zero
                module.lora_B["default"].weight.normal_(0, 0.05)
            factors[(layer, target)] = (module.lora_A["default"].weight, module.lora_B["default"].weight)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.config.vocab_size, 40).tolist()
    x = torch.tensor([ids])
    want = torch.nn.functional.cross_entropy(peft(x).logits[0, :-1], x[0, 1:])
    want.backward()

    dec = DenseDecoder.from_package(load_package(tiny_package(arch)))
    lora = Lora({k: (a.detach().numpy().copy(), b.detach().numpy().copy()) for k, (a, b) in factors.items()}, scale=2.0)
    loss, grads = loss_and_grads(dec, ids, lora)
    assert loss == pytest.approx(want.item(), rel=1e-5)
    assert set(grads) == set(factors)
    for key, (a, b) in factors.items():
        for got, ref in zip(grads[key], (a.grad.numpy(), b.grad.numpy())):
            np.testing.assert_allclose(got, ref, rtol=2e-3, atol=1e-6 * np.abs(ref).max(), err_msg=str(key))


def test_a_quantized_package_is_refused_with_a_clear_error(tiny_package):
    with pytest.raises(PackageError, match="reads fp32 packages' weights for now"):
        DenseDecoder.from_package(load_package(tiny_package("llama", "int4")))


def test_a_users_adapter_learns_and_is_served_as_peft_reads_it(tmp_path, tiny_model_dir, tiny_package):
    """The instant loop on a text lowers its loss; the saved folder is PEFT's format (PEFT computes the same
    loss from it), and the engine serves it as a user's adapter, with PEFT's greedy tokens."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from runtime.backends.micro_lora import MicroLora
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    pkg = tiny_package("llama")
    user = MicroLora(DenseDecoder.from_package(load_package(pkg)), targets=("q_proj", "v_proj", "down_proj"),
                     rank=2, lr=3e-2)
    rng = np.random.default_rng(3)
    phrase = rng.integers(100, 2000, 12).tolist()
    text = phrase * 6  # a user who repeats themselves: easy to learn
    first = user.learn(text, chunk=32, epochs=6)["epoch_losses"]
    assert first == sorted(first, reverse=True) and first[-1] < 0.8 * first[0], first
    folder = user.save_peft(tmp_path / "user-a")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), torch_dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(model, str(folder)).eval()
    ids = text[:40]
    x = torch.tensor([ids])
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(peft(x).logits[0, :-1], x[0, 1:]).item()
    assert loss_and_grads(user.dec, ids, user.lora)[0] == pytest.approx(want, rel=1e-5)

    engine = Engine.from_package(pkg)
    engine.adapters.add("user-a", folder)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    served = [t for o in engine.generate(phrase, params, adapter="user-a") for t in o.token_ids]
    base = [t for o in engine.generate(phrase, params) for t in o.token_ids]
    with torch.no_grad():
        ref = peft.generate(torch.tensor([phrase]), max_new_tokens=8, do_sample=False)[0, len(phrase):].tolist()
    assert served == ref and served != base


def test_ewc_keeps_the_factors_where_the_reference_text_needs_them(tiny_package):
    """EWC++: the Fisher is refreshed on a reference text in units of its mean and decayed into the running
    estimate; with a strong penalty the factors drift less, weighed by it, than without."""
    from runtime.backends.micro_lora import MicroLora

    dec = DenseDecoder.from_package(load_package(tiny_package("llama")))
    rng = np.random.default_rng(5)
    text, reference = (rng.integers(100, 2000, 12).tolist() * 6), rng.integers(100, 2000, 64).tolist()

    def drift(user: MicroLora) -> float:
        return sum(float(np.sum(f * (w - w0) ** 2)) for k in user.fisher
                   for f, w, w0 in zip(user.fisher[k], user.lora.factors[k], user.start[k]))

    free, kept = (MicroLora(dec, ("q_proj", "v_proj"), rank=2, lr=3e-2, ewc=e, fisher_decay=0.5) for e in (0.0, 50.0))
    free.fisher = kept.fisher  # the same weights measure both drifts (free's own Fisher is never computed)
    kept.consolidate(reference, chunk=32)
    first = {k: tuple(f.copy() for f in pair) for k, pair in kept.fisher.items()}
    total = np.concatenate([f.ravel() for pair in first.values() for f in pair])
    assert total.mean() == pytest.approx(0.5, rel=1e-5)  # (1 - decay) x a fresh estimate of mean 1
    free.learn(text, chunk=32, epochs=3)
    kept.learn(text, chunk=32, epochs=3, reference=reference, consolidate_every=3)
    assert drift(kept) < 0.5 * drift(free)


def test_user_b_answers_alike_before_and_after_user_a_adapts(tmp_path, tiny_package):
    """Isolation: A's adapter, learned and hot-loaded into the serving engine, changes A's answers and not a
    token or logprob of B's (B on an adapter of its own) nor the base model's."""
    from runtime.backends.micro_lora import MicroLora
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    pkg = tiny_package("llama")
    dec = DenseDecoder.from_package(load_package(pkg))
    rng = np.random.default_rng(9)
    texts = {u: rng.integers(100, 2000, 10).tolist() * 5 for u in "ab"}
    folders = {}
    for u in "ab":
        user = MicroLora(dec, ("q_proj", "v_proj"), rank=2, lr=3e-2, seed=ord(u))
        if u == "b":
            user.learn(texts[u], chunk=25, epochs=2)
        folders[u] = user.save_peft(tmp_path / f"user-{u}")  # A's is still its start: no change yet
    engine = Engine.from_package(pkg)
    for u in "ab":
        engine.adapters.add(f"user-{u}", folders[u])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)

    def answers() -> dict:
        out = {}
        for who, text in (("user-a", "a"), ("user-b", "b"), (None, "a")):
            outs = list(engine.generate(texts[text][:12], params, adapter=who))
            out[who] = ([t for o in outs for t in o.token_ids], [lp.logprob for o in outs for lp in o.logprobs])
        return out

    before = answers()
    assert before["user-a"][0] == before[None][0]  # a new user's adapter changes no token (B is zero; the LoRA
    # graph's onnxruntime kernels may round a logprob otherwise than the base graph's)
    learner = MicroLora(dec, ("q_proj", "v_proj"), rank=2, lr=3e-2, seed=ord("a"))
    learner.learn(texts["a"], chunk=25, epochs=3)
    engine.adapters.add("user-a", learner.save_peft(tmp_path / "user-a"))  # the instant loop's update, hot-loaded
    after = answers()
    assert after["user-b"] == before["user-b"] and after[None] == before[None]
    assert after["user-a"] != before["user-a"]
