"""`ruvllm generate --json` against transformers' greedy generate, and SmolLM2 answering a question."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.package import load_package
from runtime.text.tokenizer import Tokenizer
from tests.conftest import TINY_ARCHS, run_cli

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def package_tokenizer(pkg_dir) -> Tokenizer:
    pkg = load_package(pkg_dir)
    return Tokenizer.from_file(pkg.file("tokenizer.json"), pkg.manifest["tokenizer"])


def hf_greedy(model, prompt_ids: list[int], n: int, eos_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=eos_ids[0] if eos_ids else 0)
    return out[0, len(prompt_ids):].tolist()


def generate_json(pkg, prompt: str, *extra: str) -> dict:
    mode = () if "--chat" in extra else ("--raw",)  # the prompt as it is, unless the test asks for a chat
    proc = run_cli("generate", str(pkg), prompt, *mode, "--json", "--temperature", "0", *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_tokens_equal_transformers(arch, tiny_model_dir, tiny_package):
    from transformers import AutoModelForCausalLM

    pkg = tiny_package(arch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()
    ids = package_tokenizer(pkg).encode(PROMPT)
    ours = generate_json(pkg, PROMPT, "--max-tokens", "32")
    ref = hf_greedy(model, ids, 32, load_package(pkg).eos_token_ids)
    assert ours["prompt_tokens"] == len(ids)
    assert ours["token_ids"] == ref
    assert len(ref) == 32 or ref[-1] in load_package(pkg).eos_token_ids


@pytest.mark.slow
def test_smollm2_fp32_greedy_equals_transformers(smol_fp32, smol_hf):
    ids = package_tokenizer(smol_fp32).encode(PROMPT)
    ours = generate_json(smol_fp32, PROMPT, "--max-tokens", "32")
    ref = hf_greedy(smol_hf, ids, 32, load_package(smol_fp32).eos_token_ids)
    assert ours["token_ids"] == ref
    assert len(ref) == 32


@pytest.mark.slow
def test_smollm2_int4_answers_paris(smol_int4):
    out = generate_json(smol_int4, "Name the capital of France.", "--chat")
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_default_model_comes_from_the_cache(smol_cache):
    """With PKG omitted, generate uses the embedded model's cached int4 export (no re-export)."""
    proc = run_cli("generate", "Name the capital of France.", "--chat", "--temperature", "0", "--json",
                   env={"RUVLLM_CACHE_DIR": str(smol_cache)}, timeout=300)  # the kernels may compile first
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exporting" not in proc.stderr
    assert "Paris" in json.loads(proc.stdout)["text"]
    listing = run_cli("list", "--long", env={"RUVLLM_CACHE_DIR": str(smol_cache)})
    assert "smollm2-135m-int4-cpu" in listing.stdout and "int4" in listing.stdout


def test_streamed_text_equals_json_text(tiny_package):
    pkg = tiny_package("llama")
    streamed = run_cli("generate", str(pkg), PROMPT, "--raw", "--temperature", "0", "--max-tokens", "24")
    assert streamed.returncode == 0, streamed.stderr
    as_json = generate_json(pkg, PROMPT, "--max-tokens", "24")
    assert streamed.stdout == as_json["text"] + "\n"


def test_seeded_sampling_is_reproducible(tiny_package):
    pkg = tiny_package("qwen2")
    a = generate_json(pkg, PROMPT, "--max-tokens", "16", "--temperature", "1.0", "--top-p", "0.9", "--seed", "5")
    b = generate_json(pkg, PROMPT, "--max-tokens", "16", "--temperature", "1.0", "--top-p", "0.9", "--seed", "5")
    c = generate_json(pkg, PROMPT, "--max-tokens", "16", "--temperature", "1.0", "--top-p", "0.9", "--seed", "6")
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_stop_string_ends_generation(tiny_package):
    pkg = tiny_package("llama")
    full = generate_json(pkg, PROMPT, "--max-tokens", "24")
    text = full["text"]
    assert len(text) > 6
    stop = text[3:6]  # a stop string that starts mid-way through the output
    cut = generate_json(pkg, PROMPT, "--max-tokens", "24", "--stop", stop)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.index(stop)]


@pytest.mark.slow
def test_download_with_a_recipe_gets_its_own_folder(smol_cache):
    """`download --block-size` (and `--method`) reach the exporter, and the result lives beside the default
    package instead of replacing it."""
    env = {"RUVLLM_CACHE_DIR": str(smol_cache)}
    proc = run_cli("download", "smollm2-135m", "--quant", "int8", "--method", "rtn", "--block-size", "64", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder = smol_cache / "packages" / "smollm2-135m-int8-rtn-b64-cpu"
    quant = json.loads((folder / "manifest.json").read_text())["quantization"]
    assert (quant["weights"], quant["method"], quant["block_size"]) == ("int8", "rtn", 64)
    assert (smol_cache / "packages" / "smollm2-135m-int4-cpu" / "manifest.json").exists()
    again = run_cli("download", "smollm2-135m", "--quant", "int8", "--method", "rtn", "--block-size", "64", env=env)
    assert again.returncode == 0 and "already in the cache" in again.stdout
    assert "Paris" in generate_json(folder, "Name the capital of France.", "--chat")["text"]
