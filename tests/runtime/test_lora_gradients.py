"""The instant loop's hand-written backward (runtime/backends/lora_gradients.py) against PEFT's autograd."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backends.lora_gradients import DenseDecoder, Lora, loss_and_grads
from runtime.package import load_package

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("arch,unlikely,layers", [
    ("llama", False, None), ("qwen2", False, None), ("llama", True, None), ("llama", False, [1]),
    ("mistral", False, None), ("qwen3", False, None), ("gemma", False, None), ("gemma2", False, None),
    ("gemma3", False, None), ("gemma3", True, [1])])
def test_loss_and_factor_gradients_equal_peft_autograd(arch, unlikely, layers, tiny_model_dir, tiny_package):
    """Every family the exporter supports, read through the manifest's compute traits (sliding windows,
    head norms, GeGLU, sandwich norms, soft caps, a RoPE base per layer); also with the upper layer alone
    adapted (PEFT's layers_to_transform), where the backward stops above the lower one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), torch_dtype=torch.float32).eval()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                            layers_to_transform=layers))
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
    logp = torch.log_softmax(peft(x).logits[0, :-1], -1)[torch.arange(39), x[0, 1:]]
    want = -torch.log1p(-logp.exp()).mean() if unlikely else -logp.mean()
    want.backward()

    dec = DenseDecoder.from_package(load_package(tiny_package(arch)))
    lora = Lora({k: (a.detach().numpy().copy(), b.detach().numpy().copy()) for k, (a, b) in factors.items()}, scale=2.0)
    loss, grads = loss_and_grads(dec, ids, lora, unlikely=unlikely)
    assert loss == pytest.approx(want.item(), rel=1e-5)
    assert set(grads) == set(factors)
    for key, (a, b) in factors.items():
        for got, ref in zip(grads[key], (a.grad.numpy(), b.grad.numpy())):
            np.testing.assert_allclose(got, ref, rtol=2e-3, atol=1e-6 * np.abs(ref).max(), err_msg=str(key))


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K", "Q8_0", "Q4_1"))
def test_a_gguf_packages_blocks_are_read_as_transformers_dequantizes_them(type_name, smol_gguf, workdir):
    """The trainer learns against the weights the package serves: a GGUF's blocks (kept at their own bits)
    read back dense equal transformers' load of the file bit for bit, and so does the loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.builders import FUSED_PROJECTIONS
    from exporter.convert import ConvertOptions, convert
    from tests.exporter.test_gguf_import import write_tiny_gguf

    path = workdir / f"tiny-train-{type_name}.gguf"
    write_tiny_gguf(path, smol_gguf, type_name)
    pkg = convert(str(path), workdir / f"pkg-gguf-train-{type_name}", ConvertOptions(progress=False, lora=False))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    dec = DenseDecoder.from_package(load_package(pkg))
    for i, layer in enumerate(dec.layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            want = np.concatenate([hf[f"model.layers.{i}.{p}.weight"] for p in parts]).T
            assert np.array_equal(layer[_key(fused)], want), (i, fused)
    ids = list(range(100, 160))
    assert np.array_equal(dec.embed_rows(ids), hf["model.embed_tokens.weight"][ids])
    assert np.array_equal(dec.head_t, hf["lm_head.weight"].T)
    x = torch.tensor([ids])
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x).logits[0, :-1], x[0, 1:]).item()
    assert loss_and_grads(dec, ids, Lora({}, 1.0), backward=False)[0] == pytest.approx(want, rel=1e-5)


def _key(fused: str) -> str:
    return fused.replace("_proj", "_t")


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_grid_packages_weights_are_its_graphs(quant, tiny_package):
    """MatMulNBits grids (RTN int4 with zero points, int8) read back as the graph defines them, and the
    trainer's loss is the served graph's (within int8 activations' rounding)."""
    from exporter.evaluate import teacher_forced_logits
    from tests.exporter.test_gguf_import import package_weights

    pkg = tiny_package("llama", quant)
    want = package_weights(pkg)
    dec = DenseDecoder.from_package(load_package(pkg))
    for i, layer in enumerate(dec.layers):
        for name, key in (("qkv_proj", "qkv_t"), ("o_proj", "o_t"), ("gate_up_proj", "gate_up_t"),
                          ("down_proj", "down_t")):
            assert np.array_equal(layer[key], want[f"layers.{i}.{name}"].T), (i, name)
    ids = list(range(200, 260))
    logits = teacher_forced_logits(pkg, ids)[:-1]
    lg = logits - logits.max(-1, keepdims=True)
    served = float(-(lg[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(lg).sum(-1))).mean())
    assert loss_and_grads(dec, ids, Lora({}, 1.0), backward=False)[0] == pytest.approx(served, rel=2e-3)


def test_the_dense_budget_bounds_what_the_trainer_keeps(tiny_package):
    """Past the budget, layers are made again when needed rather than kept: same numbers, less memory."""
    pkg = load_package(tiny_package("llama", "int4"))
    kept, bounded = DenseDecoder.from_package(pkg), DenseDecoder.from_package(pkg, budget_bytes=0)
    ids = list(range(300, 340))
    lora = Lora({(0, "q_proj"): (np.full((2, kept.features["q_proj"][0]), 0.01, np.float32),
                                 np.full((kept.features["q_proj"][1], 2), 0.01, np.float32))}, 1.0)
    a, b = loss_and_grads(kept, ids, lora), loss_and_grads(bounded, ids, lora)
    assert a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1][(0, "q_proj")], b[1][(0, "q_proj")]))
    assert bounded.cache.used == 0 and kept.cache.used > 0


