"""SmoothQuant for W8A8: the folded scales leave the float model (and a LoRA adapter on it) unchanged, and
the W8A8 package is closer to fp32 than W8A8 without them on a model with activation outliers."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backends.native import NativeBackend
from runtime.package import load_package
from tests.exporter.test_awq import with_outliers
from tests.exporter.test_logits_parity import TOL, hf_last_logits, load_hf, peft_adapter
from tests.exporter.test_quantization import quality, teacher_forced_logprobs
from tests.stepping import Stepper


@pytest.fixture(scope="module")
def outliers(tiny_model_dir, workdir):
    from transformers import AutoTokenizer

    out = workdir / "tiny-llama-outliers-sq"
    if not out.exists():
        with_outliers(tiny_model_dir("llama")).save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny_model_dir("llama")).save_pretrained(out)
    return out


def test_smoothquant_scales_keep_the_model_and_its_lora(outliers, workdir, monkeypatch):
    import exporter.convert as conv
    from exporter.lora import adapter_weights
    from runtime import contract as C

    monkeypatch.setattr(conv, "quantize_weights", lambda graph, *a, **k: graph)  # keep float weights
    pkg = load_package(conv.convert(str(outliers), workdir / "pkg-sq-float",
                                    conv.ConvertOptions(quant="w8a8", method="smoothquant", progress=False)))
    assert pkg.manifest["quantization"]["method"] == "smoothquant"
    base = load_hf(outliers)
    peft_model, lora_inputs = peft_adapter(outliers)
    stepper = Stepper(NativeBackend(pkg, lora=True), block_size=4)
    rng = np.random.default_rng(4)
    a = [int(t) for t in rng.integers(3, base.config.vocab_size, 9)]
    b = [int(t) for t in rng.integers(3, base.config.vocab_size, 6)]
    weights = adapter_weights([0] * len(a) + [None] * len(b), 1, 4)
    res = stepper.step({0: a, 1: b}, extra_inputs={**lora_inputs, C.LORA_WEIGHTS: weights})
    scale = np.abs(hf_last_logits(base, b)).max()
    assert np.abs(res.logits[1] - hf_last_logits(base, b)).max() < TOL * scale
    assert np.abs(res.logits[0] - hf_last_logits(peft_model, a)).max() < TOL * scale


def test_smoothquant_w8a8_is_closer_to_fp32(outliers, workdir):
    from exporter.convert import ConvertOptions, convert
    from runtime.errors import RuvLLMError

    fp32 = convert(str(outliers), workdir / "pkg-sq-fp32", ConvertOptions(progress=False, lora=False))
    tok_ids = list(range(3, 200, 3))
    ref = teacher_forced_logprobs(fp32, tok_ids)
    kl = {}
    for method in ("rtn", "smoothquant"):
        pkg = convert(str(outliers), workdir / f"pkg-sq-{method}",
                      ConvertOptions(quant="w8a8", method=method, progress=False, lora=False))
        kl[method] = quality(ref, teacher_forced_logprobs(pkg, tok_ids), tok_ids)["kl"]
    assert kl["smoothquant"] < 0.8 * kl["rtn"], kl
    with pytest.raises(RuvLLMError, match="smoothquant applies to --quant w8a8"):
        convert(str(outliers), workdir / "x", ConvertOptions(quant="int4", method="smoothquant"))
