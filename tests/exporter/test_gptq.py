"""GPTQ: its integers reach MatMulNBits as they are, it beats round-to-nearest on the output error it
minimizes, and a GPTQ export (alone or after AWQ) matches fp32."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from exporter.quantizers.awq import block_grid, fake_quantize
from exporter.quantizers.gptq import gptq_quantize
from exporter.quantizers.grid import Grid, pack_nbits
from runtime.package import load_package
from runtime.text.tokenizer import Tokenizer
from tests.exporter.test_quantization import TEXT, quality, teacher_forced_logprobs


def rtn_grid(w: np.ndarray, block: int, bits: int) -> Grid:
    out_f, in_f = w.shape
    wb = np.pad(w, ((0, 0), (0, -in_f % block))).reshape(out_f, -1, block)
    scale, zero = (t.numpy() for t in block_grid(torch.from_numpy(wb), bits))
    q = np.clip(np.round(wb / scale[..., None] + zero[..., None]), 0, 2 ** bits - 1).reshape(out_f, -1)[:, :in_f]
    return Grid(q.astype(np.uint8), scale.astype(np.float32), zero.astype(np.uint8), block, bits)


@pytest.mark.parametrize("bits,in_f", [(4, 192), (4, 256), (8, 192)])
def test_packed_grid_is_what_matmulnbits_computes(bits, in_f):
    """pack_nbits lays out B, scales and zero points as the kernel reads them (an odd number of
    blocks included: 4-bit zero points pad each row to whole bytes)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    out_f, block = 40, 64
    w = rng.standard_normal((out_f, in_f)).astype(np.float32)
    grid = rtn_grid(w, block, bits)
    # the grid is MatMulNBits' own round-to-nearest, as awq.fake_quantize models it
    np.testing.assert_allclose(grid.dequantize(), fake_quantize(torch.from_numpy(w), block, bits).numpy(), atol=1e-5)
    b, scales, zeros = pack_nbits(grid)
    node = helper.make_node("MatMulNBits", ["x", "b", "s", "z"], ["y"], domain="com.microsoft", K=in_f, N=out_f,
                            bits=bits, block_size=block, accuracy_level=0)  # fp32 compute: exact to compare
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", in_f])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", out_f])],
                              [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "s"),
                               numpy_helper.from_array(zeros, "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((3, in_f)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ grid.dequantize().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(act_order):
    """On inputs with correlated, unevenly scaled channels (as real activations are), GPTQ's output
    error is well below RTN's on the same grid, on the calibration rows and on fresh ones."""
    rng = np.random.default_rng(1)
    in_f, out_f, block = 256, 64, 64
    mix = rng.standard_normal((in_f, in_f)) * np.exp(rng.standard_normal(in_f))  # correlated, uneven channels

    def inputs(n):
        return torch.from_numpy((rng.standard_normal((n, in_f)) @ mix).astype(np.float32))

    w = torch.from_numpy(rng.standard_normal((out_f, in_f)).astype(np.float32))
    x = inputs(2048)
    grid = gptq_quantize(w, x.double().T @ x.double(), block, 4, act_order)
    gptq_w, rtn_w = torch.from_numpy(grid.dequantize()), fake_quantize(w, block, 4)
    for xs in (x, inputs(1024)):
        err = {name: ((xs @ q.T - xs @ w.T) ** 2).mean().item() for name, q in (("gptq", gptq_w), ("rtn", rtn_w))}
        assert err["gptq"] < 0.7 * err["rtn"], err
    assert grid.q.max() <= 15 and grid.q.dtype == np.uint8
    if act_order:  # the blocks' ranges are fixed from the weights as given (AWQ's clipping survives)
        rtn = rtn_grid(w.numpy(), block, 4)
        np.testing.assert_allclose(grid.scale, rtn.scale)
        np.testing.assert_array_equal(grid.zero, rtn.zero)


@pytest.mark.parametrize("method", ["gptq", "awq+gptq"])
def test_gptq_export(method, tiny_model_dir, tiny_package, workdir, monkeypatch):
    """Every projection of both graphs carries GPTQ's integers, scales and zero points (not RTN's of the
    dequantized weights), the manifest names the method and its calibration, and the model matches fp32."""
    from onnx import numpy_helper

    import exporter.convert as conv

    found, real, real_samples, sampled = {}, conv.apply_gptq, conv.model_samples, []

    def keep(*args, **kwargs):
        found.update(real(*args, **kwargs))
        return found

    def samples(*args, **kwargs):
        sampled.append(real_samples(*args, **kwargs))
        return sampled[-1]

    monkeypatch.setattr(conv, "apply_gptq", keep)
    monkeypatch.setattr(conv, "model_samples", samples)
    pkg = load_package(conv.convert(str(tiny_model_dir("llama")), workdir / f"pkg-llama-int4-{method}",
                                    conv.ConvertOptions(quant="int4", method=method, block_size=16, progress=False)))
    q = pkg.manifest["quantization"]
    assert (q["method"], q["calibration"]) == (method, "python-stdlib-docs")
    length = min(512, pkg.manifest["config"]["max_positions"])
    assert q["gptq"]["calibration"] == f"half of it, and 8 samples of {length} tokens from the model itself"
    assert len(sampled) == 1 and len(sampled[0]) == 8 and {len(s) for s in sampled[0]} == {length}
    layers = pkg.manifest["config"]["num_layers"]
    assert sorted(found) == sorted(f"layers.{i}.{n}" for i in range(layers)
                                   for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    for path in (pkg.graph_path, pkg.lora_graph_path):
        model = onnx.load(str(path))
        inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for name, grid in found.items():
            for tensor, want in zip((f"{name}_Q4", f"{name}_scales", f"{name}_zero_points"), pack_nbits(grid)):
                np.testing.assert_array_equal(inits[tensor], want.astype(inits[tensor].dtype))
    tok = Tokenizer.from_file(pkg.file("tokenizer.json"), pkg.manifest["tokenizer"])
    ids = tok.encode(TEXT)[:40]
    ref = teacher_forced_logprobs(tiny_package("llama", "fp32"), ids)
    assert quality(ref, teacher_forced_logprobs(pkg.path, ids), ids)["kl"] < 0.1


def test_gptq_with_own_calibration_text(tiny_model_dir, workdir, tmp_path, monkeypatch):
    """--calibration FILE: GPTQ calibrates on that text alone (no samples of the model's own)."""
    import exporter.convert as conv

    monkeypatch.setattr(conv, "model_samples", lambda *a, **k: pytest.fail("sampled with a calibration file"))
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT * 20)
    pkg = load_package(conv.convert(str(tiny_model_dir("llama")), workdir / "pkg-llama-int4-gptq-file",
                                    conv.ConvertOptions(quant="int4", method="gptq", block_size=16,
                                                        calibration=str(text), progress=False, lora=False)))
    q = pkg.manifest["quantization"]
    assert q["calibration"] == q["gptq"]["calibration"] == "calibration.txt"


@pytest.mark.parametrize("n", [96, 700, 1100])
def test_hessian_permuted_and_factored_in_its_own_memory(n):
    """The symmetric permutation and the upper Cholesky factor of H^-1 are torch's (gather, cholesky,
    cholesky_inverse, cholesky upper), made in H's memory (sizes past one 512 block and ragged ones)."""
    from exporter.quantizers.gptq import _inverse_cholesky_upper_, _permute_symmetric_

    rng = np.random.default_rng(n)
    x = torch.from_numpy(rng.standard_normal((2 * n, n)).astype(np.float32) * np.exp(rng.standard_normal(n)).astype(np.float32))
    h = x.T @ x + 0.1 * torch.eye(n)
    perm = torch.from_numpy(rng.permutation(n))
    want = h[perm[:, None], perm]
    got = h.clone()
    address = got.data_ptr()
    _permute_symmetric_(got, perm)
    assert torch.equal(got, want)
    u = _inverse_cholesky_upper_(got)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(want.double())), upper=True)
    assert u.data_ptr() == address and torch.equal(torch.triu(u), u)
    assert torch.allclose(u.double(), ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


def test_gptq_holds_one_hessian():
    """GPTQ on a 6,144-input projection: the peak above its inputs is a few copies of the (small) weights,
    not a second Hessian (torch's factorizations each made one)."""
    code = """
import numpy as np, torch
from scipy.linalg import lapack
from exporter.quantizers.gptq import gptq_quantize
lapack.spotrf(np.asfortranarray(np.eye(256, dtype=np.float32)), overwrite_a=1)  # LAPACK's own start-up, apart
def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
n, out_f = 6144, 128
h = torch.zeros(n, n); x = torch.randn(256, n); h.addmm_(x.T, x); del x
w = torch.randn(out_f, n)
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS:")
gptq_quantize(w, h, 32, 4)
print((status("VmHWM:") - before) / 1024)
"""
    grew = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[2]).stdout)
    hessian = 6144 * 6144 * 4 / 2**20  # 144 MB; the weights 3 MB
    assert grew < 0.5 * hessian, grew


