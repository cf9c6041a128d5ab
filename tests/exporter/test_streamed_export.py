"""A GGUF is exported tensor by tensor: never loaded whole, yet the same weights transformers loads."""

from __future__ import annotations

import numpy as np
import pytest

from tests.exporter.test_gguf_import import TEST_VOCAB, add_smollm2_tokenizer, package_weights, random_blocks

pytestmark = pytest.mark.slow

# a llama.cpp-style mix: 4-bit K-quants, 6-bit where it matters, the 5/8-bit fallbacks, and an F16 matrix
MIX = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
       "ffn_up": "Q8_0", "ffn_down": "F16"}


def write_mixed_gguf(path, smol_gguf, mix: dict[str, str] = MIX, embedding: str = "Q6_K", head: str | None = "Q8_0",
                     arch: str = "llama", metadata: dict | None = None, vocab: int | None = TEST_VOCAB) -> None:
    """A tiny llama (or Qwen2: q, k and v with biases; or Gemma 3: six layers, the last global, the others on a
    window of 8, head norms and norms after attention and the MLP, stored as llama.cpp's converter stores
    Gemma's: 1 + w) GGUF with SmolLM2's vocabulary, random blocks of `mix`'s types (by tensor), the
    embedding's, and an untied head's (None: tied to the embedding); `metadata`: more keys (a float as
    float32, an int as int32); `vocab`: SmolLM2's first tokens only (None: all 49,152; the logits bounds below
    were set on those)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    gemma = arch == "gemma3"
    hidden, inter, layers, heads, kv_heads = 256, 512, 6 if gemma else 2, 4, 2
    vocab = add_smollm2_tokenizer(w, smol_gguf, vocab)
    for add, value in ((w.add_context_length, 256), (w.add_embedding_length, hidden), (w.add_feed_forward_length, inter),
                       (w.add_block_count, layers), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_rope_freq_base, 1e6 if gemma else 10000.0), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_vocab_size, vocab)):
        add(value)
    if gemma:
        w.add_key_length(hidden // heads)
        w.add_value_length(hidden // heads)
        w.add_sliding_window(8)
    for key, value in (metadata or {}).items():
        (w.add_float32 if isinstance(value, float) else w.add_int32)(key, value)
    rng = np.random.default_rng(3)

    def tensor(name: str, rows: int, cols: int, t: str) -> None:
        if t == "F16":
            w.add_tensor(name, (0.05 * rng.standard_normal((rows, cols))).astype(np.float16))
        else:
            w.add_tensor(name, random_blocks(t, rows, cols, seed=int(rng.integers(1 << 30))),
                         raw_dtype=gguf.GGMLQuantizationType[t])

    tensor("token_embd.weight", vocab, hidden, embedding)
    if head:
        tensor("output.weight", vocab, hidden, head)  # untied: the head is its own tensor
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    hd = hidden // heads
    shapes = {"attn_q": (heads * hd, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, heads * hd), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if gemma:
            for name, n in (("attn_q_norm", hd), ("attn_k_norm", hd), ("post_attention_norm", hidden),
                            ("post_ffw_norm", hidden)):
                w.add_tensor(f"{p}{name}.weight", (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))
        for name, (rows, cols) in shapes.items():
            tensor(f"{p}{name}.weight", rows, cols, mix[name])
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"{p}{name}.bias", (0.5 * rng.standard_normal(rows)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mixed_gguf(smol_gguf, workdir):
    path = workdir / "tiny-mixed.gguf"
    write_mixed_gguf(path, smol_gguf, vocab=None)
    return path


def test_a_mixed_gguf_streams_into_the_files_own_blocks(mixed_gguf, workdir, monkeypatch):
    """int4 from a K-quant mix: every part with a grid here is carried bit for bit (q/k rows in
    transformers' order), the F16 matrix is RTN int4 in blocks of 32 and listed as such, and the model is
    never loaded: transformers' from_pretrained is not called."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from exporter.convert import ConvertOptions, convert
    from runtime.package import load_package
    from tests.exporter.test_quantization import teacher_forced_logits

    load = AutoModelForCausalLM.from_pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("the streamed export loaded the whole model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    pkg_dir = convert(str(mixed_gguf), workdir / "pkg-mixed", ConvertOptions(quant="int4", progress=False))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)

    meta = load_package(pkg_dir).manifest["quantization"]["gguf"]
    assert meta["requantized"] == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)], meta
    assert meta["lm_head"] == "the file's own, exact" and meta["embeddings"] == "Q6_K at the file's own bits"
    model = load(mixed_gguf.parent, gguf_file=mixed_gguf.name, dtype=torch.float32).eval()
    hf = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    got = package_weights(pkg_dir)
    for i in range(2):
        p = f"model.layers.{i}."
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            want = np.concatenate([hf[f"{p}{'self_attn' if fused == 'qkv_proj' else 'mlp'}.{x}.weight"] for x in parts])
            assert np.array_equal(got[f"layers.{i}.{fused}"], want), fused
        assert np.array_equal(got[f"layers.{i}.o_proj"].view(np.uint32), hf[p + "self_attn.o_proj.weight"].view(np.uint32))
        want = hf[p + "mlp.down_proj.weight"]  # RTN int4: within half a step of its block's range
        blocks = want.reshape(want.shape[0], -1, 32)
        step = (np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)) / 15
        err = np.abs(got[f"layers.{i}.down_proj"] - want).reshape(blocks.shape)
        assert (err <= step[..., None] * 0.5 + 1e-6).all()
    assert np.array_equal(got["lm_head"], hf["lm_head.weight"])
    ids = list(range(100, 140))
    with torch.no_grad():
        for i in range(2):  # the reference computes with the package's RTN weights where it has them
            model.model.layers[i].mlp.down_proj.weight.copy_(torch.from_numpy(got[f"layers.{i}.down_proj"]))
        ref = model(torch.tensor([ids])).logits[0].numpy()
    # int8 activations (accuracy level 4) alone: on RuvLLM's kernels (the file's own bits) as close to the
    # reference as on onnxruntime's own (the same weights as MatMulNBits)
    from runtime.backends import kernel_library

    ours = teacher_forced_logits(pkg_dir, ids)
    monkeypatch.setattr(kernel_library, "_library", (None, "compared"))
    plain = teacher_forced_logits(pkg_dir, ids)
    rel = lambda x: float(np.sqrt(((x - ref) ** 2).mean() / (ref ** 2).mean()))  # noqa: E731
    assert rel(ours) < 0.08 and rel(ours) <= 1.05 * rel(plain), (rel(ours), rel(plain))


