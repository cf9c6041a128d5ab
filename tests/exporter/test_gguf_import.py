"""A GGUF's own blocks reach the package exactly: every weight dequantizes bit-equal to gguf's own
dequantization, for each block type, on tiny GGUF files the test writes with the `gguf` package."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from exporter.quantizers.grid import Grid, stack_rows
from exporter.sources import gguf_blocks

TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q2_K", "Q3_K")
TEST_VOCAB = 4096  # SmolLM2's first tokens: a real BPE vocabulary (its specials, its chat template), 12x smaller


def add_smollm2_tokenizer(w, smol_gguf, size: int | None = TEST_VOCAB) -> int:
    """SmolLM2's tokenizer metadata into GGUFWriter `w`, cut to its first `size` tokens and the merges among
    them: a GGUF of the tests' own reads, parses and exports in a fraction of the full vocabulary's time.
    Returns the vocabulary's size."""
    from runtime.formats.gguf_file import read_header_file

    meta = read_header_file(smol_gguf).metadata
    tokens = meta["tokenizer.ggml.tokens"][:size]  # size None: all
    kept = set(tokens)
    for key, value in meta.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            w.add_array(key, tokens)
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, value[:size])
        elif key == "tokenizer.ggml.merges":
            w.add_array(key, [m for m in value if (a := m.split(" ", 1))[0] in kept and a[1] in kept and a[0] + a[1] in kept])
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            raise AssertionError(f"{key}: {type(value)}")
    return len(tokens)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks [rows, bytes]: gguf's own quantizer where it has one, else random bytes with sane
    fp16 scales (gguf-py only dequantizes K-quants)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    elems, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // elems, size), dtype=np.uint8)
    scale = lambda n: (rng.random((n, 1)) * 4e-4 + 1e-4).astype(np.float16).view(np.uint8)  # noqa: E731
    n = blocks.shape[0]
    if type_name == "Q6_K":  # int8 sub-block scales: kept small, as a real file's are
        blocks[:, 192:208] = rng.integers(-24, 24, (n, 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = scale(n)
    elif type_name == "Q3_K":  # d last
        blocks[:, 108:110] = scale(n)
    elif type_name == "Q2_K":  # d and dmin last
        blocks[:, 80:82], blocks[:, 82:84] = scale(n), scale(n)
    else:  # d and dmin first
        blocks[:, 0:2], blocks[:, 2:4] = scale(n), scale(n)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", TYPES)
def test_each_block_type_decodes_to_gguf_own_dequantization(type_name):
    from gguf import GGMLQuantizationType, quants

    rows, cols = 48, 512
    data = random_blocks(type_name, rows, cols)
    want = quants.dequantize(data, GGMLQuantizationType[type_name])
    grid = gguf_blocks.decode(data, type_name, rows, cols)
    assert grid.q.max() < 2 ** grid.bits
    assert np.array_equal(grid.dequantize().view(np.uint32), want.view(np.uint32))


def test_fused_weights_keep_every_part_exact():
    """q/k/v of different types in one fused weight: finest block, widest format, zero points moved
    into minimums where a part has minimums, and still exact."""
    parts = [gguf_blocks.decode(random_blocks(t, 32, 256, i), t, 32, 256)
             for i, t in enumerate(("Q4_0", "Q4_1", "Q6_K"))]
    fused = stack_rows(parts)
    assert (fused.block, fused.bits) == (16, 8) and fused.mins is not None and not fused.zero.any()
    want = np.concatenate([p.dequantize() for p in parts])
    # equal as numbers; a zero weight may change sign (8s + (-8s) is +0 where (8 - 8) * s is -0 for s < 0)
    assert np.array_equal(fused.dequantize(), want)


def write_tiny_gguf(path, smol_gguf, type_name: str, split_max_tensors: int = 0) -> None:
    """A 2-layer llama with SmolLM2's tokenizer: projections in `type_name`, embedding Q8_0, norms F32. With
    split_max_tensors, gguf-split's parts (`<stem>-00001-of-0000N.gguf` beside `path`) instead of one file."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    hidden, inter, layers, heads, kv_heads = 256, 512, 2, 4, 2
    vocab = add_smollm2_tokenizer(w, smol_gguf)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(7)

    def quantized(name: str, rows: int, cols: int, t: str = type_name) -> None:
        w.add_tensor(name, random_blocks(t, rows, cols, seed=len(name) + rows), raw_dtype=gguf.GGMLQuantizationType[t])

    quantized("token_embd.weight", vocab, hidden, "Q8_0")
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    hd = hidden // heads
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for name, rows, cols in (("attn_q", heads * hd, hidden), ("attn_k", kv_heads * hd, hidden),
                                 ("attn_v", kv_heads * hd, hidden), ("attn_output", hidden, heads * hd),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            quantized(f"{p}{name}.weight", rows, cols)
    assert qtype is not None
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def package_weights(pkg_dir) -> dict[str, np.ndarray]:
    """Each MatMulNBits weight of the package's graph, and each one written in a kernel's layout (ruvllm.MatMulQ4/Q8
    with a kquant: a GGUF type at its own bits, an int4 grid), dequantized as the graph defines it, [N, K]."""
    import re

    from runtime.backends.block_layouts import dequantize_node

    model = onnx.load(str(pkg_dir / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out, parts = {}, {}
    for node in model.graph.node:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        if node.op_type in ("MatMulQ4", "MatMulQ8") and a.get("kquant"):  # a GGUF type at its own bits, an int4 grid
            w = dequantize_node(a, inits[node.input[1]])
            name, part = re.match(r"(.*?)(?:_part(\d+))?_Q\d[K01G]$", node.input[1]).groups()
            parts.setdefault(name, {})[int(part or 0)] = w
            continue
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        n, k, bits, block = a["N"], a["K"], a["bits"], a["block_size"]
        raw, scale, zp = (inits[name] for name in node.input[1:4])
        if bits == 4:
            q = np.stack([raw & 15, raw >> 4], -1).reshape(n, k)
            z = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :k // block]
        else:
            q, z = raw.reshape(n, k), zp.reshape(n, -1)
        w = node.input[1].rsplit("_Q", 1)[0]
        mins = inits.get(f"{w}_mins_fp16", inits.get(f"{w}_mins"))
        grid = Grid(q, scale.reshape(n, -1).astype(np.float32), z, block, bits,
                    None if mins is None else mins.astype(np.float32).T)
        out[w] = grid.dequantize()
    for name, ws in parts.items():
        out[name] = np.concatenate([ws[i] for i in sorted(ws)])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"))
def test_tiny_gguf_package_is_the_file_bit_for_bit(type_name, smol_gguf, workdir):
    """Export a GGUF written here (the default int4 recipe), then compare every projection and the LM
    head of the package with transformers' load of the same file (gguf's dequantization, q/k rows in
    transformers' order); the package also runs and its logits match transformers' closely."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.builders import FUSED_PROJECTIONS
    from exporter.convert import ConvertOptions, convert
    from runtime.package import load_package
    from tests.exporter.test_quantization import teacher_forced_logits

    path = workdir / f"tiny-{type_name}.gguf"
    write_tiny_gguf(path, smol_gguf, type_name)
    pkg_dir = convert(str(path), workdir / f"pkg-gguf-{type_name}", ConvertOptions(quant="int4", progress=False,
                                                                                     lora=False))
    manifest = load_package(pkg_dir).manifest["quantization"]
    assert manifest["method"] == "gguf" and manifest["gguf"]["exact"], manifest
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    got = package_weights(pkg_dir)
    want = {f"layers.{i}.{fused}": np.concatenate([hf[f"model.layers.{i}.{p}.weight"] for p in parts])
            for i in range(2) for fused, parts in FUSED_PROJECTIONS.items()}
    want["lm_head"] = hf["lm_head.weight"]
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert np.array_equal(got[name].view(np.uint32), w.view(np.uint32)), name
    ids = list(range(100, 140))
    ours = teacher_forced_logits(pkg_dir, ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    # int8 activations (accuracy level 4) are the only rounding between the two
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ("Q4_0", "Q4_1"))
def test_int8_package_of_a_4_bit_gguf(type_name, smol_gguf, workdir):
    """--quant int8 carries 4-bit blocks without minimums (Q4_0) over exactly on an 8-bit grid; blocks with
    minimums (Q4_1) it quantizes again with RTN int8 (their minimum term computes worse at int8: see
    gguf_blocks.graph_grids), close to the file's weights, the Q8_0 head still the file's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.builders import FUSED_PROJECTIONS
    from exporter.convert import ConvertOptions, convert
    from runtime.package import load_package

    path = workdir / f"tiny-{type_name}-int8.gguf"
    write_tiny_gguf(path, smol_gguf, type_name)
    pkg_dir = convert(str(path), workdir / f"pkg-gguf-{type_name}-int8", ConvertOptions(quant="int8", progress=False,
                                                                                          lora=False))
    meta = load_package(pkg_dir).manifest["quantization"]["gguf"]
    projections = {f"model.layers.{i}.{p}.weight" for i in range(2) for parts in FUSED_PROJECTIONS.values()
                   for p in parts}
    assert (set(meta["requantized"]) == projections) == (type_name == "Q4_1"), meta["requantized"]
    assert meta["exact"] == (type_name == "Q4_0")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    got = package_weights(pkg_dir)
    assert np.array_equal(got["lm_head"], hf["lm_head.weight"])
    for i in range(2):
        for fused, parts in FUSED_PROJECTIONS.items():
            want = np.concatenate([hf[f"model.layers.{i}.{p}.weight"] for p in parts])
            w = got[f"layers.{i}.{fused}"]
            if type_name == "Q4_0":
                assert np.array_equal(w, want), fused
            else:  # RTN int8 in blocks of 32: within half a step of each block's largest weight / 127
                step = np.abs(want.reshape(want.shape[0], -1, 32)).max(-1, keepdims=True) / 127
                assert (np.abs(w - want).reshape(step.shape[0], -1, 32) <= step * 0.5 + 1e-7).all(), fused


def test_method_gguf_needs_a_gguf_and_another_method_warns(tiny_model_dir, workdir, capsys):
    from exporter.convert import ConvertOptions, weight_plan
    from runtime.errors import RuvLLMError

    assert weight_plan(ConvertOptions(quant="int4"), "gguf").method == "gguf"
    assert weight_plan(ConvertOptions(quant="int8"), "gguf").method == "gguf"
    assert weight_plan(ConvertOptions(quant="fp32"), "gguf").method == "rtn"
    assert weight_plan(ConvertOptions(quant="int4"), "folder").method == "awq"
    with pytest.raises(RuvLLMError, match="needs a .gguf source"):
        weight_plan(ConvertOptions(quant="int4", method="gguf"), "folder")
    with pytest.raises(RuvLLMError, match="do not apply"):
        weight_plan(ConvertOptions(quant="int4", block_size=64), "gguf")
    assert weight_plan(ConvertOptions(quant="int4", method="awq"), "gguf").method == "awq"
    assert "a second time" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_gguf_page_format_computes_with_the_files_weights(smol_gguf, workdir):
    """--target wasm folds the blocks' minimums into the weights it dequantizes at load: with fp32
    compute, its logits are transformers' on the same file up to fp32 summation order."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.convert import ConvertOptions, convert
    from tests.conftest import external_refs
    from tests.exporter.test_quantization import teacher_forced_logits

    path = workdir / "tiny-Q4_1-page.gguf"
    write_tiny_gguf(path, smol_gguf, "Q4_1")
    pkg_dir = convert(str(path), workdir / "pkg-gguf-Q4_1-wasm", ConvertOptions(quant="int4", target="wasm", progress=False))
    graph = onnx.load(str(pkg_dir / "model.onnx"), load_external_data=False).graph
    assert [n for n in graph.node if n.op_type == "Add" and n.name.endswith("/add_mins")]  # folded at load
    assert not [n for n in graph.node if n.op_type in ("MatMulNBits", "Gemm") and n.name.endswith("/add_mins")]
    # the WebGPU graph keeps the minimum term; it reads the minimums from the bytes the WASM graph folds
    gpu = onnx.load(str(pkg_dir / "model_webgpu.onnx"), load_external_data=False).graph
    assert [n for n in gpu.node if n.op_type == "Gemm" and n.name.endswith("/add_mins")]
    cpu_refs = set(external_refs(graph).values())
    gpu_only = {name for name, ref in external_refs(gpu).items() if ref not in cpu_refs}
    assert all(name.endswith("/block_ones") for name in gpu_only), gpu_only
    ids = list(range(100, 140))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(teacher_forced_logits(pkg_dir, ids) - ref).max() < 1e-4 * np.abs(ref).max()


@pytest.mark.slow
def test_smollm2_default_package_is_as_good_as_its_gguf(smol_fp32, smol_int4, workdir):
    """The embedded GGUF's default int4 package and its page format against the fp32 export (the file's
    exact dequantization), teacher-forced on 2,048 tokens the project did not write (CPython's LICENSE.txt).

    The weights are the file's bit for bit, so what is left natively is the int8 quantization of the
    activations (accuracy level 4, in blocks of 32, as llama.cpp's Q8_1 does for Q4_1). On RuvLLM's
    MatMulQ4 (AVX2 or AVX-512), measured here: KL 0.0034, perplexity 7.692 vs 7.666 (+0.34%), top-1 97%,
    as llama.cpp on the same file (0.0034, +0.13%): the issue's bound is KL <= 0.01 and perplexity within
    1%. On onnxruntime's own kernels (no AVX2, or RUVLLM_CPU_KERNELS=0) its AVX2 int8 path and the fp32
    block sums beside it give KL 0.018, +2.0%: a looser bound there. The page computes in fp32: KL ~0.
    Before (AWQ re-quantizing the file in blocks of 64): KL 0.265, perplexity 9.15 (+19%), top-1 78%.
    """
    from exporter.convert import ConvertOptions, convert
    from exporter.evaluate import held_out_text
    from runtime.package import load_package
    from runtime.text.tokenizer import Tokenizer
    from tests.exporter.test_quantization import quality, teacher_forced_logprobs

    pkg = load_package(smol_int4)
    q = pkg.manifest["quantization"]
    assert q["method"] == "gguf" and q["gguf"]["exact"] and q["gguf"]["lm_head"] == "the file's own, exact", q
    page = convert("smollm2-135m", workdir / "smol-int4-page", ConvertOptions(target="wasm", progress=False, lora=False))
    ids = Tokenizer.from_file(pkg.file("tokenizer.json"), pkg.manifest["tokenizer"]).encode(held_out_text())[:2048]
    assert len(ids) == 2048
    ref = teacher_forced_logprobs(smol_fp32, ids)
    native = quality(ref, teacher_forced_logprobs(smol_int4, ids), ids)
    in_page = quality(ref, teacher_forced_logprobs(page, ids), ids)
    print(f"native int4: {native}\npage format: {in_page}")
    assert in_page["kl"] < 1e-3 and in_page["ppl"] < 1.002 * in_page["ppl_ref"] and in_page["top1"] > 0.99, in_page
    from runtime.backends.native import NativeBackend

    if NativeBackend(pkg).matmul_kernel.startswith("ruvllm.MatMulQ4"):
        assert native["kl"] <= 0.01 and native["ppl"] <= 1.01 * native["ppl_ref"] and native["top1"] > 0.95, native
    else:
        assert native["kl"] < 0.025 and native["ppl"] < 1.03 * native["ppl_ref"] and native["top1"] > 0.91, native
