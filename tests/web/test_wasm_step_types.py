"""The page's WASM step on every common GGUF block type at its own bits (issue 48): each type's rows and
products exactly gguf's dequantization, step.bin the file's size, and a whole model of each type giving
the native engine's logits on the same file."""

from __future__ import annotations

import numpy as np
import pytest

from exporter.step_weights import STEP_TYPES
from tests.exporter.test_gguf_import import random_blocks
from tests.exporter.test_streamed_export import MIX, write_mixed_gguf
from tests.web.test_wasm_step import prompt_kl

TYPES = list(STEP_TYPES)


@pytest.fixture(scope="module")
def step_wasm(workdir):
    from wasm.step_module import FALLBACK, build

    out = workdir / "wasm-step-types"
    out.mkdir(exist_ok=True)
    return {"step.wasm": build(out / "step.wasm"), FALLBACK: build(out / FALLBACK, relaxed=False)}


def one_matrix_gguf(path, type_name: str, rows: int, cols: int) -> np.ndarray:
    """A GGUF whose only matrices are one random matrix of `type_name`, as every role step.c reads;
    returns its raw blocks."""
    import gguf

    blocks = random_blocks(type_name, rows, cols, seed=len(type_name) + rows)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, cols), (w.add_feed_forward_length, cols),
                       (w.add_block_count, 1), (w.add_head_count, cols // 64), (w.add_head_count_kv, cols // 64),
                       (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    qtype = gguf.GGMLQuantizationType[type_name]
    square = random_blocks(type_name, cols, cols, seed=1)
    w.add_tensor("token_embd.weight", blocks, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(cols, np.float32))
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", np.ones(cols, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        w.add_tensor(f"blk.0.{name}.weight", square, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return blocks


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_is_gguf_own_dequantization_in_the_step(type_name, step_wasm, tmp_path):
    """Rows read back bit for bit as gguf dequantizes them; products equal the dequantized matrix times
    the activations as the step rounds them (int8 per block of 32), to fp32 rounding, in both builds;
    step.bin no bigger than the file but for the K-quants' byte scales (+1/8 bit a weight)."""
    from gguf import GGMLQuantizationType, quants

    from exporter.step_weights import write_step_weights
    from wasm.step_module import FALLBACK, WasmStep

    rows, cols = 96, 512
    path = tmp_path / f"{type_name}.gguf"
    blocks = one_matrix_gguf(path, type_name, rows, cols)
    want = quants.dequantize(blocks, GGMLQuantizationType[type_name]).reshape(rows, cols)
    index = write_step_weights(path, tmp_path, max_pos=64)
    size = sum(a["bytes"] for a in index["arrays"] if a["name"] != "rope")  # RoPE's table: not in the file
    assert size <= path.stat().st_size * (1.03 if type_name in ("Q4_K", "Q5_K") else 1.0), (size, path.stat().st_size)
    x = np.random.default_rng(7).standard_normal((3, cols)).astype(np.float32)
    # the activations as the step rounds them: per block of 32, scale max / 127, round half to even
    xb = x.reshape(3, -1, 32)
    scale = np.abs(xb).max(-1, keepdims=True).astype(np.float32) / np.float32(127)
    xq = np.rint(xb * (np.float32(127) / np.abs(xb).max(-1, keepdims=True))) * scale
    ref = xq.reshape(3, cols).astype(np.float64) @ want.T.astype(np.float64)
    for module in ("step.wasm", FALLBACK):
        step = WasmStep(step_wasm[module], tmp_path, 4, 16, max_tokens=8)
        for r in (0, 1, 37, rows - 1):
            np.testing.assert_array_equal(step.dequantize("embd", r, cols), want[r])
        got = step.project("embd", x)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
        assert np.array_equal(step.project("embd", x[:1])[0], got[0])  # alone or beside others: the same numbers


@pytest.fixture(scope="module")
def native_engine_for(workdir, smol_gguf):
    """A GGUF of the given projection type (a Q6_K embedding, a Q8_0 head) and its native int4 package."""
    from exporter.convert import ConvertOptions, convert

    made = {}

    def make(type_name: str, embedding: str = "Q6_K", head: str | None = "Q8_0", arch: str = "llama"):
        key = (type_name, embedding, head, arch)
        if key not in made:
            path = workdir / f"step-{arch}-{type_name}-{embedding}-{head}.gguf"
            write_mixed_gguf(path, smol_gguf, {name: type_name for name in MIX}, embedding=embedding, head=head, arch=arch)
            pkg = convert(str(path), workdir / f"step-pkg-{arch}-{type_name}-{embedding}-{head}",
                          ConvertOptions(quant="int4", progress=False, lora=False))
            made[key] = (path, pkg)
        return made[key]

    return make


@pytest.mark.slow
@pytest.mark.parametrize("type_name,embedding,head,arch", [(t, "Q6_K", "Q8_0", "llama") for t in TYPES] +
                         [("Q4_K", "Q4_K", None, "llama"), ("Q5_0", "Q8_0", None, "qwen2"), ("Q5_0", "Q8_0", None, "gemma3")])
def test_a_model_of_each_type_gives_the_native_engines_logits(type_name, embedding, head, arch, native_engine_for,
                                                             step_wasm, tmp_path):
    """A whole model whose projections are all of one type, teacher-forced through a prompt in one step:
    the step's log-probabilities against the native engine's on the same file (mean KL under 1e-3),
    with an untied head of its own type or the embedding as the head, a llama, a Qwen2 (biases, RoPE
    on halves) or a Gemma 3 (GeGLU, head norms, sandwich norms, scaled embeddings, sliding layers with a
    RoPE base of their own and a global one: the prompt is longer than the window)."""
    from exporter.step_weights import write_step_weights

    path, pkg = native_engine_for(type_name, embedding, head, arch)
    write_step_weights(path, tmp_path, max_pos=256)
    kl, _ = prompt_kl(pkg, step_wasm["step.wasm"], tmp_path)
    assert kl.mean() < 1e-3 and kl.max() < 1e-2, (kl.mean(), kl.max())


def test_a_file_the_step_cannot_read_is_named(workdir, smol_gguf, tmp_path):
    """An F16 matrix (or a Q2_K / Q3_K / IQ one) names the tensor and the types the step reads; the
    package then has no step, and the page runs onnxruntime-web."""
    from exporter.step_weights import package_step, write_step_weights
    from runtime.errors import PackageError

    path = tmp_path / "f16.gguf"
    write_mixed_gguf(path, smol_gguf)  # its ffn_down is F16
    with pytest.raises(PackageError, match=r"blk\.0\.ffn_down\.weight is F16 .*Q4_K"):
        write_step_weights(path, tmp_path, max_pos=64)
    assert package_step(path, tmp_path, 64, progress=False) is None


@pytest.mark.parametrize("type_name,embedding,head,arch", [("Q4_K", "Q4_K", None, "llama"), ("Q5_0", "Q8_0", None, "gemma3")])
def test_the_pages_package_of_a_gguf_is_the_exporters(type_name, embedding, head, arch, native_engine_for):
    """What the page makes of a GGUF's header alone (runtime/formats/gguf_page.py, no weights read) says what
    the exporter's package of the same file says: the model's shape and compute, the graph I/O its step
    feeds follow, the tokenizer and its special tokens, the template, the sampling defaults, step.json."""
    import json

    from runtime.formats.gguf_file import read_header_file
    from runtime.formats.gguf_page import page_package
    from runtime.package import load_package

    path, pkg = native_engine_for(type_name, embedding, head, arch)
    files, plan = page_package(read_header_file(path), "m", str(path))
    got, want = json.loads(files["manifest.json"]), json.loads((pkg / "manifest.json").read_text())
    drop = lambda cfg: {k: v for k, v in cfg.items() if k != "num_parameters"}  # noqa: E731 (ours counts every norm)
    assert drop(got["config"]) == drop(want["config"])
    assert got["architecture"] == want["architecture"] and got["io"] == want["io"]
    assert got["tokenizer"] == {k: v for k, v in want["tokenizer"].items() if k != "chat_template"} | {"file": "tokenizer.json"}
    assert got["special_tokens"] == want["special_tokens"]
    assert json.loads(files["tokenizer.json"])["model"] == json.loads((pkg / "tokenizer.json").read_text())["model"]
    if (pkg / "chat_template.jinja").exists():
        assert files["chat_template.jinja"] == (pkg / "chat_template.jinja").read_bytes()
    gen = json.loads(files["generation_config.json"])
    assert gen == {k: json.loads((pkg / "generation_config.json").read_text())[k] for k in gen}
    assert json.loads(files["step.json"]) == plan.index()
    assert got["files"]["step.bin"] == {"size": plan.size}
    folder = path.parent / f"page-{arch}"  # the runtime reads it as a package (the step's files elsewhere)
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    load_package(folder, elsewhere=("step.bin",))