def test_streamed_and_whole_exports_are_the_same_package(smol_gguf, workdir, monkeypatch):
    """The export that loads the model whole through transformers (what the page's targets and the
    calibrated methods still do) makes the same weights, bit for bit, on a mix of every type with a grid
    here (RTN, where a type has none, is onnxruntime's quantizer there)."""
    import exporter.convert as convert_module
    from exporter.convert import ConvertOptions, convert
    from tests.exporter.test_quantization import teacher_forced_logits

    path = workdir / "tiny-mixed-grids.gguf"
    write_mixed_gguf(path, smol_gguf, {**MIX, "ffn_down": "Q5_1", "attn_k": "Q4_0", "ffn_up": "Q4_1"})
    streamed = convert(str(path), workdir / "pkg-mixed-s", ConvertOptions(quant="int4", progress=False, lora=False))
    monkeypatch.setattr(convert_module, "streams", lambda *args: False)
    whole = convert(str(path), workdir / "pkg-mixed-w", ConvertOptions(quant="int4", progress=False, lora=False))
    a, b = package_weights(streamed), package_weights(whole)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    # the streamed package keeps the file's own bits for RuvLLM's kernel (the whole one: MatMulNBits grids, whose
    # minimum term meets the fp32 activation sums): only the activations' int8 rounding differs, and the kernel,
    # which rounds as llama.cpp does, is the closer to transformers' exact logits (here 0.047 against 0.082)
    import torch
    from transformers import AutoModelForCausalLM

    ids = list(range(100, 140))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    rel = lambda x: float(np.sqrt(((x - ref) ** 2).mean() / (ref ** 2).mean()))  # noqa: E731
    s_err, w_err = rel(teacher_forced_logits(streamed, ids)), rel(teacher_forced_logits(whole, ids))
    assert s_err < 0.08 and s_err <= w_err * 1.05, (s_err, w_err)


