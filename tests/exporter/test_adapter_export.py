"""`python -m exporter adapter`: a PEFT folder in the package's adapter format, loaded by the runtime."""

from __future__ import annotations

import json

import pytest

from runtime.core.adapters import AdapterError
from runtime.core.engine import Engine
from runtime.core.sampling import SamplingParams
from tests.conftest import run_cli
from tests.runtime.test_adapters import PROMPT


def tokens(engine, adapter, n=8):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [t for o in engine.generate(PROMPT, params, adapter=adapter) for t in o.token_ids]


def test_converted_adapter_equals_its_peft_folder(tiny_package, peft_adapters, tmp_path):
    pkg = tiny_package("llama")
    folder = peft_adapters("llama")["all16"]
    for dtype in ("fp32", "fp16"):
        proc = run_cli("adapter", str(folder), "-o", str(tmp_path / dtype), "--base", str(pkg), "--dtype", dtype,
                       module="exporter")
        assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "fp32" / "adapter.json").read_text())
    assert manifest["rank"] == 16 and len(manifest["targets"]) == 7 and manifest["base"]["architecture"] == "llama"
    size16 = (tmp_path / "fp16" / "adapter.safetensors").stat().st_size
    assert size16 < 0.55 * (tmp_path / "fp32" / "adapter.safetensors").stat().st_size
    engine = Engine.from_package(pkg, speculative_tokens=0)
    engine.adapters.add("peft", folder)
    engine.adapters.add("ours", tmp_path / "fp32")
    engine.adapters.add("ours16", tmp_path / "fp16")
    want = tokens(engine, "peft")
    assert tokens(engine, "ours") == want and tokens(engine, "ours16") == want


def test_converted_adapter_is_checked(tiny_package, peft_adapters, tmp_path):
    from exporter.adapter import convert_adapter

    out = convert_adapter(peft_adapters("llama")["attn4"], tiny_package("llama"), tmp_path / "a")
    engine = Engine.from_package(tiny_package("qwen2"), speculative_tokens=0)
    with pytest.raises(AdapterError, match="an adapter for a llama model, this package is qwen2"):
        engine.adapters.add("a", out)
    data = bytearray((out / "adapter.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "adapter.safetensors").write_bytes(bytes(data))
    llama = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
    with pytest.raises(AdapterError, match="does not match the sha256"):
        llama.adapters.add("a", out)
    with pytest.raises(AdapterError, match="not a PEFT LoRA folder"):
        convert_adapter(tmp_path, tiny_package("llama"), tmp_path / "b")
