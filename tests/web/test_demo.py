"""The demo page, as a person uses it: offline, the model's sampling defaults shown, greedy "Paris" (the
temperature slider at 0), streaming, stop, a second turn."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

READY = "window.ruvllm && (window.ruvllm.ready || window.ruvllm.error)"


def open_demo(offline_page, greedy: bool = True):
    """The demo, loaded; greedy: its temperature slider moved to 0 and DRY unticked, so the answers are
    the model's own greedy ones."""
    p = offline_page()
    p.goto("/")
    p.page.wait_for_function(READY)
    assert p.evaluate("window.ruvllm.error || null") is None, "\n".join(p.console)
    if greedy:
        p.evaluate("(() => { const r = document.querySelector('#temperature'); r.value = 0; r.dispatchEvent(new Event('input')); })()")
        p.page.uncheck("#dry")
    return p


def test_demo_starts_from_the_models_sampling_defaults(offline_page):
    """SmolLM2's package sets no sampling of its own: the chat defaults, shown, with DRY ticked (SmolLM2's
    sampled answers loop without it: docs/PERFORMANCE.md)."""
    p = open_demo(offline_page, greedy=False)
    info = p.evaluate("window.ruvllm.engine.info")
    assert info["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert p.page.inner_text("#temp-out") == "0.80"
    assert "top-k 40" in p.page.inner_text("#sampling") and "min-p 0.05" in p.page.inner_text("#sampling")
    assert p.page.inner_text("#i-backend") == "RuvLLM's WASM step"
    assert p.page.is_checked("#dry")
    assert ask(p, "Write a haiku about the sea.").strip()


def ask(p, text: str) -> str:
    before = p.evaluate("document.querySelectorAll('.msg.assistant').length")
    p.page.fill("#input", text)
    p.page.click("#send")
    p.page.wait_for_function(f"document.querySelectorAll('.msg.assistant').length > {before} && !window.ruvllm.busy")
    return p.evaluate("[...document.querySelectorAll('.msg.assistant .bubble')].at(-1).textContent")


def test_demo_answers_paris_with_the_network_cut_off(offline_page):
    p = open_demo(offline_page)
    info = p.evaluate("window.ruvllm.engine.info")
    assert info["device"] == "wasm" and info["crossOriginIsolated"] and info["threads"] >= 1
    assert p.page.inner_text("#i-device") == "WASM (CPU)"  # the choice is visible
    answer = ask(p, "Name the capital of France.")
    assert "Paris" in answer
    usage = p.evaluate("window.ruvllm.lastUsage")
    assert usage["completion_tokens"] > 1
    assert "tok/s" in p.page.inner_text("#m-speed") and p.page.inner_text("#m-ttft").endswith(" s")


def test_second_turn_reuses_the_first_turns_kv(offline_page):
    p = open_demo(offline_page)
    ask(p, "Name the capital of France.")
    first = p.evaluate("window.ruvllm.lastUsage")
    ask(p, "And of Italy?")
    second = p.evaluate("window.ruvllm.lastUsage")
    cached = second["prompt_tokens_details"]["cached_tokens"]
    # the whole first exchange is a prefix of the second prompt: all its full KV blocks are reused
    assert cached >= (first["prompt_tokens"] + first["completion_tokens"]) // 16 * 16 - 16 > 0
    stats = p.evaluate("window.ruvllm.engine.stats()")
    assert stats["prefix_cache_hits"] > 0 and stats["cached_prompt_tokens"] == cached


def test_stop_button_aborts_and_the_page_keeps_working(offline_page):
    p = open_demo(offline_page)
    p.evaluate("(() => { const r = document.querySelector('#max-tokens'); r.value = 1024; r.dispatchEvent(new Event('input')); })()")
    p.page.fill("#input", "Write a very long story about a dragon who learns to cook.")
    p.page.click("#send")
    p.page.wait_for_function("([...document.querySelectorAll('.msg.assistant .bubble')].at(-1)?.textContent || '').length > 40")
    assert p.page.is_visible("#stop")
    p.page.click("#stop")
    p.page.wait_for_function("!window.ruvllm.busy")
    usage = p.evaluate("window.ruvllm.lastUsage")
    assert usage["completion_tokens"] < 1024
    stats = p.evaluate("window.ruvllm.engine.stats()")
    assert stats["aborted"] == 1 and stats["running"] == 0 and stats["kv_blocks_used"] == 0
    assert "Paris" in ask(p, "Name the capital of France.")  # nothing was lost


def test_a_users_adapter_files_answer_instead_of_the_base_model(offline_page, tmp_path):
    """A PEFT adapter picked from the user's files (here a random rank-4 one on q_proj and v_proj, as PEFT
    lays out its safetensors) is listed, selected, and changes the greedy answer; the base model is one
    choice away."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(30):
        for target, out in (("q_proj", 576), ("v_proj", 192)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((4, 576)) * 0.1).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, 4)) * 0.5).astype(np.float32)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    p = open_demo(offline_page)
    assert p.evaluate("window.ruvllm.engine.info.backend") == "wasm-step"  # 'auto' on the default package
    assert "Paris" in ask(p, "Name the capital of France.")
    p.page.set_input_files("#adapter-files", [str(tmp_path / "adapter_config.json"),
                                              str(tmp_path / "adapter_model.safetensors")])
    p.page.wait_for_function("document.querySelector('#adapter').options.length === 2")
    assert p.page.input_value("#adapter") == "adapter-1"
    assert p.page.inner_text("#adapter-status") == "adapter-1: q_proj, v_proj"
    # the adapter runs on the step too (base tokens get no adapter columns)
    p.page.select_option("#adapter", "")
    p.page.click("#clear")
    base = ask(p, "Name the capital of France.")
    assert "Paris" in base
    p.page.select_option("#adapter", "adapter-1")
    p.page.click("#clear")
    tuned = ask(p, "Name the capital of France.")
    assert tuned != base
    p.page.select_option("#adapter", "")
    p.page.click("#clear")
    assert ask(p, "Name the capital of France.") == base
