"""AWQ: the folded scales leave the float model (and a LoRA adapter on it) unchanged; the quantized
package is closer to fp32 than round-to-nearest at the same block size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.backends.native import NativeBackend
from runtime.errors import RuvLLMError
from runtime.package import load_package
from tests.exporter.test_logits_parity import TOL, hf_last_logits, load_hf, peft_adapter
from tests.exporter.test_quantization import quality, teacher_forced_logprobs
from tests.stepping import Stepper


def with_outliers(path):
    """The tiny random model with a few input channels of every projection made 10x larger, as real
    models have them (a random model's channels are all alike, so AWQ's scales would stay near 1)."""
    model = load_hf(path)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[:4] *= 10
            layer.mlp.up_proj.weight[:8] *= 10
    return model


@pytest.fixture(scope="module")
def outlier_dirs(tiny_model_dir, workdir):
    """Factory: arch -> the tiny model with outliers, saved once."""
    from transformers import AutoTokenizer

    def make(arch: str):
        out = workdir / f"tiny-{arch}-outliers"
        if not out.exists():
            with_outliers(tiny_model_dir(arch)).save_pretrained(out)
            AutoTokenizer.from_pretrained(tiny_model_dir(arch)).save_pretrained(out)
        return out
    return make


@pytest.fixture(scope="module")
def outlier_model_dir(outlier_dirs):
    return outlier_dirs("llama")


# Gemma's norms scale by 1 + w: the fold must keep that; Gemma 2's MLP reads pre_feedforward_layernorm
@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma2"])
def test_folded_scales_keep_the_model_and_its_lora(arch, outlier_dirs, workdir, monkeypatch):
    """Export with AWQ's scales folded in but nothing quantized or clipped: the graph must equal
    transformers on the original weights, and with a peft adapter active must equal peft: the LoRA
    graph undoes the scales that the base weights absorbed."""
    import exporter.convert as conv
    import exporter.quantizers.awq as awq

    found = {}

    def scales_only(*args, **kwargs):
        found["scales"] = awq.apply_awq(*args, **{**kwargs, "clip": False})
        return found["scales"]

    monkeypatch.setattr(conv, "apply_awq", scales_only)
    monkeypatch.setattr(conv, "quantize_weights", lambda graph, *a, **k: graph)  # keep float weights
    outlier_model_dir = outlier_dirs(arch)
    pkg = load_package(conv.convert(str(outlier_model_dir), workdir / f"pkg-awq-float-{arch}",
                                    conv.ConvertOptions(quant="int4", method="awq", progress=False)))
    ratios = [s.max() / s.min() for s in found["scales"].inputs.values()]
    assert max(ratios) > 3, ratios  # the scales are far from 1, so a missing undo would show

    assert_keeps_model_and_lora(pkg, outlier_model_dir, seed=3, folder=workdir / f"peft-awq-{arch}")


def assert_keeps_model_and_lora(pkg, model_dir, seed: int, folder) -> None:
    """A package whose float weights absorbed folded scales equals transformers on the original model,
    and, with a peft adapter on one row of the batch, peft: its LoRA graph undoes the scales."""
    from runtime import contract as C

    base = load_hf(model_dir)
    peft_model, tensors = peft_adapter(model_dir, pkg.config, folder)
    lora_inputs = tensors.views(4)
    stepper = Stepper(NativeBackend(pkg, lora=True), block_size=4)
    rng = np.random.default_rng(seed)
    a = [int(t) for t in rng.integers(3, base.config.vocab_size, 9)]
    b = [int(t) for t in rng.integers(3, base.config.vocab_size, 6)]
    weights = tensors.mixing([1] * len(a) + [0] * len(b), 4)  # row a on the adapter (rank 4), b off
    res = stepper.step({0: a, 1: b}, extra_inputs={**lora_inputs, C.LORA_WEIGHTS: weights})
    scale = np.abs(hf_last_logits(base, b)).max()  # the outliers make logits large: compare relatively
    assert np.abs(res.logits[1] - hf_last_logits(base, b)).max() < TOL * scale
    assert np.abs(res.logits[0] - hf_last_logits(peft_model, a)).max() < TOL * scale
    assert np.abs(hf_last_logits(peft_model, a) - hf_last_logits(base, a)).max() > 100 * TOL * scale


def test_awq_is_closer_to_fp32_than_rtn(outlier_model_dir, workdir):
    from exporter.convert import ConvertOptions, convert

    fp32 = convert(str(outlier_model_dir), workdir / "pkg-outliers-fp32", ConvertOptions(progress=False, lora=False))
    kl = {}
    for method in ("rtn", "awq"):
        pkg = load_package(convert(str(outlier_model_dir), workdir / f"pkg-outliers-{method}",
                                   ConvertOptions(quant="int4", method=method, block_size=64, progress=False,
                                                  lora=False)))
        assert pkg.manifest["quantization"]["method"] == method
        tok_ids = list(range(3, 200, 3))  # the model is random: any ids will do
        kl[method] = quality(teacher_forced_logprobs(fp32, tok_ids), teacher_forced_logprobs(pkg.path, tok_ids),
                             tok_ids)["kl"]
    assert kl["awq"] < 0.7 * kl["rtn"], kl


def test_awq_options_errors(tiny_model_dir, workdir, tmp_path):
    from exporter.convert import ConvertOptions, convert

    with pytest.raises(RuvLLMError, match="--method awq applies to --quant int8/int4"):
        convert(str(tiny_model_dir("llama")), workdir / "x", ConvertOptions(quant="fp32", method="awq"))
    with pytest.raises(RuvLLMError, match="unknown --method"):
        convert(str(tiny_model_dir("llama")), workdir / "x", ConvertOptions(quant="int4", method="spqr"))
    with pytest.raises(RuvLLMError, match="--method awq\\+gptq applies to --quant int8/int4"):
        convert(str(tiny_model_dir("llama")), workdir / "x", ConvertOptions(quant="w8a8", method="awq+gptq"))
    with pytest.raises(RuvLLMError, match="--calibration .*nope.txt"):
        convert(str(tiny_model_dir("llama")), workdir / "x",
                ConvertOptions(quant="int4", method="awq", calibration=str(tmp_path / "nope.txt"), progress=False))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(RuvLLMError, match="calibration text too short"):
        convert(str(tiny_model_dir("llama")), workdir / "x",
                ConvertOptions(quant="int4", method="awq", calibration=str(short), progress=False))
    assert not (workdir / "x").exists()


def test_weight_plan_defaults():
    """int4 defaults to AWQ in blocks of AWQ_INT4_BLOCK, the MLP too, and so do GPTQ and AWQ+GPTQ; int8
    and explicit RTN keep blocks of 32; --mlp-block-size gives the MLP its own."""
    from exporter.options import AWQ_INT4_BLOCK, ConvertOptions, weight_plan

    def plan(**kw):
        o = weight_plan(ConvertOptions(**kw))
        return o.method, o.block_size, o.mlp_block_size

    assert plan(quant="int4") == ("awq", AWQ_INT4_BLOCK, None)
    assert plan(quant="int4", target="wasm") == ("awq", AWQ_INT4_BLOCK, None)
    assert plan(quant="int4", method="rtn") == ("rtn", 32, None)
    for method in ("gptq", "awq+gptq"):  # every calibrated method, as documented
        assert plan(quant="int4", method=method) == (method, AWQ_INT4_BLOCK, None)
    assert plan(quant="int4", block_size=128) == ("awq", 128, None)
    assert plan(quant="int4", mlp_block_size=128) == ("awq", AWQ_INT4_BLOCK, 128)
    assert plan(quant="int4", mlp_block_size=AWQ_INT4_BLOCK) == ("awq", AWQ_INT4_BLOCK, None)  # one width
    assert plan(quant="int8") == ("rtn", 32, None)
    assert plan(quant="int8", method="awq") == ("awq", 32, None)
    assert plan(quant="fp32") == ("rtn", 32, None)  # nothing is quantized: the plan is moot
    for bad in (0, 24, 8):
        with pytest.raises(RuvLLMError, match="--block-size must be a power of two"):
            plan(quant="int4", block_size=bad)


def test_clip_search_by_row_chunks_is_the_whole_search(monkeypatch):
    """The clipping search goes CLIP_ROWS output rows at a time (memory); each block's choice is the same."""
    import exporter.quantizers.awq as awq

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=gen), torch.randn(40, 128, generator=gen)
    monkeypatch.setattr(awq, "CLIP_ROWS", 16)
    chunked = awq._search_clip(x, w, 32, 4)
    monkeypatch.setattr(awq, "CLIP_ROWS", 1 << 20)
    assert torch.equal(chunked, awq._search_clip(x, w, 32, 4))
    assert not torch.equal(chunked, w)  # something was clipped