@pytest.mark.parametrize("layers", [None, [1]])
def test_a_users_adapter_learns_and_is_served_as_peft_reads_it(layers, tmp_path, tiny_model_dir, tiny_package):
    """The instant loop on a text lowers its loss; the saved folder is PEFT's format (PEFT computes the same
    loss from it, and adapts the same layers), and the engine serves it as a user's adapter, with PEFT's
    greedy tokens."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from runtime.backends.micro_lora import MicroLora
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    pkg = tiny_package("llama")
    user = MicroLora(DenseDecoder.from_package(load_package(pkg)), targets=("q_proj", "v_proj", "down_proj"),
                     rank=2, lr=0.3, layers=layers)  # a share of the weights' RMS (~0.1 here)
    rng = np.random.default_rng(3)
    phrase = rng.integers(100, 2000, 12).tolist()
    text = phrase * 6  # a user who repeats themselves: easy to learn
    first = user.learn(text, chunk=32, epochs=6)["epoch_losses"]
    assert first == sorted(first, reverse=True) and first[-1] < 0.85 * first[0], first
    folder = user.save_peft(tmp_path / "user-a")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), torch_dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(model, str(folder)).eval()
    adapted = {int(n.split(".layers.")[1].split(".")[0]) for n, m in peft.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(layers or (0, 1))
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


def test_the_frozen_prefix_changes_no_bit_and_is_used(tiny_package):
    """A text's residual stream below the lowest adapted layer is kept (FrozenPrefix) and read back at the
    next step: the loss and every gradient equal a decoder's that computes everything again, bit for bit."""
    pkg = load_package(tiny_package("gemma3"))
    rng = np.random.default_rng(3)
    ids = rng.integers(0, pkg.config["vocab_size"], 30).tolist()
    shape = DenseDecoder.from_package(pkg).features
    lora = Lora({(1, t): (rng.standard_normal((2, shape[t][0])).astype(np.float32) * 0.1,
                          rng.standard_normal((shape[t][1], 2)).astype(np.float32) * 0.1) for t in TARGETS}, 2.0)
    cached = DenseDecoder.from_package(pkg)
    first = loss_and_grads(cached, ids, lora)
    assert len(cached.prefix.kept) == 1
    cached.embed_rows = None  # a hit must not read the embeddings again
    again = loss_and_grads(cached, ids, lora)
    fresh = loss_and_grads(DenseDecoder.from_package(pkg), ids, lora)
    for got in (again, first):
        assert got[0] == fresh[0]
        for key, pair in fresh[1].items():
            for a, b in zip(got[1][key], pair):
                assert np.array_equal(a, b), key


def test_the_fisher_is_measured_again_every_n_steps_of_a_user_across_feedbacks():
    from runtime.core.feedback_plan import refresh_before

    assert refresh_before(0, 3, 4) == [0]  # a new user's, before anything moves
    assert refresh_before(0, 12, 4) == [0, 4, 8]  # one long text: as its steps take the factors
    assert refresh_before(3, 2, 4) == [1] and refresh_before(5, 2, 4) == []  # counted over feedbacks
    assert refresh_before(0, 5, 0) == []


def test_a_package_that_does_not_say_how_it_computes_is_refused_by_name():
    from runtime.backends.lora_gradients import Compute
    from runtime.errors import PackageError

    config = {"num_layers": 2, "hidden_size": 8}
    assert Compute.from_manifest("p", {"architecture": "llama", "config": config}).activation == "silu"
    with pytest.raises(PackageError, match="predates"):
        Compute.from_manifest("p", {"architecture": "gemma3_text", "config": config})
    with pytest.raises(PackageError, match="'gelu' activation"):
        Compute.from_manifest("p", {"architecture": "gemma", "config": {**config, "compute": {
            "activation": "gelu", "embed_scale": 1.0, "attn_scale": None, "qk_norm": False, "sandwich_norms": False,
            "layer_rope_local": None}}})


def test_a_peft_folder_is_read_as_peft_scales_it(tiny_model_dir, tiny_package, tmp_path):
    """read_peft goes through the engine's one PEFT reader: rsLoRA's alpha / sqrt(r), a rank pattern and
    layers_to_transform give the loss PEFT's model gives."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from runtime.backends.micro_lora import read_peft

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), torch_dtype=torch.float32).eval()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                            use_rslora=True, rank_pattern={"down_proj": 2}, layers_to_transform=[1]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    peft.save_pretrained(tmp_path)
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 30).tolist()
    with torch.no_grad():
        x = torch.tensor([ids])
        want = torch.nn.functional.cross_entropy(peft(x).logits[0, :-1], x[0, 1:]).item()
    pkg = load_package(tiny_package("llama"))
    lora = read_peft(tmp_path, pkg.config)
    assert {layer for layer, _ in lora.factors} == {1} and lora.factors[(1, "down_proj")][0].shape[0] == 2
    got = loss_and_grads(DenseDecoder.from_package(pkg), ids, lora, backward=False)[0]
    assert got == pytest.approx(want, rel=1e-5)
