"""--target wasm: int4/int8 storage, standard DequantizeLinear + MatMul, fp32 compute after load."""

from __future__ import annotations

import onnx
import pytest

from runtime.package import load_package
from runtime.text.tokenizer import Tokenizer
from tests.conftest import run_cli
from tests.exporter.test_quantization import TEXT, quality, teacher_forced_logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's tiny config ties the embeddings
def test_browser_package_matches_the_native_int4_package(arch, tiny_package, tiny_model_dir, workdir):
    from exporter.convert import ConvertOptions, convert

    web = load_package(tiny_package(arch, "int4", "wasm"))
    # the browser's head is int8; a tied native int4 package defaults to a rescored int4 head, so
    # compare with the native layout that has the browser's head
    cpu = load_package(convert(str(tiny_model_dir(arch)), workdir / f"pkg-{arch}-int4-head8",
                               ConvertOptions(quant="int4", head_quant="int8", progress=False, lora=False)))
    q = web.manifest["quantization"]
    assert q["weights"] == "int4" and q["compute"] == "fp32" and web.session_config == {"session.disable_quant_qdq": "1"}
    graph = onnx.load(web.graph_path, load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert "MatMulNBits" not in ops and "DequantizeLinear" in ops
    native = onnx.load(cpu.graph_path, load_external_data=False).graph
    # one DequantizeLinear per grid of the native package (4 per layer and the head; MatMulQ4 in the kernel's layout)
    grids = sum(n.op_type in ("MatMulNBits", "MatMulQ4") for n in native.node)
    assert sum(n.op_type == "DequantizeLinear" for n in graph.node) == grids == 4 * cpu.config["num_layers"] + 1
    tok = Tokenizer.from_file(web.file("tokenizer.json"), web.manifest["tokenizer"])
    ids = tok.encode(TEXT)[:40]
    ref = teacher_forced_logprobs(cpu.path, ids)
    got = teacher_forced_logprobs(web.path, ids)
    # the same int4 weights; only int8 activations (native accuracy_level 4) and fp16 scales differ
    assert quality(ref, got, ids)["kl"] < 1e-3
    assert quality(teacher_forced_logprobs(tiny_package(arch, "fp32"), ids), got, ids)["kl"] < 0.1
    if arch == "qwen2":  # the tied table is read from the int8 head, not shipped a second time
        assert web.manifest["quantization"]["embeddings"] == "tied to the int8 lm_head"
        assert web.file("model.onnx.data").stat().st_size < cpu.file("model.onnx.data").stat().st_size


def test_target_wasm_chooses_int4_by_itself(tiny_model_dir, workdir):
    out = workdir / "cli-wasm-default"
    proc = run_cli("convert", str(tiny_model_dir("llama")), "-o", str(out), "--target", "wasm", "--no-lora", "--quiet",
                   module="exporter")
    assert proc.returncode == 0, proc.stderr[-2000:]
    q = load_package(out).manifest["quantization"]
    assert (q["weights"], q["lm_head"], q["compute"]) == ("int4", "int8", "fp32")
