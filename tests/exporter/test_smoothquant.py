"""SmoothQuant for W8A8: the folded scales leave the float model (and a LoRA adapter on it) unchanged, and
the W8A8 package is closer to fp32 than W8A8 without them on a model with activation outliers."""

from __future__ import annotations

import pytest

from runtime.package import load_package
from tests.exporter.test_awq import assert_keeps_model_and_lora, with_outliers
from tests.exporter.test_quantization import quality, teacher_forced_logprobs


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

    monkeypatch.setattr(conv, "quantize_weights", lambda graph, *a, **k: graph)  # keep float weights
    pkg = load_package(conv.convert(str(outliers), workdir / "pkg-sq-float",
                                    conv.ConvertOptions(quant="w8a8", method="smoothquant", progress=False)))
    assert pkg.manifest["quantization"]["method"] == "smoothquant"
    assert_keeps_model_and_lora(pkg, outliers, seed=4, folder=workdir / "peft-sq")


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