def test_graphs_share_each_weight_and_fp32_streams_too(mixed_gguf, workdir):
    """The LoRA graph adds no bytes (every weight is written once, by name); an fp32 export of the file
    (the exact reference) streams its float weights and matches transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.convert import ConvertOptions, convert
    from tests.exporter.test_quantization import teacher_forced_logits

    with_lora = workdir / "pkg-mixed"  # made by the test above, with the LoRA graph (the default)
    if not with_lora.exists():
        with_lora = convert(str(mixed_gguf), with_lora, ConvertOptions(quant="int4", progress=False))
    alone = convert(str(mixed_gguf), workdir / "pkg-mixed-nolora", ConvertOptions(quant="int4", progress=False,
                                                                                   lora=False))
    assert (with_lora / "model.onnx.data").stat().st_size == (alone / "model.onnx.data").stat().st_size
    fp32 = convert(str(mixed_gguf), workdir / "pkg-mixed-fp32", ConvertOptions(quant="fp32", progress=False))
    model = AutoModelForCausalLM.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name, dtype=torch.float32).eval()
    ids = list(range(100, 140))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(teacher_forced_logits(fp32, ids) - ref).max() < 1e-4 * np.abs(ref).max()


Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K"}  # llama.cpp's Q4_K_M mix in a layer that keeps v and down 6-bit
LOW_BITS = {"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q2_K", "attn_output": "Q3_K", "ffn_gate": "Q2_K",
            "ffn_up": "Q2_K", "ffn_down": "Q3_K"}  # the 2- and 3-bit K-quants of llama.cpp's Q2_K and Q3_K mixes
K_MIXES = {"Q4_K_M": (Q4_K_M, [1] * 6 + [2] * 4),  # per layer: q+k, o, gate+up (Q4_K); v, down (Q6_K)
           "Q2_K-Q3_K": (LOW_BITS, [9] * 6 + [10] * 4)}  # q+k, o, down (Q3_K); v, gate+up (Q2_K)


@pytest.mark.parametrize("mix", K_MIXES)
def test_k_quants_at_their_own_bits_run_with_and_without_the_kernels(mix, smol_gguf, workdir, monkeypatch):
    """A Q4_K_M-style file's projections stay at the file's bits (ruvllm.MatMulQ4's layouts: Q4_K 37/36 of
    the file's bytes, Q6_K the file's; q and k Q4_K beside a Q6_K v are two operators, concatenated), bit
    for bit transformers' weights; so do a Q2_K / Q3_K file's (Q2_K the file's bytes, Q3_K 57/55). With the
    kernels they compute as llama.cpp does (minimums times the quantized activations' sum); without them
    (RUVLLM_CPU_KERNELS=0, another provider) the same weights load as MatMulNBits. Both stay as close to
    transformers' logits as int8 activations allow."""
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.convert import ConvertOptions, convert
    from runtime.backends import graph_rewrite, kernel_library
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package
    from tests.exporter.test_quantization import teacher_forced_logits

    types, want_kinds = K_MIXES[mix]
    path = workdir / f"tiny-{mix}.gguf"
    write_mixed_gguf(path, smol_gguf, types, vocab=None)
    pkg_dir = convert(str(path), workdir / f"pkg-{mix}-own", ConvertOptions(quant="int4", progress=False))
    graph = onnx.load(str(pkg_dir / "model.onnx"), load_external_data=False).graph
    own = [n for n in graph.node if n.op_type == "MatMulQ4" and n.domain == "ruvllm"]
    kinds = sorted(next(a.i for a in n.attribute if a.name == "kquant") for n in own)
    assert kinds == want_kinds, kinds
    assert not [n for n in graph.node if n.op_type == "MatMulNBits" and "layers" in n.name]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    got = package_weights(pkg_dir)
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = np.concatenate([hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        assert np.array_equal(got[f"layers.{i}.qkv_proj"].view(np.uint32), qkv.view(np.uint32))
        assert np.array_equal(got[f"layers.{i}.down_proj"].view(np.uint32), hf[p + "mlp.down_proj.weight"].view(np.uint32))
    ids = list(range(100, 140))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    runs = {}
    if kernel_library.library()[0] is not None:
        assert NativeBackend(load_package(pkg_dir)).matmul_kernel.startswith("ruvllm.MatMulQ4 (10 of")
        runs["kernels"] = teacher_forced_logits(pkg_dir, ids)
    monkeypatch.setattr(kernel_library, "_library", (None, "turned off for the test"))
    assert NativeBackend(load_package(pkg_dir)).matmul_kernel.startswith("onnxruntime MatMulNBits")
    runs["onnxruntime"] = teacher_forced_logits(pkg_dir, ids)
    # a model too large for its portable weights in the graph (protobuf's 2 GB) hands them to the session in memory
    monkeypatch.setattr(graph_rewrite.cache, "CACHED_REWRITE_BYTES", 0)
    monkeypatch.setattr(graph_rewrite.cache, "_rewrite_cache", lambda: workdir / f"graphs-{mix}-in-memory")
    backend = NativeBackend(load_package(pkg_dir))
    backend.enable_lora(2, 4)  # the LoRA graph takes the same arrays, not a second conversion
    assert backend._portable and len(backend._in_memory) == 2
    assert [a.data_ptr() for a in backend._in_memory[0]] == [b.data_ptr() for b in backend._in_memory[1]]
    in_memory = teacher_forced_logits(pkg_dir, ids)
    assert np.array_equal(in_memory.view(np.uint32), runs["onnxruntime"].view(np.uint32))
    assert not list((workdir / f"graphs-{mix}-in-memory").glob("*.onnx"))  # needs its arrays: not cached
    scale = np.abs(ref).max()
    for name, logits in runs.items():  # int8 activations (K-quant mixes have wide rows: the max moves more)
        err = np.abs(logits - ref)
        assert err.mean() < 0.005 * scale and err.max() < 0.1 * scale, (name, err.mean() / scale, err.max() / scale)


def test_a_hugging_face_folder_streams_too(tiny_model_dir, workdir, monkeypatch):
    """A folder's safetensors are read tensor by tensor as a GGUF's are (fp32: transformers' logits; int8:
    RTN per tensor), never loading the model; a checkpoint that names its weights otherwise is not streamed
    (convert() then loads it whole, as before)."""
    import shutil

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from exporter.convert import ConvertOptions, convert
    from tests.exporter.test_quantization import teacher_forced_logits

    folder = tiny_model_dir("qwen2")
    load = AutoModelForCausalLM.from_pretrained
    model = load(folder, dtype=torch.float32).eval()
    ids = list(range(100, 140))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()

    def refuse(*args, **kwargs):
        raise AssertionError("the streamed export loaded the whole model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    fp32 = convert(str(folder), workdir / "pkg-qwen2-streamed-fp32", ConvertOptions(progress=False))
    int8 = convert(str(folder), workdir / "pkg-qwen2-streamed-int8", ConvertOptions(quant="int8", progress=False))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    assert np.abs(teacher_forced_logits(fp32, ids) - ref).max() < 1e-4 * np.abs(ref).max()
    assert np.abs(teacher_forced_logits(int8, ids) - ref).max() < 0.06 * np.abs(ref).max()
    renamed = workdir / "tiny-qwen2-renamed"  # weights under other names: no streaming, the whole way instead
    shutil.copytree(folder, renamed, dirs_exist_ok=True)
    from safetensors.torch import load_file, save_file

    from exporter.sources.locate import resolve
    from exporter.sources.safetensors_tensors import NotStreamable, SafetensorsTensors
    from exporter.streamed import skeleton

    weights = load_file(str(renamed / "model.safetensors"))
    save_file({k.replace("model.layers.1.", "model.blocks.1."): v for k, v in weights.items()},
              str(renamed / "model.safetensors"))
    with pytest.raises(NotStreamable, match="lacks model.layers.1"):
        SafetensorsTensors(str(renamed), skeleton(resolve(str(renamed)))[0])
