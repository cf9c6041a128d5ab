"""Per-user adaptation in the page (issue 51): engine.feedback() learns on the WASM step (learn.h), the
user's next requests are served what was learned, other users are not, it survives a reload, and
engine.forget() resets it."""

from __future__ import annotations

import pytest

from runtime.core.feedback_plan import refresh_before
from runtime.serve.personalization import PersonalSettings
from tests.web.conftest import CHAT, LOAD_ENGINE

pytestmark = pytest.mark.slow

SMOL = "/models/smollm2-135m/"
SETTINGS = PersonalSettings()  # the page's
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]
TEXT = ("Arr, the sea be a cruel mistress, matey! Hoist the mainsail, swab the deck, and mind the kraken. "
        "Every pirate worth his salt knows the tides, the stars and the creak of a good ship's timbers. ") * 2
FEEDBACK = "async (body) => { try { return await window.engine.feedback(body); } catch (e) { return { failed: String(e.message), param: e.error?.param }; } }"


def answer(p, **extra) -> tuple[list[int], list[float]]:
    reply = p.evaluate(CHAT, {"messages": QUESTION, "max_tokens": 12, "temperature": 0, "logprobs": True,
                              "return_token_ids": True, **extra})
    choice = reply["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def test_a_page_user_learns_from_feedback_keeps_it_over_a_reload_and_forgets_it(offline_page, smol_int4, tmp_path):
    from runtime.backends.lora_gradients import DenseDecoder, Lora, loss_and_grads
    from runtime.backends.micro_lora import read_peft
    from runtime.package import load_package
    from runtime.text.prompt import package_tokenizer

    p = offline_page()
    p.api()
    info = p.evaluate(LOAD_ENGINE, [SMOL, {"backend": "wasm-step", "speculativeTokens": 0, "user": "alice"}])
    assert info["backend"] == "wasm-step"
    base = answer(p)
    assert p.evaluate("async () => await window.engine.userState()")["version"] == 0

    for body, param in (({}, "text"), ({"text": "  "}, "text"), ({"messages": QUESTION, "completion": "x", "rating": 2}, "rating"),
                        ({"text": "hi", "user": ""}, "user"), ({"text": "hi", "model": "other"}, "model")):
        got = p.evaluate(FEEDBACK, body)
        assert got.get("param") == param, (body, got)

    first = p.evaluate(FEEDBACK, {"text": TEXT})
    assert "failed" not in first, first
    # the server's defaults: each text learned in `epochs` passes, a new user's Fisher measured first
    assert first["version"] == 1 and first["steps"] == SETTINGS.epochs and first["user"] == "alice", first
    assert first["consolidated"] is True
    # the page learned from the text the native tokenizer makes of it, on the same model: the loss before
    # its first step is the base model's, as the native trainer computes it (within the step's rounding)
    pkg = load_package(smol_int4)
    dec = DenseDecoder.from_package(pkg)
    ids = package_tokenizer(pkg).encode(TEXT)
    native_loss, _ = loss_and_grads(dec, ids, Lora({}, 1.0), backward=False)  # no factors: the base model
    assert abs(first["losses"][0] - native_loss) < 0.02, (first["losses"], native_loss)
    second = p.evaluate(FEEDBACK, {"text": TEXT})
    third = p.evaluate(FEEDBACK, {"text": TEXT})
    assert third["losses"][0] < second["losses"][0] < first["losses"][0], (first, second, third)
    learned = answer(p)
    assert learned[1] != base[1]  # alice is served her adapter
    assert answer(p, user="bob") == base  # bob is not: bit for bit the base model's
    assert p.evaluate("async () => await window.engine.userAdapter('bob')") is None

    # her adapter as PEFT's folder: natively, it scores the text as the page's step does (the factors
    # and q and k's row order carried over); the fourth feedback's loss is the page's at these factors
    files = p.evaluate("async () => Object.fromEntries(Object.entries(await window.engine.userAdapter())"
                       ".map(([k, v]) => [k, Array.from(v)]))")
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
    fourth = p.evaluate(FEEDBACK, {"text": TEXT})
    # EWC++'s Fisher measured again every `consolidate_every` of the user's steps, as natively
    again = bool(refresh_before(3 * SETTINGS.epochs, SETTINGS.epochs, SETTINGS.consolidate_every))
    assert fourth["consolidated"] is again and fourth["version"] == 4
    for name, data in files.items():
        (tmp_path / name).write_bytes(bytes(data))
    native_adapted, _ = loss_and_grads(dec, ids, read_peft(tmp_path, pkg.config), backward=False)
    assert abs(native_adapted - fourth["losses"][0]) < 0.02, (native_adapted, fourth["losses"])
    assert native_loss - native_adapted > 0.05, (native_loss, native_adapted)
    learned = answer(p)

    p.evaluate("engine.stats()")
    p.page.reload()
    p.api()
    p.evaluate(LOAD_ENGINE, [SMOL, {"backend": "wasm-step", "speculativeTokens": 0, "user": "alice"}])
    assert p.evaluate("async () => await window.engine.userState()")["version"] == 4
    assert answer(p) == learned  # the same adapter, read back from the origin's storage
    assert p.evaluate("async () => await window.engine.forget()") is True
    assert answer(p) == base
    assert p.evaluate("async () => await window.engine.userState()")["version"] == 0

