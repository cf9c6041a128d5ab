"""The page's instant loop (issue 51): the WASM step's gradients of a LoRA's factors (wasm/step/learn.h)
against the native trainer's (runtime/backends/lora_gradients.py, itself checked against PEFT's
autograd), on SmolLM2's own GGUF blocks, hosted in wasmtime."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backends.micro_lora import PEFT_MODULE

TARGETS = tuple(PEFT_MODULE)

TEXT = ("Gutenberg's press spread across Europe within decades; by 1500 printers in more than two hundred "
        "cities had produced millions of books, and the price of a copy fell year after year.")


def to_step_rows(bt: np.ndarray, head_dim: int) -> np.ndarray:
    """B^T [rank, out] of q or k from the graph's row order into a llama GGUF's (each head's halves interleaved)."""
    r, out = bt.shape
    return bt.reshape(r, out // head_dim, 2, head_dim // 2).transpose(0, 1, 3, 2).reshape(r, out)


def from_step_rows(bt: np.ndarray, head_dim: int) -> np.ndarray:
    r, out = bt.shape
    return bt.reshape(r, out // head_dim, head_dim // 2, 2).transpose(0, 1, 3, 2).reshape(r, out)


@pytest.fixture(scope="module")
def native(smol_int4):
    from runtime.backends.lora_gradients import DenseDecoder
    from runtime.package import load_package
    from runtime.text.prompt import package_tokenizer

    pkg = load_package(smol_int4)
    return DenseDecoder.from_package(pkg), package_tokenizer(pkg)


def random_lora(dec, targets, rank: int, seed: int, layers=None):
    from runtime.backends.lora_gradients import Lora

    rng = np.random.default_rng(seed)
    factors = {}
    for i in range(dec.num_layers) if layers is None else layers:
        for t in targets:
            fin, fout = dec.features[t]
            factors[(i, t)] = (rng.normal(0, 0.05, (rank, fin)).astype(np.float32),
                               rng.normal(0, 0.05, (fout, rank)).astype(np.float32))
    return Lora(factors, 8.0 / rank)


def step_factors(lora, head_dim: int) -> dict:
    """The native LoRA as step_learn takes it: A, and B transposed with q and k's rows in the step's order."""
    out = {}
    for key, (a, b) in lora.factors.items():
        bt = np.ascontiguousarray(b.T)
        out[key] = (a, to_step_rows(bt, head_dim) if key[1] in ("q_proj", "k_proj") else bt)
    return out


def flat(grads, head_dim: int) -> np.ndarray:
    """Every factor's gradient in one vector, in the native layout (B [out, rank], the graph's row order)."""
    out = []
    for key in sorted(grads):
        ga, gb = grads[key]
        if gb.shape[0] < gb.shape[1]:  # the step's B^T
            gb = (from_step_rows(gb, head_dim) if key[1] in ("q_proj", "k_proj") else gb).T
        out += [ga.ravel(), gb.ravel()]
    return np.concatenate(out)


def compare(native_grads, wasm_grads, head_dim: int, rtol: float) -> None:
    """Each factor's gradient within rtol of the native one (relative to its norm)."""
    for key in native_grads:
        want, got = flat({key: native_grads[key]}, head_dim), flat({key: wasm_grads[key]}, head_dim)
        err = float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-12))
        assert err < rtol, (key, err)


@pytest.mark.slow
@pytest.mark.parametrize("scored_from,unlikely,top", [(0, False, None), (9, True, None), (0, False, 1 / 3)])
def test_the_steps_gradients_are_the_native_trainers(native, step_files, scored_from, unlikely, top):
    """Every target at rank 2, a text (or its reply after a context, with the unlikelihood loss; or the
    server's default, the last third of the layers adapted, where both backwards stop above the rest): with
    fp32 products the loss and every factor's gradient equal the native trainer's to float32 rounding;
    with the step's own rounded products (what the page serves and learns on) within the int8 activations'
    floor."""
    from runtime.backends.lora_gradients import loss_and_grads
    from runtime.serve.personalization import PersonalSettings
    from wasm.step_module import WasmStep

    dec, tok = native
    ids = tok.encode(TEXT)[:40]
    layers = PersonalSettings(top_layers=top).layers(dec.num_layers) if top else None
    lora = random_lora(dec, TARGETS, 2, seed=1, layers=layers)
    want_loss, want = loss_and_grads(dec, ids, lora, scored_from=scored_from, unlikely=unlikely)
    step = WasmStep(step_files / "step.wasm", step_files, 4, 16, max_tokens=64)
    loss, got = step.learn(ids, step_factors(lora, dec.head_dim), lora.scale, scored_from, unlikely, exact=True)
    assert abs(loss - want_loss) < 1e-4 * max(1.0, abs(want_loss)), (loss, want_loss)
    compare(want, got, dec.head_dim, rtol=2e-3)
    loss, got = step.learn(ids, step_factors(lora, dec.head_dim), lora.scale, scored_from, unlikely)
    assert abs(loss - want_loss) < 0.02 * max(1.0, abs(want_loss)), (loss, want_loss)
    want_all, got_all = flat(want, dec.head_dim), flat(got, dec.head_dim)
    cosine = float(want_all @ got_all / np.linalg.norm(want_all) / np.linalg.norm(got_all))
    assert cosine > 0.99, cosine  # ~0.995 measured: the rounding moves single factors' gradients by ~9 % (up to ~27 %)


def test_the_steps_adam_is_the_native_trainers(step_files):
    """learn_adam, with and without the EWC++ pull, equals micro_lora's float32 arithmetic bit for bit."""
    from runtime.backends.micro_lora import adam_update, ewc_pull
    from wasm.step_module import WasmStep

    rng = np.random.default_rng(0)
    w, g, m, v, fisher, start = (rng.normal(0, 1, 1000).astype(np.float32) for _ in range(6))
    v = np.abs(v)
    step = WasmStep(step_files / "step.wasm", step_files, 1, 16, max_tokens=16)
    for ewc, t in ((0.0, 1), (4.0, 7)):
        want_w, want_m, want_v = w.copy(), m.copy(), v.copy()
        grad = ewc_pull(g, want_w, fisher, start, ewc) if ewc else g
        adam_update(want_w, grad, want_m, want_v, t, 3e-3 * 0.5)
        got_w, got_m, got_v = step.adam(w, g, m, v, t, 3e-3 * 0.5, fisher, start, ewc)
        assert np.array_equal(got_m, want_m) and np.array_equal(got_v, want_v)
        assert np.array_equal(got_w, want_w), np.abs(got_w - want_w).max()


def test_a_page_users_steps_are_the_native_rates(native, step_files):
    """A step moves each factor by a share of its projection's weight RMS: the step's learn_weight_rms of
    each matrix it holds equals the native trainer's RMS of the same (dequantized) weights."""
    from runtime.backends.micro_lora import weight_rms
    from wasm.step_module import WasmStep

    dec, _ = native
    step = WasmStep(step_files / "step.wasm", step_files, 1, 16, max_tokens=16)
    for layer in (0, dec.num_layers - 1):
        for target in TARGETS:
            fin, fout = dec.features[target]
            want = weight_rms(dec.projection(layer, target))
            got = step.weight_rms(layer, target, fout, fin)
            assert abs(got - want) < 1e-6 * want, (layer, target, got, want)
