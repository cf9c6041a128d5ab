"""RuvLLM's CPU kernels (runtime/backends/kernels/) against what they replace, and the graph rewrite onto them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from runtime.backends import graph_rewrite, kernel_library

LIB, WHY = kernel_library.library()
needs_kernel = pytest.mark.skipif(LIB is None, reason=f"RuvLLM's kernels are not built here: {WHY}")
OPS = kernel_library.operators(LIB)
# an AVX-512 host builds the AVX2 library as well (RUVLLM_KERNEL_ISA=avx2): the tests that run both
needs_both_builds = pytest.mark.skipif(
    os.environ.get("RUVLLM_KERNEL_ISA") == "avx2" or LIB is None
    or not all(f in kernel_library._cpu_flags() for f in kernel_library.CPU_FLAGS),
    reason="one build here: no second one to run or compare with")


def in_avx2_build(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """`python args...` from the project's root with the AVX2 build of the kernels."""
    return subprocess.run([sys.executable, *args], cwd=Path(__file__).resolve().parents[2],
                          env=dict(os.environ, RUVLLM_KERNEL_ISA="avx2"), capture_output=True, text=True, timeout=timeout)


def matmul_model(K: int, N: int, block: int, *, accuracy_level: int = 4, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    nblk = -(-K // block)  # MatMulNBits pads the last block
    B = rng.integers(0, 256, (N, nblk, block // 2), dtype=np.uint8)
    S = rng.random((N, nblk), dtype=np.float32) * 0.02
    Z = rng.integers(0, 256, (N, (nblk + 1) // 2), dtype=np.uint8)
    inits = [helper.make_tensor(name, dtype, a.shape, a.tobytes(), raw=True)
             for name, dtype, a in (("B", TensorProto.UINT8, B), ("S", TensorProto.FLOAT, S), ("Z", TensorProto.UINT8, Z))]
    node = helper.make_node("MatMulNBits", ["X", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def sessions(tmp_path, K: int, N: int, block: int) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    path = tmp_path / f"mm-{K}-{N}-{block}.onnx"
    path.write_bytes(matmul_model(K, N, block))
    rewritten, counts = graph_rewrite.rewrite_graph(path)
    assert (counts["MatMulQ4"], counts["PagedAttention"]) == (1, 0)
    plain, ours = ort.SessionOptions(), ort.SessionOptions()
    plain.intra_op_num_threads = ours.intra_op_num_threads = 2
    ours.register_custom_ops_library(str(LIB))
    return ort.InferenceSession(str(path), plain), ort.InferenceSession(rewritten, ours)


def test_built_wherever_the_cpu_can_run_it():
    """Every operator with AVX-512 VNNI, and with AVX2, FMA and F16C; else none."""
    flags = kernel_library._cpu_flags()
    if os.environ.get("RUVLLM_KERNEL_ISA") == "avx2":
        flags -= set(kernel_library.CPU_FLAGS)  # the AVX2 build, asked for on any host that has AVX2
    if all(f in flags for f in kernel_library.CPU_FLAGS) or all(f in flags for f in kernel_library.AVX2_FLAGS):
        assert LIB is not None and LIB.exists(), WHY
        assert OPS == {"MatMulQ4", "MatMulQ8", "PagedAttention", "SkipRMSNorm", "LoraDelta", "SampleTopK"}
    else:
        assert LIB is None and "lacks" in WHY


@needs_kernel
@pytest.mark.parametrize("K,N,block", [(576, 960, 64), (1536, 576, 64), (256, 48, 32), (512, 64, 128), (576, 49152, 64),
                                     (576, 960, 128), (608, 64, 256)])  # the last two pad their last block
def test_computes_what_matmulnbits_computes(tmp_path, K, N, block):
    """Same int8 arithmetic: equal to MLAS's kernel up to fp32 rounding, for one row, a batch, a prefill
    chunk and a 3-D input (rows that are not a multiple of the kernel's 4-row groups included)."""
    mlas, ours = sessions(tmp_path, K, N, block)
    rng = np.random.default_rng(K + N)
    for shape in ((1, K), (3, K), (16, K), (37, K), (2, 5, K)):
        x = rng.standard_normal(shape, dtype=np.float32)
        want, got = mlas.run(None, {"X": x})[0], ours.run(None, {"X": x})[0]
        assert got.shape == want.shape == (*shape[:-1], N)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), shape


@needs_kernel
def test_a_row_does_not_depend_on_the_batch(tmp_path):
    """What makes batched greedy decoding equal to one request run alone."""
    _, ours = sessions(tmp_path, 576, 960, 64)
    x = np.random.default_rng(3).standard_normal((16, 576), dtype=np.float32) * 3
    together = ours.run(None, {"X": x})[0]
    for i in range(16):
        assert np.array_equal(ours.run(None, {"X": x[i:i + 1]})[0][0], together[i])


@needs_kernel
@pytest.mark.parametrize("K,N,block", [(576, 960, 64), (256, 48, 32), (512, 64, 128)])
def test_an_int4_grid_in_the_kernels_layout_computes_what_it_packs_at_load(tmp_path, K, N, block):
    """The exporter writes an int4 grid in the layout the kernel would pack at load (block_matmul.kernel_layouts):
    the same numbers, bit for bit, as the kernel packing MatMulNBits' grid; without the kernel the graph turns
    back into that MatMulNBits exactly (portable_graph)."""
    from exporter.quantizers.block_matmul import kernel_layouts
    from runtime.backends.block_layouts import GRID_KIND, grid_parts
    from runtime.backends.graph_rewrite.portable import portable_graph

    mlas, packed = sessions(tmp_path, K, N, block)
    original = onnx.load_from_string(matmul_model(K, N, block))
    model = onnx.load_from_string(matmul_model(K, N, block))
    assert kernel_layouts(model) == 1
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == ("ruvllm", "MatMulQ4")
    assert {a.name: a.i for a in node.attribute}["kquant"] == GRID_KIND
    (blob,) = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer]
    q, scale, zero = grid_parts(blob, N, K, block)
    b, s, z = (onnx.numpy_helper.to_array(t) for t in original.graph.initializer)
    assert np.array_equal(np.stack([b & 15, b >> 4], -1).reshape(N, K), q)
    assert np.array_equal(s.reshape(N, -1), scale)
    assert np.array_equal(np.stack([z & 15, z >> 4], -1).reshape(N, -1)[:, :K // block], zero)

    path = tmp_path / "grid.onnx"
    onnx.save(model, path)
    rewritten, counts = graph_rewrite.rewrite_graph(path)
    assert counts["MatMulQ4"] == 1
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(LIB))
    ours = ort.InferenceSession(rewritten, opts)
    portable = onnx.load_from_string(matmul_model(K, N, block))
    kernel_layouts(portable)
    assert portable_graph(portable, tmp_path) == 1
    back = ort.InferenceSession(portable.SerializeToString())
    x = np.random.default_rng(K).standard_normal((5, K), dtype=np.float32)
    assert np.array_equal(ours.run(None, {"X": x})[0], packed.run(None, {"X": x})[0])
    assert np.array_equal(back.run(None, {"X": x})[0], mlas.run(None, {"X": x})[0])


def test_rewrite_leaves_what_the_kernel_does_not_compute(tmp_path):
    cases = {"fp32-compute": (matmul_model(256, 64, 32, accuracy_level=0), 0),
             "n-not-16": (matmul_model(256, 40, 32), 0),
             "block-16": (matmul_model(256, 64, 16), 0),
             "fits": (matmul_model(256, 64, 32), 1)}
    for name, (model, want) in cases.items():
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(model)
        rewritten, counts = graph_rewrite.rewrite_graph(path, {"head_dim": 64, "num_layers": 1, "num_heads": 2,
                                                                   "num_kv_heads": 1})
        assert (counts["MatMulQ4"], counts["PagedAttention"]) == (want, 0), name  # no attention path here to fuse
        ops = [(n.domain, n.op_type) for n in onnx.load_from_string(rewritten).graph.node]
        assert ops == [("ruvllm", "MatMulQ4")] if want else ops == [("com.microsoft", "MatMulNBits")]


def q8_model(K: int, N: int, block: int, zero: np.ndarray | None = None, seed: int = 0) -> tuple[bytes, np.ndarray]:
    """An 8-bit MatMulNBits (zero points 128 unless given, as a GGUF's Q8_0 is written) and its fp32 weights [K, N]."""
    rng = np.random.default_rng(seed)
    nblk = K // block
    B = rng.integers(0, 256, (N, nblk, block), dtype=np.uint8)
    S = rng.random((N, nblk), dtype=np.float32) * 0.02
    Z = np.full((N, nblk), 128, np.uint8) if zero is None else zero
    inits = [helper.make_tensor(name, dtype, a.shape, a.tobytes(), raw=True)
             for name, dtype, a in (("B", TensorProto.UINT8, B), ("S", TensorProto.FLOAT, S), ("Z", TensorProto.UINT8, Z))]
    node = helper.make_node("MatMulNBits", ["X", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=K, N=N, bits=8,
                            block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    w = ((B.astype(np.float32) - Z[..., None].astype(np.float32)) * S[..., None]).reshape(N, K).T
    return model.SerializeToString(), w


@needs_kernel
@pytest.mark.parametrize("K,N,block", [(576, 49152, 32), (576, 960, 64), (256, 48, 32)])
def test_q8_kernel_computes_the_int8_product_of_a_q8_0_grid(tmp_path, K, N, block):
    """MatMulQ8 (a GGUF package's Q8_0 LM head) gives (x rounded to int8 per block) . (d * (q - 128))
    exactly up to fp32 rounding, for 1 to 37 rows and a 3-D input, every weight byte 0..255 included:
    the int16 pair sums of its AVX2 products cannot saturate."""
    model, w = q8_model(K, N, block)
    path = tmp_path / "q8.onnx"
    path.write_bytes(model)
    rewritten, counts = graph_rewrite.rewrite_graph(path, ops=OPS)
    assert (counts["MatMulQ8"], counts["MatMulQ4"]) == (1, 0)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.register_custom_ops_library(str(LIB))
    ours = ort.InferenceSession(rewritten, opts)
    rng = np.random.default_rng(K + N)
    for shape in ((1, K), (3, K), (16, K), (37, K), (2, 5, K)):
        x = rng.standard_normal(shape, dtype=np.float32) * 4
        got, want = ours.run(None, {"X": x})[0], int8_blocks(x, block).astype(np.float64) @ w
        assert got.shape == want.shape == (*shape[:-1], N)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), shape
    x = rng.standard_normal((16, K), dtype=np.float32)
    together = ours.run(None, {"X": x})[0]
    assert all(np.array_equal(ours.run(None, {"X": x[i:i + 1]})[0][0], together[i]) for i in (0, 5, 15))


def test_q8_rewrite_needs_zero_points_of_128(tmp_path):
    """Other zero points could put q - z outside a signed byte: those grids keep onnxruntime's kernel."""
    zero = np.full((64, 256 // 32), 128, np.uint8)
    zero[3, 2] = 0
    for name, model in (("q8_0", q8_model(256, 64, 32)[0]), ("other", q8_model(256, 64, 32, zero)[0])):
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(model)
        _, counts = graph_rewrite.rewrite_graph(path, ops=frozenset({"MatMulQ4", "MatMulQ8"}))
        assert counts["MatMulQ8"] == (name == "q8_0"), name
    _, counts = graph_rewrite.rewrite_graph(tmp_path / "q8_0.onnx", ops=frozenset({"MatMulQ4"}))
    assert counts["MatMulQ8"] == 0


def projection_then(K: int, N: int, block: int, tail: str) -> bytes:
    """A 4-bit projection followed by what the exporter puts after the MLP's gate/up projection
    (`swiglu`: Split in halves, Sigmoid, Mul, Mul) or after the attention's q/k/v one (`qkv`: Unsqueeze
    to [tokens, 1, N], Split into q+k and v, v reshaped to head rows)."""
    model = onnx.load_from_string(matmul_model(K, N, block))
    g = model.graph
    g.output.pop()
    if tail == "swiglu":
        g.initializer.append(helper.make_tensor("halves", TensorProto.INT64, [2], [N // 2, N // 2]))
        g.node.extend([helper.make_node("Split", ["Y", "halves"], ["gate", "up"], axis=1),
                       helper.make_node("Sigmoid", ["gate"], ["sig"]),
                       helper.make_node("Mul", ["gate", "sig"], ["silu"]),
                       helper.make_node("Mul", ["silu", "up"], ["out"])])
        outs = ["out"]
    else:
        g.initializer.extend([helper.make_tensor("one", TensorProto.INT64, [1], [1]),
                              helper.make_tensor("parts", TensorProto.INT64, [2], [N - 64, 64]),
                              helper.make_tensor("rows", TensorProto.INT64, [2], [-1, 16])])
        g.node.extend([helper.make_node("Unsqueeze", ["Y", "one"], ["Y3"]),
                       helper.make_node("Split", ["Y3", "parts"], ["qk", "v3"], axis=2),
                       helper.make_node("Reshape", ["v3", "rows"], ["v"])])
        outs = ["qk", "v"]
    g.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs)
    return model.SerializeToString()


@needs_kernel
@pytest.mark.parametrize("tail,fused", [("swiglu", "MatMulQ4SwiGLU"), ("qkv", "MatMulQ4Split")])
def test_what_follows_a_projection_is_computed_in_its_kernel(tmp_path, tail, fused):
    """The fused forms give what the projection and the operators after it give, in the same shapes."""
    K, N = 576, 960
    path = tmp_path / f"{tail}.onnx"
    path.write_bytes(projection_then(K, N, 64, tail))
    rewritten, counts = graph_rewrite.rewrite_graph(path)
    assert counts["MatMulQ4"] == 1
    ops = [n.op_type for n in onnx.load_from_string(rewritten).graph.node]
    assert ops == ([fused] if tail == "swiglu" else [fused, "Unsqueeze", "Reshape"])
    plain, ours = ort.SessionOptions(), ort.SessionOptions()
    ours.register_custom_ops_library(str(LIB))
    mlas, fused_session = ort.InferenceSession(str(path), plain), ort.InferenceSession(rewritten, ours)
    rng = np.random.default_rng(5)
    for rows in (1, 5, 33):
        x = rng.standard_normal((rows, K), dtype=np.float32) * 4
        want, got = mlas.run(None, {"X": x}), fused_session.run(None, {"X": x})
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape
            assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (tail, rows)


def residual_norm_model(H: int, read_inverse: bool) -> bytes:
    """What the exporter puts between layers: the residual add and the next RMS norm as one
    SkipSimplifiedLayerNormalization, its normed rows and residual sum read (and, with read_inverse,
    its inverse deviation: then it must stay as it is)."""
    outputs = ["y", "", "inv" if read_inverse else "", "sum"]
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], outputs, domain="com.microsoft",
                            epsilon=1e-5)
    gamma = np.random.default_rng(H).standard_normal(H).astype(np.float32)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "skip")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs if n],
                              [helper.make_tensor("gamma", TensorProto.FLOAT, [H], gamma)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


@needs_kernel
@pytest.mark.parametrize("H", [576, 40])
def test_residual_add_and_rms_norm_computed_as_onnxruntime_does(tmp_path, H):
    """ruvllm.SkipRMSNorm gives both outputs onnxruntime's kernel gives: one row, a batch, rows enough to
    be split over threads, a 3-D input, rows not a multiple of 16 wide, and rows small enough that the
    epsilon matters."""
    path = tmp_path / "norm.onnx"
    path.write_bytes(residual_norm_model(H, read_inverse=False))
    rewritten, _ = graph_rewrite.rewrite_graph(path)
    assert [(n.domain, n.op_type) for n in onnx.load_from_string(rewritten).graph.node] == [("ruvllm", "SkipRMSNorm")]
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(LIB))
    plain, ours = ort.InferenceSession(str(path)), ort.InferenceSession(rewritten, opts)
    rng = np.random.default_rng(7)
    for shape, scale in (((1, H), 1.0), ((37, H), 3.0), ((300, H), 1.0), ((2, 5, H), 1.0), ((4, H), 1e-3)):
        feeds = {n: rng.standard_normal(shape).astype(np.float32) * scale for n in ("x", "skip")}
        for want, got in zip(plain.run(None, feeds), ours.run(None, feeds), strict=True):
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), (shape, scale)


def test_a_norm_whose_statistics_are_read_is_left_alone(tmp_path):
    path = tmp_path / "norm.onnx"
    path.write_bytes(residual_norm_model(64, read_inverse=True))
    model = onnx.load(str(path))
    assert graph_rewrite.fuse_norms(model) == 0
    assert model.graph.node[0].op_type == "SkipSimplifiedLayerNormalization"


@needs_kernel
@pytest.mark.slow
def test_smollm2_on_the_kernels_is_as_close_to_fp32_as_on_onnxruntimes_own(smol_fp32, smol_int4, monkeypatch):
    """The default package teacher-forced on real text, against the fp32 export, on both kernels.

    They do not give bit-equal logits (an activation's int8 scale can differ in its last bit and move a
    value across a rounding edge of the next layer), so what must hold is quality at least as good. For
    the default package (a GGUF's Q4_1 blocks with minimums) the kernel is the closer one: it adds the
    minimums times the quantized activations' sum, as llama.cpp does, where onnxruntime's plain graph
    adds them times the fp32 sum beside its int8 product (an error on w - m instead of w). Measured
    here (AVX2 build, MatMulQ4 only): KL to fp32 0.0034 vs 0.0143 on this text.
    """
    from runtime.package import load_package
    from runtime.text.tokenizer import Tokenizer
    from tests.exporter.test_quantization import TEXT, quality, teacher_forced_logprobs

    pkg = load_package(smol_fp32)
    ids = Tokenizer.from_file(pkg.file("tokenizer.json"), pkg.manifest["tokenizer"]).encode(TEXT)
    ref = teacher_forced_logprobs(smol_fp32, ids)
    ours = teacher_forced_logprobs(smol_int4, ids)
    monkeypatch.setattr(kernel_library, "_library", (None, "compared"))
    mlas = teacher_forced_logprobs(smol_int4, ids)
    q_ours, q_mlas, between = quality(ref, ours, ids), quality(ref, mlas, ids), quality(mlas, ours, ids)
    print(f"ours {q_ours}\nmlas {q_mlas}\nbetween {between}")
    assert q_ours["kl"] < 1.1 * q_mlas["kl"] and q_ours["kl"] < 0.01, (q_ours, q_mlas)
    assert q_ours["top1"] >= q_mlas["top1"] - 0.03 and q_ours["ppl"] < 1.03 * q_mlas["ppl"], (q_ours, q_mlas)
    assert between["kl"] < 0.03 and between["top1"] >= 0.9, between


@needs_kernel
def test_the_native_backend_says_which_kernel_it_runs(tiny_package, monkeypatch):
    """A tiny int4 package's projections (64 wide, blocks of 32) run on the kernel; turned off, on MLAS."""
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    pkg = load_package(tiny_package("llama", "int4"))
    assert NativeBackend(pkg).matmul_kernel.startswith("ruvllm.MatMulQ4 (")
    monkeypatch.setattr(kernel_library, "_library", None)
    monkeypatch.setenv("RUVLLM_CPU_KERNELS", "0")
    assert NativeBackend(pkg).matmul_kernel == "onnxruntime MatMulNBits (turned off by RUVLLM_CPU_KERNELS=0)"


def test_a_failed_rewrite_without_the_kernels_is_named_in_the_load_error(tiny_package, monkeypatch):
    """A --target cpu package's int4 grids are in the kernel's layout: without the kernels they must be rewritten,
    and when that fails the error says so, rather than only onnxruntime's "not a registered op"."""
    from runtime.backends import graph_rewrite
    from runtime.backends.native import NativeBackend
    from runtime.errors import PackageError
    from runtime.package import load_package

    pkg = load_package(tiny_package("llama", "int4"))
    monkeypatch.setattr(kernel_library, "_library", (None, "turned off for the test"))

    def fail(*args, **kwargs):
        raise MemoryError("no room for the portable weights")

    monkeypatch.setattr(graph_rewrite, "rewrite_graph", fail)
    with pytest.raises(PackageError) as err:
        NativeBackend(pkg)
    assert "onnxruntime cannot load model.onnx" in str(err.value)
    assert "rewrite for a host without RuvLLM's kernels failed: MemoryError: no room" in str(err.value)


def test_an_untested_onnxruntime_gets_the_plain_graph_with_the_reason(tiny_package, monkeypatch):
    """The kernels call onnxruntime's C API by table position: only the tested minor versions load them."""
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    assert kernel_library.onnxruntime_supported(ort.__version__) == (True, "")  # the pin and the check agree
    assert not kernel_library.onnxruntime_supported("1.31.1")[0] and not kernel_library.onnxruntime_supported("2.32.0")[0]
    monkeypatch.setattr(kernel_library, "_library", None)
    monkeypatch.setattr(ort, "__version__", "1.99.0")
    backend = NativeBackend(load_package(tiny_package("llama", "int4")))
    assert backend.matmul_kernel.startswith("onnxruntime MatMulNBits (onnxruntime 1.99.0 is not a version")
    assert backend.attention_kernel.startswith("the graph's own (onnxruntime 1.99.0")
    from runtime.core.step_batch import Chunk

    backend.allocate(8, 4)  # and it runs
    assert np.isfinite(run_step(backend, [Chunk([5, 6, 7], 0, [0], [0, 1, 2], True)])).all()


def run_step(backend, chunks, block: int = 4) -> np.ndarray:
    """One step's raw logits for every token."""
    from runtime.core.step_batch import build_step

    batch = build_step(chunks, block, want_full_logits=True)
    batch.logits_index = list(range(len(batch.input_ids)))
    n = len(batch.logits_index)
    batch.temperature = batch.repetition_penalty = [1.0] * n
    batch.presence_penalty = batch.frequency_penalty = [0.0] * n
    batch.sparse_ids, batch.sparse_seen = [[0]] * n, [[0.0]] * n
    batch.sparse_counts, batch.sparse_bias = [[0.0]] * n, [[0.0]] * n
    return backend.run(batch).logits


def two_steps(backend, first: list[int], second_a: list[int], b_prompt: list[int], block: int = 4) -> np.ndarray:
    """Step 1 prefills sequence A; step 2 extends A (its context now in the pool, in blocks scattered
    through it) and prefills B: the raw logits of every token of step 2."""
    from runtime.core.step_batch import Chunk

    a_len, b_len = len(first) + len(second_a), len(b_prompt)
    a_blocks, b_blocks = -(-a_len // block), -(-b_len // block)
    backend.allocate(2 * (a_blocks + b_blocks) + 1, block)
    a_table = [2 * (a_blocks - i) - 1 for i in range(a_blocks)]  # descending, interleaved with B's
    b_table = [2 * i + 2 for i in range(b_blocks)]

    def slots(table, start, n):
        return [table[p // block] * block + p % block for p in range(start, start + n)]

    def run(chunks):
        return run_step(backend, chunks, block)

    run([Chunk(tokens=first, start=0, block_table=a_table, kv_slots=slots(a_table, 0, len(first)),
               want_logits=True)])
    return run([Chunk(tokens=second_a, start=len(first), block_table=a_table,
                      kv_slots=slots(a_table, len(first), len(second_a)), want_logits=True),
                Chunk(tokens=b_prompt, start=0, block_table=b_table, kv_slots=slots(b_table, 0, b_len),
                      want_logits=True)])


def shared_prefix_steps(backend, prefix: list[int], own: list[list[int]], block: int = 4) -> np.ndarray:
    """Three sequences whose block tables start with the same blocks (a prefix computed once, as the
    prefix cache shares it), each with tokens of its own after it; then one decode step of all three:
    its logits. The decode rows attend to the shared blocks together (cascade) where the kernel runs."""
    from runtime.core.step_batch import Chunk

    rows = len(own)
    shared = len(prefix) // block
    backend.allocate(64, block)
    tables = [list(range(shared)) + [shared + 8 * r + i for i in range(8)] for r in range(rows)]

    def chunk(r, tokens, start):
        n = -(-(start + len(tokens)) // block)
        slots = [tables[r][p // block] * block + p % block for p in range(start, start + len(tokens))]
        return Chunk(tokens=tokens, start=start, block_table=tables[r][:n], kv_slots=slots, want_logits=True)

    run_step(backend, [chunk(0, prefix, 0)])
    run_step(backend, [chunk(r, own[r], len(prefix)) for r in range(rows)])
    return run_step(backend, [chunk(r, [7 + r], len(prefix) + len(own[r])) for r in range(rows)])


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3"])
def test_decode_rows_sharing_prefix_blocks_attend_to_them_together_exactly(tiny_package, monkeypatch, arch):
    """fp32 packages: the cascade (shared keys once for all rows, then each row's own, merged) against
    the exported graph's attention (Gemma 2: soft-capped scores, a window on every other layer), for 40 shared positions (32 of them read together) and rows of
    different lengths after them."""
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    pkg = load_package(tiny_package(arch))
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, 1000, 40).tolist()
    own = [rng.integers(3, 1000, n).tolist() for n in (1, 5, 11)]
    fused = NativeBackend(pkg)
    monkeypatch.setenv("RUVLLM_PAGED_ATTENTION", "0")
    plain = NativeBackend(pkg)
    want, got = shared_prefix_steps(plain, prefix, own), shared_prefix_steps(fused, prefix, own)
    assert want.shape == got.shape == (3, pkg.config["vocab_size"])
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def attention_graph(Hq: int, Hkv: int, window: int, scale: float, kv: str = "fp32", softcap: float = 0.0,
                    tails: bool = False, tail_blocks: int = 0, floors: bool = False, half_tails: bool = False) -> bytes:
    """The operator alone; `kv` "int8" or "int4": quantized pools with their rows' scales (--kv-dtype),
    `tails`: and their full-precision tails (`half_tails`: fp16, as the native pool keeps them), read for
    `tail_blocks` blocks up to a query's own (0: the attribute left out), `floors`: from each row's floor on
    (input exact_from)."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    pool = {"fp32": f, "int8": TensorProto.INT8, "int4": TensorProto.UINT8}[kv]
    names = [("qk", f), ("v", f), ("pool_k", pool), ("pool_v", pool), ("tables", i64), ("qidx", i64), ("pos", i64)]
    names += [("scale_k", TensorProto.FLOAT16), ("scale_v", TensorProto.FLOAT16)] if kv != "fp32" else []
    tail = TensorProto.FLOAT16 if half_tails else f
    names += [("tail_k", tail), ("tail_v", tail)] if tails else []
    names += [("exact_from", i64)] if floors else []
    node = helper.make_node("PagedAttention", [n for n, _ in names], ["out"], domain="ruvllm", num_heads=Hq,
                            num_kv_heads=Hkv, sliding_window=window, scale=scale, softcap=softcap)
    if tails:  # every layer's tails in one input: this node's are layer 1's
        node.attribute.append(helper.make_attribute("layer", 1))
    if tail_blocks:
        node.attribute.append(helper.make_attribute("tail_blocks", tail_blocks))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in names],
                              [helper.make_tensor_value_info("out", f, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("ruvllm", 1)]).SerializeToString()


def rounded_query(q: np.ndarray) -> np.ndarray:
    """A scaled query as an int8 pool's stored keys meet it: rounded to 16-bit steps of its absolute
    maximum / 32767 (fp32), to nearest even."""
    q = q.astype(np.float32)
    s = np.abs(q).max() / np.float32(32767)
    return (np.clip(np.rint(q / s), -32767, 32767) * s).astype(np.float32) if s > 0 else q * 0


def attention_reference(feeds: dict, Hq: int, Hkv: int, window: int, scale: float, softcap: float = 0.0,
                        exact: dict | None = None, rounded: bool = False, tail_blocks: int = 1,
                        floors: np.ndarray | None = None, rotated: bool = False) -> np.ndarray:
    """Each token's attention over its row's keys, written out plainly: positions before the row's
    first new token from its pool blocks, the rest from this step's rows; causal, optionally windowed,
    the scores optionally soft-capped (Gemma 2: cap * tanh(score / cap)). `exact`: the same inputs in full
    precision, which a token reads for the positions of its own pool block and the tail_blocks - 1 before
    it (a two-tier int8 pool), those before its own block only from its row's floor on (`floors`).
    `rounded`: the keys read as stored meet the scaled query rounded (rounded_query); `rotated`: those keys
    are an int4 pool's, in its rotated space, and meet the query rotated the same way, then rounded."""
    qk, pk = feeds["qk"], feeds["pool_k"]
    tables, qidx, pos = feeds["tables"], feeds["qidx"], feeds["pos"]
    D, bs, G = qk.shape[1], pk.shape[2], Hq // Hkv
    out = np.zeros((len(pos), Hq * D), np.float32)
    def context(b: int, h: int, t: int, start: int, first: int, pool, step, width: int, offset: int):
        if t < start:
            return pool[h, tables[b, t // bs], t % bs]
        return step[(first + t - start) * width + offset]

    for b in range(qidx.shape[0]):
        first, last = int(qidx[b, 0]), int(qidx[b, -1])
        start = int(pos[first])
        for n in range(first, last + 1):
            p = int(pos[n])
            lo = max(0, p - window + 1) if window else 0
            own = p - p % bs
            from_ = min(own, max(0 if floors is None else int(floors[b]), own - (tail_blocks - 1) * bs))
            for h in range(Hkv):
                span = range(lo, p + 1)
                src = [exact if exact is not None and t >= from_ else feeds for t in span]
                keys = np.stack([context(b, h, t, start, first, f["pool_k"], f["qk"], Hq + Hkv, Hq + h)
                                 for t, f in zip(span, src)])
                vals = np.stack([context(b, h, t, start, first, f["pool_v"], f["v"], Hkv, h) for t, f in zip(span, src)])
                stored = np.array([f is feeds for f in src])
                for g in range(G):
                    head = h * G + g
                    q = qk[n * (Hq + Hkv) + head] * np.float32(scale)
                    scores = keys.astype(np.float64) @ q
                    if rounded:
                        qq = rotation(q[None])[0] if rotated else q
                        scores = np.where(stored, keys.astype(np.float64) @ rounded_query(qq), scores)
                    if softcap:
                        scores = softcap * np.tanh(scores / softcap)
                    w = np.exp(scores - scores.max())
                    out[n, head * D:(head + 1) * D] = (w / w.sum()) @ vals
    return out


def rounded_rows(x: np.ndarray, int4_group: int = 0, rotated: bool = False) -> np.ndarray:
    """x as an int8 pool (or an int4 pool with groups of `int4_group`, `rotated`: in its rotated space)
    gives it back."""
    from runtime.backends.kv_pool import (
        dequantize_rows,
        dequantize_rows_int4,
        quantize_rows,
        quantize_rows_int4,
    )

    if int4_group:
        return dequantize_rows_int4(*quantize_rows_int4(x, int4_group), rotated=rotated)
    return dequantize_rows(*quantize_rows(x))


def rotation(x: np.ndarray) -> np.ndarray:
    """An int4 pool's rotation of rows (kv_pool._fwht), in float32 as the kernel rotates a query."""
    from runtime.backends.kv_pool import _fwht

    return _fwht(x.astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("kv", ["fp32", "int8", "int8+tails", "int8+2tails", "int8+2tails+floors", "int4",
                                "int4+2tails+floors", "int8+2tails16+floors", "int4+2tails16+floors"])
@pytest.mark.parametrize("layout", ["mixed", "decode"])
@pytest.mark.parametrize("Hq,Hkv,D,bs,window,softcap", [
    (9, 3, 64, 16, 0, 0.0), (8, 2, 128, 16, 0, 0.0), (4, 4, 32, 8, 0, 0.0), (16, 2, 16, 4, 0, 0.0),
    (6, 1, 256, 16, 0, 0.0), (8, 2, 64, 16, 24, 0.0), (9, 3, 64, 16, 0, 2.0), (8, 2, 32, 16, 24, 1.5),
    (8, 2, 64, 12, 0, 0.0)])  # a block size that is not a power of two
def test_paged_attention_op_against_a_plain_reference(Hq, Hkv, D, bs, window, softcap, layout, kv):
    """`mixed`: one step holding every kind of row the operator handles differently: a fresh prompt
    (queries in several groups), a prompt extending a cached context, a token with drafts, three decode
    rows whose tables share their first blocks (attended together unless there is a window), a lone
    decode row (`softcap`: Gemma 2's soft cap on every path's scores). `decode`: two decode rows alone, one over 1100 positions (its keys cut into ranges
    across threads and merged, where fewer than 8 row/kv-head items leave threads idle). `int8`: the
    pools as int8 rows and scales; the reference reads their q * s, and this step's key and value rows
    rounded the same way (as the pool will store them), and meets them with the query rounded to 16 bits
    as the kernel rounds it (integer score products); head_dim 16 has one scale a row, the rest one per
    32 numbers; `int4`: int4 pools (Hadamard-rotated, keys in groups of 32, values 64 where the row has
    them; head_dim a multiple of 32), read as kv_pool.dequantize_rows_int4 gives them back. `int8+tails`: with full-precision tails, from which (or from this step's exact rows) each
    token reads its own block's positions, and every earlier block's as int8 (as rounded);
    `int8+2tails`: its own block's and the one's before it (attribute tail_blocks 2); `+floors`: that one
    only from each row's floor on (input exact_from: below a row's positions, inside them, past them);
    `tails16`: fp16 tails (the native pool's), where the exact rows, this step's too, are read as fp16
    rounds them."""
    if kv.startswith("int4") and D % 32:
        pytest.skip("an int4 pool needs head_dim a multiple of 32")
    graph, feeds, want = attention_case(Hq, Hkv, D, bs, window, softcap, layout, kv)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.register_custom_ops_library(str(LIB))
    got = ort.InferenceSession(graph, opts).run(None, feeds)[0]
    want = want()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


def attention_case(Hq, Hkv, D, bs, window, softcap, layout, kv):
    """test_paged_attention_op_against_a_plain_reference's step: (graph, feeds, a function giving the reference)."""
    rng = np.random.default_rng(Hq * D + bs)
    num_blocks = 512
    pool_k = rng.standard_normal((Hkv, num_blocks, bs, D), dtype=np.float32)
    pool_v = rng.standard_normal((Hkv, num_blocks, bs, D), dtype=np.float32)
    shared = list(range(1, 1 + 48 // bs))  # 48 shared positions
    free = iter(range(1 + 48 // bs, num_blocks))
    # (cached positions before this step, new tokens, the first blocks of the table)
    rows = [(0, 40, []), (50, 20, []), (37, 3, []), (48 + 5, 1, shared), (48 + 17, 1, shared), (48, 1, shared),
            (29, 1, [])] if layout == "mixed" else [(1100, 1, []), (37, 1, [])]
    max_blocks = max(-(-(c + n) // bs) for c, n, _ in rows)
    tables = np.zeros((len(rows), max_blocks), np.int64)
    for b, (cached, new, first) in enumerate(rows):
        table = first + [next(free) for _ in range(-(-(cached + new) // bs) - len(first))]
        tables[b, :len(table)] = table
    S = max(n for _, n, _ in rows)
    qidx = np.zeros((len(rows), S), np.int64)
    pos, at = [], 0
    for b, (cached, new, _) in enumerate(rows):
        qidx[b] = [at + min(i, new - 1) for i in range(S)]  # pads repeat the row's last token
        pos += range(cached, cached + new)
        at += new
    N = at
    feeds = {"qk": rng.standard_normal((N * (Hq + Hkv), D), dtype=np.float32),
             "v": rng.standard_normal((N * Hkv, D), dtype=np.float32), "pool_k": pool_k, "pool_v": pool_v,
             "tables": tables, "qidx": qidx, "pos": np.array(pos, np.int64)}
    scale = 1 / np.sqrt(D)
    reference, exact = feeds, None
    quant = kv.split("+")[0]
    if quant != "fp32":
        from runtime.backends.kv_pool import quantize_rows, quantize_rows_int4
        from runtime.core.kv_blocks import kv_int4_groups

        gk, gv = kv_int4_groups(D) if quant == "int4" else (0, 0)
        if quant == "int4":
            (feeds["pool_k"], feeds["scale_k"]), (feeds["pool_v"], feeds["scale_v"]) = (quantize_rows_int4(pool_k, gk),
                                                                                        quantize_rows_int4(pool_v, gv))
        else:
            (feeds["pool_k"], feeds["scale_k"]), (feeds["pool_v"], feeds["scale_v"]) = quantize_rows(pool_k), quantize_rows(pool_v)
        qk = feeds["qk"].reshape(N, Hq + Hkv, D).copy()
        qk[:, Hq:] = rounded_rows(qk[:, Hq:], gk, rotated=True)  # an int4 pool's keys: in its rotated space
        reference = {**feeds, "pool_k": rounded_rows(pool_k, gk, rotated=True), "pool_v": rounded_rows(pool_v, gv),
                     "qk": qk.reshape(-1, D), "v": rounded_rows(feeds["v"], gv)}
        if "tails" in kv:  # layer 1 of the tails holds the pool's rows unrounded (only the exact blocks' are read)
            half = np.float16 if "tails16" in kv else np.float32
            for name, pool in (("tail_k", pool_k), ("tail_v", pool_v)):
                feeds[name] = rng.standard_normal((num_blocks, 2, Hkv, bs, D), dtype=np.float32).astype(half)
                feeds[name][:, 1] = pool.transpose(1, 0, 2, 3)
            exact = {**feeds, "pool_k": pool_k, "pool_v": pool_v}
            if "tails16" in kv:  # every exact row as fp16 holds it: the tails', and this step's rows
                as_half = lambda x: x.astype(np.float16).astype(np.float32)  # noqa: E731
                qk = feeds["qk"].reshape(N, Hq + Hkv, D).copy()
                qk[:, Hq:] = as_half(qk[:, Hq:])
                exact = {**feeds, "pool_k": as_half(pool_k), "pool_v": as_half(pool_v), "qk": qk.reshape(-1, D),
                         "v": as_half(feeds["v"])}
    tail_blocks = 2 if "2tails" in kv else 0
    floors = None
    if kv.endswith("floors"):  # each row's floor, a block start: 0, one inside its positions, one past them
        floors = np.array([(c + n // 2) // bs * bs if b % 3 == 1 else (c + n + bs) // bs * bs if b % 3 == 2 else 0
                           for b, (c, n, _) in enumerate(rows)], np.int64)
        feeds["exact_from"] = floors
    graph = attention_graph(Hq, Hkv, window, scale, quant, softcap, "tails" in kv, tail_blocks, floors is not None,
                            "tails16" in kv)
    return graph, feeds, lambda: attention_reference(reference, Hq, Hkv, window, scale, softcap, exact, kv != "fp32",
                                                     max(1, tail_blocks), floors, rotated=quant == "int4")


@needs_kernel
@pytest.mark.parametrize("arch,lengths", [("llama", (30, 3, 9)), ("mistral", (30, 3, 9)), ("qwen2", (30, 3, 9)),
                                          ("gemma2", (30, 3, 9)), ("llama", (150, 1, 40)), ("mistral", (150, 1, 40))])
def test_paged_attention_computes_what_the_graph_computes(tiny_package, monkeypatch, arch, lengths):
    """fp32 packages, so only attention differs: a row extending its context from the pool (blocks out
    of order) batched with a fresh prompt, mistral's sliding window (24) crossed by the context, Gemma 2's
    soft cap and per-layer windows. The
    longer case runs a prompt's queries in many groups and its keys in several transposition items,
    next to a one-token decode row."""
    from runtime.backends.native import NativeBackend
    from runtime.package import load_package

    pkg = load_package(tiny_package(arch))
    rng = np.random.default_rng(7)
    first, second, other = (rng.integers(3, 1000, n).tolist() for n in lengths)
    fused = NativeBackend(pkg)
    assert fused.attention_kernel == f"ruvllm.PagedAttention ({pkg.config['num_layers']} layers)"
    monkeypatch.setenv("RUVLLM_PAGED_ATTENTION", "0")
    plain = NativeBackend(pkg)
    assert plain.attention_kernel == "the graph's own"
    want, got = two_steps(plain, first, second, other), two_steps(fused, first, second, other)
    assert want.shape == got.shape == (lengths[1] + lengths[2], pkg.config["vocab_size"])
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def minimums_model(K: int, N: int, fp16_minimums: bool = True, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """A projection on a GGUF-style grid with block minimums (w = d * q + m, blocks of 32), as the
    exporter writes it (exporter/quantizers/block_matmul.py), and its fp32 weights [K, N]."""
    from onnx import numpy_helper

    from exporter.quantizers.block_matmul import apply_grids
    from exporter.quantizers.grid import Grid

    rng = np.random.default_rng(seed)
    nblk = K // 32
    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    mins = (rng.standard_normal((N, nblk)) * 0.05).astype(np.float32)
    grid = Grid(rng.integers(0, 16, (N, K)).astype(np.uint8), half(rng.random((N, nblk)) * 0.02 + 1e-3),
                np.zeros((N, nblk), np.uint8), 32, 4, half(mins) if fp16_minimums else mins + 1e-7)
    w = np.ascontiguousarray(grid.dequantize().T)
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "w"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return apply_grids(model, {"w": grid}), w


def test_block_minimums_fold_into_the_kernel_where_fp16_holds_them(tmp_path):
    """The rewrite gives MatMulQ4 the fp16 minimums as a fifth input and drops the term's operators;
    fp32 minimums (a Q4_K's) keep their operators beside the kernel."""
    for fp16, want in ((True, [("ruvllm", "MatMulQ4", 5)]),
                       (False, [("ruvllm", "MatMulQ4", 4), ("", "MatMul", 2), ("", "Gemm", 3)])):
        model, _ = minimums_model(64, 32, fp16)
        path = tmp_path / f"mins-{fp16}.onnx"
        onnx.save(model, path)
        rewritten, counts = graph_rewrite.rewrite_graph(path)
        nodes = onnx.load_from_string(rewritten).graph.node
        assert counts["MatMulQ4"] == 1 and sorted((n.domain, n.op_type, len(n.input)) for n in nodes if n.op_type != "Cast") == sorted(want)
        assert [a.i for n in nodes if n.op_type == "MatMulQ4" for a in n.attribute if a.name == "mins"] == [int(fp16)]


def test_block_minimums_are_exact_on_onnxruntimes_own_kernel(tmp_path):
    """The plain graph (MatMulNBits + the minimums' Gemm) computes x . (d * q + m), with fp32 compute."""
    model, w = minimums_model(576, 96)
    for node in model.graph.node:
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    sess = ort.InferenceSession(model.SerializeToString())
    x = np.random.default_rng(1).standard_normal((5, 576)).astype(np.float32)
    want = x @ w
    assert np.abs(sess.run(None, {"X": x})[0] - want).max() <= 1e-5 * np.abs(want).max()


def int8_blocks(x: np.ndarray, block: int) -> np.ndarray:
    """x with each row's blocks rounded to int8 steps of their absolute maximum / 127, to nearest (ties to
    even), in fp32 as the kernel computes them: the activations every int8 product here multiplies."""
    xb = x.reshape(*x.shape[:-1], -1, block).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(xb * inv) * (amax / np.float32(127))).reshape(x.shape)


@needs_kernel
def test_minimums_kernel_computes_the_int8_product_with_the_files_weights(tmp_path):
    """MatMulQ4 with minimums gives (x rounded to int8 per block) . (d * q + m): the minimums times the
    quantized activations' sum, as llama.cpp's Q8_1 carries it, for 1 to 37 rows and a 3-D input. (The
    plain graph adds them times the fp32 sum, a larger error: see the SmolLM2 test above.)"""
    model, w = minimums_model(576, 960)
    path = tmp_path / "mins.onnx"
    onnx.save(model, path)
    rewritten, counts = graph_rewrite.rewrite_graph(path, ops=OPS)
    assert counts["MatMulQ4"] == 1
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(LIB))
    ours = ort.InferenceSession(rewritten, opts)
    rng = np.random.default_rng(2)
    for shape in ((1, 576), (3, 576), (16, 576), (37, 576), (2, 5, 576)):
        x = rng.standard_normal(shape, dtype=np.float32)
        got, want = ours.run(None, {"X": x})[0], int8_blocks(x, 32).astype(np.float64) @ w
        assert got.shape == want.shape == (*shape[:-1], 960)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), shape


@needs_kernel
def test_a_declared_fusion_that_does_not_apply_is_refused(tiny_package, tmp_path):
    """The exporter declares what the graph's shape lets the runtime fuse; a graph that no longer has
    that shape (here: a manifest claiming one more projection) fails loudly instead of running slower."""
    import json
    import shutil

    from runtime.backends.native import NativeBackend
    from runtime.errors import PackageError
    from runtime.package import load_package

    pkg_dir = tmp_path / "pkg"
    shutil.copytree(tiny_package("llama", "int4"), pkg_dir)
    manifest = json.loads((pkg_dir / "manifest.json").read_text())
    declared = manifest["graphs"]["decoder"]["fusions"]
    assert declared["MatMulQ4"] > 0
    assert NativeBackend(load_package(pkg_dir)).matmul_kernel.startswith(f"ruvllm.MatMulQ4 ({declared['MatMulQ4']} of")
    declared["MatMulQ4"] += 1
    (pkg_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="declares fusions this runtime could not apply"):
        NativeBackend(load_package(pkg_dir))


@pytest.mark.slow
@needs_both_builds
def test_the_avx2_build_passes_these_tests_too():
    """An AVX-512 host builds the AVX2 set as well (RUVLLM_KERNEL_ISA=avx2) and runs this file, the
    adapter tests (ruvllm.LoraDelta) and the int8 KV writer's on it, so both instruction sets' paths of
    every operator (PagedAttention on every pool), the LoRA delta and the writer are run on every such host.
    Not the slow ones: they would export SmolLM2 again in the child process, and the
    whole model on the AVX2 build is test_a_request_gives_the_same_tokens_and_log_probabilities_on_either_build's."""
    adapters = str(Path(__file__).with_name("test_adapters.py"))
    writer = str(Path(__file__).with_name("test_kv_int8.py")) + "::test_the_kernel_librarys_writer_stores_what_numpy_does_bit_for_bit"
    proc = in_avx2_build(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", __file__, adapters, writer],
                         timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]


ISA_CASES = [(kv, layout, shape) for kv in ("fp32", "int8+2tails16+floors", "int4+2tails16+floors", "int4")
             for layout in ("mixed", "decode")
             for shape in ((9, 3, 64, 16, 0, 0.0), (8, 2, 128, 16, 0, 0.0), (8, 2, 64, 16, 24, 0.0), (9, 3, 64, 16, 0, 2.0))]


def attention_outputs(path: str) -> None:
    """ISA_CASES' outputs of this process's build, saved to `path` (npz)."""
    outs = {}
    for i, (kv, layout, shape) in enumerate(ISA_CASES):
        graph, feeds, _ = attention_case(*shape, layout, kv)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        opts.register_custom_ops_library(str(LIB))
        outs[str(i)] = ort.InferenceSession(graph, opts).run(None, feeds)[0]
    np.savez(path, **outs)


@pytest.mark.slow
@needs_both_builds
def test_the_avx2_builds_attention_gives_the_avx512_builds_numbers_bit_for_bit(tmp_path):
    """PagedAttention's arithmetic is defined over 16 lanes (vec16.h): the AVX2 build computes it as two 8-lane
    halves in the same order, so a CPU without AVX-512 gives the same attention, on every pool and path."""
    theirs = tmp_path / "avx2.npz"
    code = f"from tests.runtime.test_cpu_kernels import attention_outputs; attention_outputs({str(theirs)!r})"
    proc = in_avx2_build(["-c", code], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = tmp_path / "avx512.npz"
    attention_outputs(str(ours))
    a, b = np.load(ours), np.load(theirs)
    for i, case in enumerate(ISA_CASES):
        assert np.array_equal(a[str(i)].view(np.uint32), b[str(i)].view(np.uint32)), case


def engine_outputs(package: str, kv_dtype: str) -> list:
    """Four chat prompts' 16 greedy tokens and each token's log-probability (and its runner-up's), one batch."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    engine = Engine.from_package(package, verify=False, kv_dtype=kv_dtype, speculative_tokens=0)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "How do I boil an egg?",
               "Why is the sky blue?"]
    ids = [engine.add_request(messages=[{"role": "user", "content": p}],
                              params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2))
           for p in prompts]
    out: dict = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]
    return [out[i] for i in ids]


@pytest.mark.slow
@needs_both_builds
@pytest.mark.parametrize("kv_dtype", ["fp32", "int4"])
def test_a_request_gives_the_same_tokens_and_log_probabilities_on_either_build(smol_int4, kv_dtype):
    """Every kernel sums in the same order on AVX2 as on AVX-512 (the block matmuls' integer sums, attention
    and the sampling tail's exponentials in 16 lanes): a request's answer, log-probabilities included, does not
    depend on which CPU served it."""
    code = ("import json; from tests.runtime.test_cpu_kernels import engine_outputs; "
            f"print(json.dumps(engine_outputs({str(smol_int4)!r}, {kv_dtype!r})))")
    proc = in_avx2_build(["-c", code], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = json.loads(json.dumps(engine_outputs(str(smol_int4), kv_dtype)))  # tuples as JSON gives them back
    assert ours == theirs


HUGE_PAGE_PROBE = """
import gc, sys
from runtime.backends.native import NativeBackend
from runtime.package import load_package

def advised_mb():
    total, size = 0, 0
    for line in open("/proc/self/smaps"):
        if line.startswith("Size:"):
            size = int(line.split()[1])
        elif line.startswith("VmFlags:") and " hg" in line:
            total += size
    return total / 1024

before = advised_mb()
backend = NativeBackend(load_package(sys.argv[1]))
loaded = advised_mb()
del backend
gc.collect()
print(before, loaded, advised_mb())
"""


@needs_kernel
@pytest.mark.slow
def test_packed_weights_sit_in_huge_page_chunks_returned_when_freed(smol_int4):
    """The kernels pack the weights they repack at load into 2 MB-aligned chunks advised MADV_HUGEPAGE
    (weight_arena.h: a step streams every weight, and 4 KB pages cost a TLB miss each), and unmap a chunk
    when its last tensor is freed but the one being filled. Weights the exporter wrote in the kernels' own
    layouts (all of SmolLM2's: Q4_1 projections, the Q8_0 head) are read where onnxruntime maps them, unless
    RUVLLM_COPY_WEIGHTS=1."""
    for copy, at_least, at_most in (("0", 0, 0), ("1", 80, 1e9)):  # nothing copied; all of them, ~95 MB
        proc = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE, str(smol_int4)], capture_output=True, text=True,
                              timeout=600, cwd=Path(__file__).resolve().parents[2],
                              env={**os.environ, "RUVLLM_COPY_WEIGHTS": copy})
        assert proc.returncode == 0, proc.stderr[-2000:]
        before, loaded, after = map(float, proc.stdout.split())
        assert before == 0 and at_least <= loaded <= at_most, (copy, before, loaded)
        assert after <= 32, after  # at most the chunk being filled stays mapped


OWN_TYPES = ("Q4_K", "Q6_K", "Q5_K", "Q5_0", "Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q3_K", "Q2_K")


def own_parts_and_weights(name: str, N: int, K: int, seed: int = 0):
    """Random parts of a GGUF type (as block_layouts.own_layout takes them) and the fp32 weights [N, K]
    they stand for, formed as gguf's dequantization forms them."""
    from runtime.backends.block_layouts import OWN

    t = OWN[name]
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2 ** t.bits, (N, K), dtype=np.uint8)
    half = lambda blocks, lo, hi: (rng.random((N, blocks)) * (hi - lo) + lo).astype(np.float16)  # noqa: E731
    nblk, nsup = K // t.block, K // 256
    per_block = lambda a: np.repeat(a.astype(np.float32), t.block, axis=1)  # noqa: E731  [N, K]
    per_super = lambda a: np.repeat(a.astype(np.float32), 256 // t.block, axis=1)  # noqa: E731  super -> block
    qf = q.astype(np.float32)
    if t.scales in ("kquant", "kquant4"):
        d, dmin = half(nsup, 1e-3, 1e-2), half(nsup, 0, 1e-2)
        sc, m = (rng.integers(0, 64 if t.scales == "kquant" else 16, (N, nblk), dtype=np.uint8) for _ in range(2))
        s, mn = per_super(d) * sc, per_super(dmin) * m.astype(np.float32)
        return (q, d, dmin, sc, m), qf * per_block(s) - per_block(mn)
    if t.scales == "six":
        d, sc = half(nsup, 1e-4, 2e-3), rng.integers(-128, 128, (N, nblk), dtype=np.int8)
        return (q, d, sc), (qf - t.zero) * per_block(per_super(d) * sc.astype(np.float32))
    if t.scales == "half":
        d = half(nblk, 1e-3, 1e-2)
        return (q, d), (qf - t.zero) * per_block(d)
    d, m = half(nblk, 1e-3, 1e-2), half(nblk, -0.1, 0.0)
    return (q, d, m), qf * per_block(d) + per_block(m)


def own_model(name: str, K: int, N: int, seed: int = 0):
    """ruvllm.MatMulQ4 on a random matrix of a GGUF type in its own-bit layout, and its fp32 weights [K, N]."""
    from runtime.backends.block_layouts import OWN, own_layout

    parts, w = own_parts_and_weights(name, N, K, seed)
    blob = own_layout(name, *parts)
    t = OWN[name]
    init = helper.make_tensor("W", TensorProto.UINT8, blob.shape, blob.tobytes(), raw=True)
    node = helper.make_node(t.op, ["X", "W"], ["Y"], domain="ruvllm", K=K, N=N, bits=t.bits,
                            block_size=t.block, kquant=t.kind)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ruvllm", 1)])
    return model, w.T.copy(), parts


@pytest.mark.parametrize("name", OWN_TYPES)
def test_each_own_bit_layout_holds_its_type_exactly(name):
    """own_layout and its inverse, at the file's bytes (Q4_K, Q5_K and Q3_K: +1/8 bit a weight for their scales as bytes)."""
    from runtime.backends.block_layouts import dequantize_own, own_bytes, own_layout, own_parts

    parts, w = own_parts_and_weights(name, 48, 512, seed=5)
    blob = own_layout(name, *parts)
    gguf_bits = {"Q4_K": 4.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_0": 5.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q5_1": 6.0,
                 "Q8_0": 8.5, "Q3_K": 3.4375, "Q2_K": 2.625}[name]
    wider = 0.125 if name in ("Q4_K", "Q5_K", "Q3_K") else 0
    assert blob.nbytes == own_bytes(name, 48, 512) == 48 * 512 * (gguf_bits + wider) / 8
    for got, want in zip(own_parts(name, blob, 48, 512), parts):
        assert np.array_equal(got, want)
    assert np.array_equal(dequantize_own(name, blob, 48, 512), w)


@needs_kernel
@pytest.mark.parametrize("name", OWN_TYPES)
@pytest.mark.parametrize("K,N", [(512, 96), (256, 16)])
def test_own_bit_kernel_computes_the_int8_product_with_the_files_weights(name, K, N):
    """MatMulQ4 (MatMulQ8 for Q8_0) on each type's layout gives (x rounded to int8 per block) . (the weights gguf dequantizes), for 1
    to 37 rows and a 3-D input; a row's numbers do not depend on its batch, nor on where its weights lie."""
    from runtime.backends.block_layouts import OWN

    model, w, _ = own_model(name, K, N)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(LIB))
    ours = ort.InferenceSession(model.SerializeToString(), opts)
    rng = np.random.default_rng(K + N)
    for shape in ((1, K), (3, K), (16, K), (37, K), (2, 5, K)):
        x = rng.standard_normal(shape, dtype=np.float32)
        got, want = ours.run(None, {"X": x})[0], int8_blocks(x, OWN[name].block).astype(np.float64) @ w
        assert got.shape == want.shape == (*shape[:-1], N)
        assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max(), shape
    x = rng.standard_normal((9, K), dtype=np.float32)
    together = ours.run(None, {"X": x})[0]
    assert all(np.array_equal(ours.run(None, {"X": x[i:i + 1]})[0][0], together[i]) for i in range(9))
    os.environ["RUVLLM_COPY_WEIGHTS"] = "1"  # copied into the kernel's arena, not read in place
    try:
        copied = ort.InferenceSession(model.SerializeToString(), opts)
    finally:
        del os.environ["RUVLLM_COPY_WEIGHTS"]
    assert np.array_equal(copied.run(None, {"X": x})[0], together)


@pytest.mark.parametrize("name", OWN_TYPES)
def test_own_bit_layouts_run_without_the_kernels_as_matmulnbits(name, tmp_path):
    """portable_graph: the same weights as MatMulNBits (and a minimum term), exact with fp32 compute."""
    from runtime.backends.graph_rewrite.portable import portable_graph

    model, w, _ = own_model(name, 512, 64)
    assert portable_graph(model, tmp_path) == 1
    assert {n.domain for n in model.graph.node} <= {"", "com.microsoft"}
    for node in model.graph.node:
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    x = np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString()).run(None, {"X": x})[0]
    want = x.astype(np.float64) @ w
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def gather_model(name: str, N: int = 64, K: int = 512):
    """ruvllm.GatherQ over a random table in an own-bit layout, and its fp32 rows."""
    from runtime.backends.block_layouts import OWN

    model, w, _ = own_model(name, K, N)
    node = helper.make_node("GatherQ", ["W", "ids"], ["rows"], domain="ruvllm", N=N, K=K, kquant=OWN[name].kind)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, None)],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)], [model.graph.initializer[0]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ruvllm", 1)]), w.T


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_gathered_rows_are_the_tables_dequantization_bit_for_bit(name, tmp_path):
    """With the kernels and without them (portable_graph): the rows gguf's dequantization gives, exactly."""
    from runtime.backends.graph_rewrite.portable import portable_graph

    model, w = gather_model(name)
    ids = np.array([[3, 63, 0], [17, 17, 40]], np.int64)
    runs = []
    if LIB is not None:
        opts = ort.SessionOptions()
        opts.register_custom_ops_library(str(LIB))
        runs.append(ort.InferenceSession(model.SerializeToString(), opts).run(None, {"ids": ids})[0])
    assert portable_graph(model, tmp_path) == 1
    runs.append(ort.InferenceSession(model.SerializeToString()).run(None, {"ids": ids})[0])
    for got in runs:
        assert got.shape == (2, 3, 512) and np.array_equal(got.view(np.uint32), w[ids].view(np.uint32))


def sampling_tail(mask_rows: int | None) -> onnx.ModelProto:
    """The exported graph's sampling tail as onnxruntime's operators: ScatterElements of the sparse values over
    the logits, Add of the mask (when mask_rows is given), Div by the temperature, LogSoftmax, TopK."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    ins = [("logits", f), ("ids", i64), ("values", f), ("temperature", f), ("k", i64)] + ([("mask", f)] if mask_rows else [])
    axes = helper.make_tensor("axes", i64, [1], [1])
    nodes = [helper.make_node("ScatterElements", ["logits", "ids", "values"], ["s"], axis=1),
             helper.make_node("Unsqueeze", ["temperature", "axes"], ["t"])]
    x = "s"
    if mask_rows:
        nodes.append(helper.make_node("Add", ["s", "mask"], ["m"]))
        x = "m"
    nodes += [helper.make_node("Div", [x, "t"], ["d"]), helper.make_node("LogSoftmax", ["d"], ["lp"], axis=1),
              helper.make_node("TopK", ["lp", "k"], ["topk_logprobs", "topk_ids"], axis=1)]
    graph = helper.make_graph(nodes, "tail", [helper.make_tensor_value_info(n, t, None) for n, t in ins],
                              [helper.make_tensor_value_info("topk_logprobs", f, None),
                               helper.make_tensor_value_info("topk_ids", i64, None)], [axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@needs_kernel
@pytest.mark.parametrize("mask_rows", [None, 1, 5])
def test_sampling_tail_computes_what_its_five_operators_compute(mask_rows):
    """ruvllm.SampleTopK (the rewrite of the tail) against the tail on onnxruntime's operators: the same ids in the
    same order (ties in index order), log-probabilities within a few ulps; penalized duplicates and negative ids
    are scattered as ScatterElements does; a row's result does not depend on the other rows."""
    model = sampling_tail(mask_rows)
    plain = ort.InferenceSession(model.SerializeToString())
    assert graph_rewrite.fuse_sampling(model) == 1
    assert [n.op_type for n in model.graph.node] == ["SampleTopK"]
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(LIB))
    ours = ort.InferenceSession(model.SerializeToString(), opts)
    rng = np.random.default_rng(7)
    B, V = 5, 1000 + 3  # a vocabulary that is not a multiple of the vector width
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    logits[1, [10, 500, 900]] = logits[1].max() + 1  # a three-way tie at the top: index order
    logits[2, 7::50] = 2.5  # ties inside the top k
    ids = rng.integers(-V, V, (B, 6))
    ids[:, 5] = ids[:, 0]  # a duplicate writing the same value (how the engine pads rows)
    values = (rng.standard_normal((B, 6)) * 3).astype(np.float32)
    values[:, 5] = values[:, 0]
    feeds = {"logits": logits, "ids": ids, "values": values,
             "temperature": np.array([1.0, 0.7, 1.3, 1.0, 0.25], np.float32)}
    if mask_rows:
        mask = np.zeros((mask_rows, V), np.float32)
        mask[-1, rng.choice(V, V // 2, replace=False)] = -np.inf  # a constrained row: half the vocabulary banned
        feeds["mask"] = mask
    for k in (1, 8, 64, V):
        feeds["k"] = np.array([k], np.int64)
        want_lp, want_ids = plain.run(None, feeds)
        got_lp, got_ids = ours.run(None, feeds)
        assert got_ids.dtype == np.int64 and got_lp.shape == want_lp.shape == (B, k)
        finite = np.isfinite(want_lp)
        assert np.array_equal(got_ids[finite], want_ids[finite]), k
        assert np.array_equal(np.isfinite(got_lp), finite)
        assert np.abs(got_lp[finite] - want_lp[finite]).max() <= 2e-6 * max(1.0, np.abs(want_lp[finite]).max())
        shared = ("k", "mask") if mask_rows == 1 else ("k",)  # a one-row mask is every row's
        alone = ours.run(None, {n: v if n in shared else v[3:4] for n, v in feeds.items()})
        assert np.array_equal(alone[0][0], got_lp[3]) and np.array_equal(alone[1][0], got_ids[3])
    feeds["k"] = np.array([V + 1], np.int64)
    with pytest.raises(Exception, match="k must be in"):
        ours.run(None, feeds)


@needs_kernel
def test_the_packages_sampling_tail_is_rewritten_and_gives_the_same_tokens(tiny_package, monkeypatch):
    """A package's graph has its tail fused; sampled and greedy tokens (penalties, a logit bias) are those of the
    graph with onnxruntime's tail."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    path = tiny_package("llama", "int4")
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.4, logit_bias={7: 5.0})]
    fused_tails, rewrite = [], graph_rewrite.rewrite_graph

    def spy(*args, **kwargs):
        model, counts = rewrite(*args, **kwargs)
        fused_tails.append(counts["SampleTopK"])
        return model, counts

    monkeypatch.setattr(graph_rewrite, "rewrite_graph", spy)

    def tokens() -> list[list[int]]:
        fused_tails.clear()
        engine = Engine.from_package(str(path), threads=2)
        return [list(engine.generate([5, 6, 7, 8], p))[-1].token_ids for p in params]

    fused = tokens()
    assert fused_tails and all(n == 1 for n in fused_tails)
    monkeypatch.setattr(kernel_library, "operators", lambda lib=None: OPS - {"SampleTopK"})
    plain = tokens()
    assert fused_tails and not any(fused_tails)
    assert fused == plain
