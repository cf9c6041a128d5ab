"""AWQ and GPTQ one decoder layer at a time on a streamed source (quantizers/layerwise.py): the same
package as the whole-model path where both calibrate on the same text, without ever loading the model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.exporter.test_quantization import TEXT


def initializers(pkg_dir, graph: str) -> dict[str, np.ndarray]:
    model = onnx.load(str(pkg_dir / graph))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "gptq", "awq+gptq"])
def test_layer_by_layer_makes_the_whole_model_paths_package(method, tiny_model_dir, workdir, tmp_path, monkeypatch):
    """With --layerwise the model is never loaded whole, and both graphs' weights (the projections' scales
    and zero points, AWQ's folded norms, the LoRA graph's undoing of its scales) equal the whole-model
    export's, calibrated on the same text (a file: the whole-model GPTQ then samples nothing); so do the
    projections' integers, but for a few that round the other way (the whole path rounds with onnxruntime's
    quantizer: ties and clipped extremes, here 0.1-0.6 % of the AWQ weights, one step)."""
    import exporter.convert as conv
    import exporter.sources.locate as locate
    from runtime.package import load_package
    from tests.exporter.test_gguf_import import package_weights

    text = tmp_path / "calibration.txt"
    text.write_text(TEXT * 20)
    opts = dict(quant="int4", method=method, block_size=16, calibration=str(text), progress=False)
    whole = conv.convert(str(tiny_model_dir("llama")), workdir / f"pkg-whole-{method}",
                         conv.ConvertOptions(**opts, layerwise=False))
    monkeypatch.setattr(conv, "load_model_and_tokenizer", lambda *a: pytest.fail("the model was loaded whole"))
    monkeypatch.setattr(locate, "load_model_and_tokenizer", lambda *a: pytest.fail("the model was loaded whole"))
    layerwise = conv.convert(str(tiny_model_dir("llama")), workdir / f"pkg-layerwise-{method}",
                             conv.ConvertOptions(**opts, layerwise=True))
    for graph in ("model.onnx", "model_lora.onnx"):
        a, b = initializers(whole, graph), initializers(layerwise, graph)
        # the builders number their constants in order (compared as a set); the integers are compared below
        named = [k for k in a if not k.startswith("const_") and not k.endswith(("_Q4", "_Q8"))]
        assert len(a) == len(b) and set(named) <= set(b), graph
        differ = [k for k in named if a[k].shape != b[k].shape or not np.allclose(a[k], b[k], rtol=1e-5, atol=1e-6)]
        assert not differ, (graph, differ[:5])
        consts = [sorted((v for k, v in x.items() if k.startswith("const_")), key=lambda v: (v.shape, v.sum()))
                  for x in (a, b)]
        assert all(u.shape == v.shape and np.allclose(u, v, rtol=1e-5, atol=1e-6) for u, v in zip(*consts)), graph
    a, b = package_weights(whole), package_weights(layerwise)
    scales = initializers(whole, "model.onnx")
    assert sorted(a) == sorted(b)
    for name in a:  # GPTQ's integers are its own in both; RTN's (AWQ alone, the head) may round apart by one step
        off = np.abs(a[name] - b[name])
        assert (off > 0).mean() <= (0 if method != "awq" and name != "lm_head" else 0.01), name
        s = scales[f"{name}_scales"].reshape(off.shape[0], -1)
        step = np.repeat(s, -(-off.shape[1] // s.shape[1]), axis=1)[:, :off.shape[1]]
        assert (off <= step * 1.0001).all(), name
    q = load_package(layerwise).manifest["quantization"]
    assert q["method"] == method and q["calibration"] == "calibration.txt"
    if "gptq" in method:
        assert "layer by layer" in q["gptq"]["calibration"]


def test_large_models_go_layer_by_layer(tiny_model_dir, monkeypatch):
    """Without --layerwise, AWQ and GPTQ stream when the model's fp32 weights pass a quarter of the memory;
    RTN and the GGUF's own blocks always stream, HQQ never."""
    import exporter.streamed as streamed
    from exporter.options import ConvertOptions
    from exporter.sources.locate import resolve

    source = resolve(str(tiny_model_dir("llama")))
    n = streamed.source_parameters(source)
    assert n > 10_000
    memory = 4096 * (16 * 4 * n // 4096)  # fp32 weights: a sixteenth of this
    monkeypatch.setattr("os.sysconf", lambda key: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": memory // 4096}[key])
    small = ConvertOptions(quant="int4", method="awq")
    assert not streamed.streams(source, small, "llama")
    monkeypatch.setattr("os.sysconf", lambda key: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": memory // 4096 // 8}[key])
    for method in ("awq", "gptq", "awq+gptq", "rtn"):
        assert streamed.streams(source, ConvertOptions(quant="int4", method=method), "llama"), method
    assert not streamed.streams(source, ConvertOptions(quant="int4", method="hqq"), "llama")
    assert not streamed.streams(source, ConvertOptions(quant="int4", method="awq", layerwise=False), "llama")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_layer_by_layer_on_a_gguf_leaves_the_file_alone(method, smol_gguf, workdir, tmp_path):
    """A GGUF's F32 tensors (its norms) are read-only views of the file's map; AWQ folds its scales into the
    norms in place, which wrote into that map and crashed the process. In a process of its own: the export
    completes, AWQ's scales are folded into the package's norms, and the file is unchanged."""
    import hashlib
    import subprocess
    import sys

    from tests.exporter.test_gguf_import import write_tiny_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, smol_gguf, "Q8_0")
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT * 20)
    out = tmp_path / f"pkg-{method}"
    proc = subprocess.run([sys.executable, "-m", "exporter", "convert", str(gguf_path), "-o", str(out), "--quant",
                           "int4", "--method", method, "--layerwise", "--calibration", str(text), "--no-lora", "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert hashlib.sha256(gguf_path.read_bytes()).hexdigest() == digest
    import gguf

    graph = initializers(out, "model.onnx")
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    moved = []
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        i, kind = t.name.split(".")[1:3] if t.name.startswith("blk.") else (None, None)
        if kind in names:
            folded = graph[f"layers.{i}.{names[kind]}"]
            assert np.isfinite(folded).all()
            moved.append(not np.array_equal(folded, np.asarray(t.data)))
    assert len(moved) == 4 and any(moved) == (method == "awq")  # AWQ divides norms by its scales, GPTQ does not
