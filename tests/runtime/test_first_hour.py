"""What a newcomer meets first: `ruvllm` and `--version`, `generate` chatting by default, a GGUF file as the
model, and sampling defaults that are the model's own (else a chat default), not greedy loops."""

from __future__ import annotations

import json

import pytest

from runtime.core.generation_defaults import CHAT_DEFAULTS, model_sampling, request_defaults
from tests.conftest import run_cli


def test_version_and_a_short_usage():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("ruvllm ")
    bare = run_cli()
    assert bare.returncode == 0
    for command in ("ruvllm generate", "ruvllm chat", "ruvllm serve"):
        assert command in bare.stdout
    assert len(bare.stdout.splitlines()) < 15


def test_model_settings_beat_chat_defaults_and_flags_beat_both():
    # transformers' own defaults (older versions wrote them all out) and nulls say nothing about the model
    assert model_sampling({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "do_sample": True}) == {}
    assert model_sampling({"temperature": 0.6, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.1}) == {
        "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    assert model_sampling({"temperature": 7.0, "top_p": "x", "top_k": True}) == {}  # not usable: ignored
    assert request_defaults() == CHAT_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert request_defaults({"temperature": 0.6}, {"temperature": 0.0, "top_k": None}) == {
        **CHAT_DEFAULTS, "temperature": 0.0}


def test_a_request_without_sampling_fields_gets_the_models(tiny_package, tmp_path):
    """A package whose generation_config.json sets a temperature: the engine, the server's parsing and a
    request that names its own all agree."""
    import shutil

    from runtime.core.engine import Engine
    from runtime.package import file_entry
    from runtime.serve import openai_protocol as P

    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package("llama"), pkg)
    (pkg / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["files"]["generation_config.json"] = file_entry(pkg / "generation_config.json")
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    engine = Engine.from_package(pkg)
    assert engine.sampling_defaults == {**CHAT_DEFAULTS, "temperature": 0.6, "top_p": 0.9}
    params = engine.sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.6, 40, 0.9, 0.05)
    assert engine.sampling_params(temperature=0).greedy
    parsed = P.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, engine.sampling_defaults)
    assert (parsed.params.temperature, parsed.params.top_k) == (0.6, 40)
    parsed = P.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0},
                          engine.sampling_defaults)
    assert parsed.params.greedy


def test_generate_chats_with_a_chat_model_and_raw_sends_the_text(smol_int4):
    chat = run_cli("generate", str(smol_int4), "Name the capital of France.", "--json", "--temperature", "0",
                   "--max-tokens", "24")
    assert chat.returncode == 0, chat.stderr[-2000:]
    answer = json.loads(chat.stdout)
    assert "Paris" in answer["text"]
    raw = run_cli("generate", str(smol_int4), "Name the capital of France.", "--raw", "--json", "--temperature",
                  "0", "--max-tokens", "4")
    assert raw.returncode == 0, raw.stderr[-2000:]
    assert json.loads(raw.stdout)["prompt_tokens"] < answer["prompt_tokens"]  # no template around it
    both = run_cli("generate", str(smol_int4), "hi", "--raw", "--chat")
    assert both.returncode == 1 and "choose one" in both.stderr


@pytest.mark.slow
def test_a_gguf_file_is_a_model_with_its_own_sampling_settings(smol_gguf, tmp_path):
    """`ruvllm generate FILE.gguf` exports the file once into the cache (llama-cli's -m), and the file's
    general.sampling.* become the package's defaults."""
    from tests.exporter.test_streamed_export import write_mixed_gguf

    write_mixed_gguf(tmp_path / "tuned.gguf", smol_gguf, mix=dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_K"),
        metadata={"general.sampling.temp": 0.6, "general.sampling.top_k": 20})
    env = {"RUVLLM_CACHE_DIR": str(tmp_path / "cache")}
    first = run_cli("generate", str(tmp_path / "tuned.gguf"), "hi", "--max-tokens", "2", "--json", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli("generate", str(tmp_path / "tuned.gguf"), "hi", "--max-tokens", "2", "--json", env=env)
    assert again.returncode == 0 and "export" not in again.stderr.lower()  # from the cache
    (pkg,) = (tmp_path / "cache" / "packages").iterdir()
    assert pkg.name.startswith("tuned-")
    from runtime.core.generation_defaults import package_sampling

    manifest = json.loads((pkg / "manifest.json").read_text())
    assert package_sampling(pkg, manifest) == {"temperature": pytest.approx(0.6), "top_k": 20}