def test_a_layer_quantizes_its_groups_in_order_one_hessian_at_a_time(monkeypatch):
    """gptq_layer calibrates each projection group on the inputs the groups before it give once quantized
    (o_proj through the quantized q, k and v; down_proj through the quantized gate and up, computed from
    their grid), holds one Hessian at a time, and has let go of every other float weight while down_proj is
    quantized; the layer ends on its grids' values, and its outputs are theirs."""
    import copy
    import weakref

    from transformers import LlamaConfig, LlamaForCausalLM

    import exporter.quantizers.gptq as g

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    captured = g.capture_first_layer(model, [list(range(1, 33)), list(range(40, 72))])
    inputs = [(h.clone(), kw) for h, kw in captured]
    layer = model.model.layers[0]
    ref = copy.deepcopy(layer)
    seen, live, real = [], [], g.gptq_quantize

    def spy(w, h, *args, **kwargs):
        assert all(r() is None for r in live), "an earlier group's Hessian is still held"
        live.append(weakref.ref(h))
        seen.append((h.clone(), {n: p.numel() for n, p in layer.named_parameters() if n.endswith("proj.weight")}))
        return real(w, h, *args, **kwargs)

    monkeypatch.setattr(g, "gptq_quantize", spy)
    grids, outputs = g.gptq_layer(0, layer, captured, 16, 4)

    def xtx(target):
        xs = []
        hook = target.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))
        with torch.no_grad():
            for h, kw in inputs:
                ref(h, **kw)
        hook.remove()
        x = torch.cat(xs)
        return x.T @ x

    def quantized(name, *mods):
        w = torch.from_numpy(grids[f"layers.0.{name}"].dequantize())
        for m, part in zip(mods, torch.split(w, [m.out_features for m in mods])):
            m.weight.data = part.clone()

    attn, mlp = ref.self_attn, ref.mlp
    order = [("qkv_proj", attn.q_proj, (attn.q_proj, attn.k_proj, attn.v_proj)),
             ("o_proj", attn.o_proj, (attn.o_proj,)),
             ("gate_up_proj", mlp.gate_proj, (mlp.gate_proj, mlp.up_proj)),
             ("down_proj", mlp.down_proj, (mlp.down_proj,))]
    assert len(seen) == len(order)
    for (name, target, mods), (h, _) in zip(order, seen):
        want = xtx(target)
        torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=name)
        quantized(name, *mods)
    assert not any(seen[-1][1].values()), seen[-1][1]  # while down_proj is quantized no float weight is held
    for (name, p), (_, want) in zip(layer.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, want), name
    with torch.no_grad():
        for (out, _), (h, kw) in zip(outputs, inputs):
            torch.testing.assert_close(out, g.layer_output(ref(h, **kw)))


@pytest.mark.parametrize("mins", [False, True])
def test_a_grids_rows_dequantize_as_the_whole(mins):
    """gptq_layer writes the dequantized weights back 1,024 rows at a time: Grid.rows' numbers are the
    whole grid's rows, bit for bit."""
    rng = np.random.default_rng(3)
    out_f, in_f, block = 2500, 96, 32
    grid = Grid(rng.integers(0, 16, (out_f, in_f), dtype=np.uint8), rng.random((out_f, 3), dtype=np.float32),
                rng.integers(0, 16, (out_f, 3), dtype=np.uint8), block, 4,
                rng.standard_normal((out_f, 3)).astype(np.float32) if mins else None)
    whole = grid.dequantize()
    parts = [grid.rows(r, min(r + 1024, out_f)).dequantize() for r in range(0, out_f, 1024)]
    assert np.array_equal(np.concatenate(parts), whole)
